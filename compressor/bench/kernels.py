"""`unionsparse bench`: the IE-BME kernel beside cuBLAS fp16 and a dense int8 GEMM on the same shapes.

Every timing is a CUDA-graph replay of R back-to-back launches between two events, the weights rotated
among copies that together exceed the L2 (so each launch reads its weights from HBM), warm-up
excluded, median over replays; time per launch = median / R. Bytes are each kernel's own minimum
traffic (every array read once, the output written once); bandwidth = bytes / time; the roofline
time is the IE-BME kernel's bytes over ``PEAK_BW``.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from ...formats import registry
from .tiled_cbc import replay_seconds_cupy, replay_seconds_torch

PEAK_BW = 4.16e12  # B/s, H200 (the figure the targets are stated against)
ROTATE_BYTES = 256e6  # weights rotated among copies totalling at least this (L2 is 50-60 MB)

SPINFER_M = [8192, 4096, 32000, 32000, 28672, 5120, 5120, 3584, 4096, 13824, 8192, 18944, 14336, 4096, 8192,
             11008, 32000, 20480, 3584, 21504, 7168, 28672, 7168, 27648, 9216, 36864, 9216, 36864, 12288,
             49152, 12288]
SPINFER_K = [29568, 4096, 5120, 8192, 8192, 5120, 13824, 20480, 11008, 5120, 8192, 3584, 4096, 14336, 28672,
             4096, 4096, 3584, 18944, 7168, 7168, 7168, 28672, 9216, 9216, 9216, 36864, 12288, 12288, 12288,
             49152]

MODELS = {  # (hidden, intermediate, kv width) -> projections (M, K)
    "llama2-7b": (4096, 11008, 4096),
    "llama2-13b": (5120, 13824, 5120),
    "opt-13b": (5120, 20480, 5120),
    "qwen2-7b": (3584, 18944, 512),
    "llama3-8b": (4096, 14336, 1024),
}


def spinfer_shapes() -> list[tuple[str, int, int]]:
    return [(f"spinfer-{i}", m, k) for i, (m, k) in enumerate(zip(SPINFER_M, SPINFER_K, strict=True))]


def unionsparse_shapes() -> list[tuple[str, int, int]]:
    out: dict[tuple[int, int], str] = {}
    for name, (h, inter, kv) in MODELS.items():
        for proj, mk in (("q/o", (h, h)), ("k/v", (kv, h)), ("gate/up", (inter, h)), ("down", (h, inter))):
            out.setdefault(mk, f"{name}:{proj}")
    return [(label, m, k) for (m, k), label in out.items()]


def synth_layer(m: int, k: int, bits: int, sparsity: float, perm: str, group_size: int, seed: int):
    """A device layer with the statistics of a random unstructured mask, built on the GPU.

    Union positions are active with probability 1 - sparsity^4 (4 independent areas), exactly as
    encoding a random mask would give; values are random codes. ``perm``: none | identity | random.
    """
    import cupy as cp

    from ...kernels.iebme_spmm import device_layer, padded_rows

    rs = cp.random.RandomState(seed)
    tr, tc = -(-m // 16), -(-k // 64)
    t = tr * tc
    active = rs.random_sample((t, 256), dtype=cp.float32) < (1.0 - sparsity**4)
    bitmaps = cp.packbits(active.ravel(), bitorder="little")  # rows are 256 bits: row-major packing
    p = active.sum(axis=1, dtype=cp.int64)
    align = 128 // bits
    seg = (4 * p + align - 1) // align * align
    offsets = cp.zeros(t + 1, dtype=cp.int64)
    offsets[1:] = cp.cumsum(seg)
    nbytes = int(offsets[-1]) * bits // 8
    values = rs.randint(0, 256, nbytes + 16, dtype=cp.int32).astype(cp.uint8)
    g = -(-k // group_size)
    wst = (rs.random_sample((g, padded_rows(m)), dtype=cp.float32) * 0.5 + 0.5).astype(cp.float16)
    pinv = None
    if perm == "identity":
        pinv = cp.tile(cp.arange(16, dtype=cp.uint8), (t, 1))
    elif perm == "random":
        pinv = cp.argsort(rs.random_sample((t, 16), dtype=cp.float32), axis=1).astype(cp.uint8)
    return device_layer((m, k), bits, group_size, values, bitmaps, offsets.astype(cp.uint32), pinv, wst)


def _graph_time_cupy(launch_i, n_copies: int, est_s: float) -> float:
    """Median seconds per launch of ``launch_i(i, stream)`` over graph replays."""
    import cupy as cp

    reps = int(min(2000, max(n_copies, math.ceil(2e-3 / max(est_s, 1e-7)))))
    reps = -(-reps // n_copies) * n_copies
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        for i in range(reps):
            launch_i(i % n_copies, s)
        graph = s.end_capture()
    if hasattr(graph, "upload"):
        graph.upload(s)
    for _ in range(3):
        graph.launch(s)
    return statistics.median(replay_seconds_cupy(cp, graph, s, reps, 10))


def _estimate_cupy(fn) -> float:
    import cupy as cp

    fn()
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record()
    for _ in range(3):
        fn()
    e1.record()
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / 3


def _graph_time_torch(fn_i, n_copies: int, est_s: float) -> float:
    import torch

    reps = int(min(2000, max(n_copies, math.ceil(2e-3 / max(est_s, 1e-7)))))
    reps = -(-reps // n_copies) * n_copies
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n_copies):  # warm-up outside the graph (cuBLAS handles, workspaces)
            fn_i(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn_i(i % n_copies)
    for _ in range(3):
        g.replay()
    return statistics.median(replay_seconds_torch(torch, g, reps, 10))


def _estimate_torch(fn) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(3):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) * 1e-3 / 3


def time_iebme(layers, n: int, splits: int | None = None) -> tuple[float, int]:
    import cupy as cp

    from ...kernels.iebme_spmm import launch

    ly = layers[0]
    m, k = ly.shape
    x = cp.asarray(np.random.default_rng(n).integers(-8, 8, (n, ly.tc * 64), dtype=np.int8))
    xs = cp.asarray(np.random.default_rng(n).random((n, ly.n_groups), dtype=np.float32) + 0.5)
    y = cp.empty((n, m), dtype=cp.uint16)
    est = _estimate_cupy(lambda: launch(ly, x, xs, y, splits=splits))
    t = _graph_time_cupy(lambda i, s: launch(layers[i], x, xs, y, splits=splits, stream=s), len(layers), est)
    return t, ly.kernel_bytes(n)


def time_cublas(m: int, k: int, n: int, weights) -> tuple[float, int]:
    import torch

    x = torch.randn(n, k, device="cuda", dtype=torch.float16)
    est = _estimate_torch(lambda: torch.nn.functional.linear(x, weights[0]))
    t = _graph_time_torch(lambda i: torch.nn.functional.linear(x, weights[i]), len(weights), est)
    return t, 2 * m * k + 2 * n * k + 2 * n * m


def time_int8(m: int, k: int, n: int, weights) -> tuple[float | None, int, int]:
    """torch._int_mm (cuBLASLt int8); it needs more than 16 rows, so N is padded to at least 24."""
    import torch

    npad = max(24, -(-n // 8) * 8)
    x = torch.randint(-8, 8, (npad, k), device="cuda", dtype=torch.int8)
    try:
        est = _estimate_torch(lambda: torch._int_mm(x, weights[0].t()))
        t = _graph_time_torch(lambda i: torch._int_mm(x, weights[i].t()), len(weights), est)
    except Exception:  # shape unsupported by this torch / cuBLASLt build
        return None, 0, npad
    return t, m * k + npad * k + 4 * npad * m, npad


def baseline_fields(m: int, k: int, n: int, t: float, wf, wi) -> dict:
    """cuBLAS fp16 and dense int8 on the same shape beside an IE-BME time ``t`` (seconds): row fields."""
    tc, bc = time_cublas(m, k, n, wf)
    ti, bi, npad = time_int8(m, k, n, wi)
    return {"cublas_us": tc * 1e6, "cublas_GBps": bc / tc / 1e9, "speedup_vs_cublas": tc / t,
            "int8_us": None if ti is None else ti * 1e6, "int8_N_padded": npad,
            "int8_GBps": None if ti is None else bi / ti / 1e9, "speedup_vs_int8": None if ti is None else ti / t}


def int8_weights(m: int, k: int) -> list:
    """Random int8 [m, k] weight copies for ``time_int8`` (together beyond L2)."""
    import torch

    return [torch.randint(-8, 8, (m, k), device="cuda", dtype=torch.int8) for _ in range(n_copies(m * k))]


def n_copies(nbytes: int) -> int:
    return int(max(2, min(32, math.ceil(ROTATE_BYTES / max(nbytes, 1)))))


def run_bench(shapes, ns, sparsity: float = 0.5, bits: int = 4, group_size: int = 128, perm: str = "none",
              baselines: bool = True, seed: int = 0, log=print, deadline: float | None = None) -> list[dict]:
    """Time the IE-BME kernel (and cuBLAS fp16, int8 dense) on ``shapes`` [(label, M, K)] for each N.

    ``deadline`` (a ``time.time()`` value): shapes not started by then are skipped.
    """
    import time

    import cupy as cp
    import torch

    rows = []
    for label, m, k in shapes:
        if deadline is not None and time.time() > deadline:
            if log:
                log(f"deadline reached: skipping {label} and later shapes")
            break
        one = synth_layer(m, k, bits, sparsity, perm, group_size, seed)
        nb = int(one.values.nbytes + one.bitmaps.nbytes)
        layers = [one] + [synth_layer(m, k, bits, sparsity, perm, group_size, seed + i)
                          for i in range(1, n_copies(nb))]
        wf = wi = None
        if baselines:
            wf = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(n_copies(2 * m * k))]
            wi = int8_weights(m, k)
        for n in ns:
            t, b = time_iebme(layers, n)
            row = {"shape": label, "M": m, "K": k, "N": n, "bits": bits, "sparsity": sparsity, "perm": perm,
                   "group_size": group_size, "iebme_us": t * 1e6, "iebme_bytes": b, "iebme_GBps": b / t / 1e9,
                   "iebme_bw_frac": b / t / PEAK_BW, "roofline_us": b / PEAK_BW * 1e6,
                   "fp16_weight_MB": 2 * m * k / 1e6}
            if baselines:
                row.update(baseline_fields(m, k, n, t, wf, wi))
            rows.append(row)
            if log:
                log(" ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                             for key, val in row.items()))
        del layers, wf, wi
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    return rows


def geomean(xs) -> float:
    xs = [x for x in xs if x]
    return float(np.exp(np.mean(np.log(xs)))) if xs else float("nan")


def summarize(rows: list[dict]) -> dict:
    """Geomean speedup vs cuBLAS per N; mean IE-BME bandwidth fraction on shapes with fp16 weights > 100 MB."""
    out = {}
    for n in sorted({r["N"] for r in rows}):
        rn = [r for r in rows if r["N"] == n]
        big = [r["iebme_bw_frac"] for r in rn if r["fp16_weight_MB"] > 100 and "iebme_bw_frac" in r]
        out[n] = {"geomean_speedup_vs_cublas": geomean(r.get("speedup_vs_cublas") for r in rn),
                  "geomean_speedup_vs_int8": geomean(r.get("speedup_vs_int8") for r in rn),
                  "mean_bw_frac_over_100MB": float(np.mean(big)) if big else None,
                  "min_bw_frac_over_100MB": float(np.min(big)) if big else None, "cases": len(rn)}
    return out


def bench_command(artifact: str | None, shapes: str, ns: list[int], sparsity: float, as_json: bool,
                  fmt: str | None = None, verify: bool = True) -> dict:
    """What `unionsparse bench` runs; returns {'rows', 'summary'} (``fmt``: the kernels of that format, by default the
    default format's; ``verify``: the artifact's files checked against its manifest as they are read)."""
    from ...kernels import available

    if not available():
        from ..errors import UserError

        raise UserError("bench needs CuPy and a CUDA device (none found here)")
    if artifact:
        rows = bench_artifact(artifact, ns, verify)
        if not rows:
            from ..errors import UserError

            raise UserError(f"{artifact}: no layer with a GPU kernel (IE-BME W4/W2 or Tiled-CBC) to time")
    else:
        sel = {"spinfer": spinfer_shapes, "unionsparse": unionsparse_shapes}.get(shapes)
        if sel is None:
            from ..errors import UserError

            raise UserError(f"--shapes must be spinfer or unionsparse, got {shapes!r}")
        ops = registry.get(fmt or registry.names()[0]).kernel_ops
        bench = next((_SHAPE_BENCHES[op] for op in ops if op in _SHAPE_BENCHES), None)
        if bench is None:
            from ..errors import UserError

            raise UserError(f"--format {fmt}: no kernels of its own to time")
        return bench(sel(), ns, sparsity, None if as_json else print)
    return {"rows": rows, "summary": summarize(rows)}


def _iebme_shapes(shapes, ns: list[int], sparsity: float, log) -> dict:
    rows = run_bench(shapes, ns, sparsity, log=log)
    return {"rows": rows, "summary": summarize(rows)}


def _tiled_cbc_shapes(shapes, ns: list[int], sparsity: float, log) -> dict:
    """spMspV (N = 1, + 30% dynamic) / SpMM (N > 1): see bench/tiled_cbc.py."""
    from .tiled_cbc import bench_rows

    rows = bench_rows(shapes, ns, sparsity, log=log)
    summary = {}
    for n in sorted({r["N"] for r in rows}):
        sp = [r["speedup_vs_cublas"] for r in rows if r["N"] == n]
        summary[n] = {"geomean_speedup_vs_cublas": geomean(sp), "cases": len(sp)}
    return {"rows": rows, "summary": summary}


_SHAPE_BENCHES = {"iebme_spmm": _iebme_shapes, "spmspv": _tiled_cbc_shapes}  # by runtime op (Format.kernel_ops)


def bench_artifact(path, ns: list[int], verify: bool = True) -> list[dict]:
    """Time every IE-BME W4/W2 and Tiled-CBC layer of an artifact (its real arrays) beside cuBLAS fp16 on its
    shape, and IE-BME beside dense int8 too (Tiled-CBC: ``tiled_cbc_bench.bench_layer``)."""
    import cupy as cp
    import torch

    from ...kernels.iebme_spmm import prepare_layer
    from ...kernels.tiled_cbc_device import TILE
    from ..artifact.store import Artifact
    from .tiled_cbc import bench_layer

    art = path if isinstance(path, Artifact) else Artifact(path, verify=verify)  # opened once by the command
    rows = []
    for name in art.layer_names:
        rec = art.read_layer(name)
        ops = registry.get(rec.format).kernel_ops
        if "spmspv" in ops and tuple(rec.encoding.tile) == TILE:
            dp = rec.attrs.get("dp_sparsity") if rec.attrs.get("dp_threshold") is not None else None
            rows += bench_layer(name, rec.encoding, rec.scales, rec.attrs.get("group_size"), dp, ns)
            continue
        if "iebme_spmm" not in ops or rec.encoding.bits not in (2, 4):
            continue
        m, k = rec.encoding.shape
        gs = int(rec.attrs["group_size"])
        nb = rec.encoding.values.nbytes
        layers = [prepare_layer(rec.encoding, rec.scales, gs) for _ in range(n_copies(nb))]
        wf = [torch.randn(m, k, device="cuda", dtype=torch.float16) for _ in range(n_copies(2 * m * k))]
        wi = int8_weights(m, k)
        for n in ns:
            t, b = time_iebme(layers, n)
            rows.append({"shape": name, "M": m, "K": k, "N": n, "format": rec.format, "bits": rec.encoding.bits,
                         "iebme_us": t * 1e6, "iebme_bytes": b, "iebme_GBps": b / t / 1e9,
                         "iebme_bw_frac": b / t / PEAK_BW, "fp16_weight_MB": 2 * m * k / 1e6,
                         **baseline_fields(m, k, n, t, wf, wi)})
        del layers, wf, wi
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    return rows
