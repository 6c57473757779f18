"""Tiled-CBC kernels beside cuBLAS fp16 (torch) on the same shapes, in one run, on one GPU.

spMspV (N = 1) at static 50% + dynamic 30% and static 30% + dynamic 30% on SpInfer's 31 (M, K) pairs
(docs/cli.md) against ``torch.matmul(W, x)`` (cuBLAS fp16 GEMV); SpMM at N = 16..4096 on a subset
against ``torch.nn.functional.linear(X, W)`` (cuBLAS fp16 GEMM).
Timing (BENCHMARKS.md): each measurement is a CUDA graph of back-to-back launches cycling through copies
of the weights whose total exceeds 200 MB (> 3x the 60 MB L2), replayed between CUDA events after a
warm-up replay; the median over replays, divided by the launches per graph, is reported.
Weights: random fp16 with a uniformly random mask at the static sparsity, encoded on the GPU
(``encode_on_device``, byte-identical to ``tiled_cbc.encode``, checked in the tests); x ~ N(0, 1) with
tau = its own 30% quantile of |x| (``tau_from_samples``), so exactly 30% of the inputs are inactive.
spMspV also runs on int4 values (``--spmspv-bits``, default 16,4): random nonzero codes with fp16 scales per
128 inputs (W4A16), beside the same cuBLAS fp16 GEMV.

The command line that runs it all and writes the figures is ``benchmarks/bench_tiled_cbc.py`` (this module is
library code only). ``bench_rows`` is the entry point for ``unionsparse bench --format tiled-cbc``
(``compressor/bench/kernels.py``).
"""

from __future__ import annotations

import contextlib
import math
import platform
import subprocess
import time

import numpy as np

from ...formats.tiled_cbc import NAME as TCBC_NAME

SPINFER_M = [
    8192,
    4096,
    32000,
    32000,
    28672,
    5120,
    5120,
    3584,
    4096,
    13824,
    8192,
    18944,
    14336,
    4096,
    8192,
    11008,
    32000,
    20480,
    3584,
    21504,
    7168,
    28672,
    7168,
    27648,
    9216,
    36864,
    9216,
    36864,
    12288,
    49152,
    12288,
]
SPINFER_K = [
    29568,
    4096,
    5120,
    8192,
    8192,
    5120,
    13824,
    20480,
    11008,
    5120,
    8192,
    3584,
    4096,
    14336,
    28672,
    4096,
    4096,
    3584,
    18944,
    7168,
    7168,
    7168,
    28672,
    9216,
    9216,
    9216,
    36864,
    12288,
    12288,
    12288,
    49152,
]
SPINFER = list(zip(SPINFER_M, SPINFER_K, strict=True))
SPMM_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (28672, 8192)]
SPMM_NS = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
ROTATE_BYTES = 200e6


def geomean(v):
    v = [x for x in v if x and x > 0]
    return float(math.exp(sum(math.log(x) for x in v) / len(v))) if v else float("nan")


def replay_seconds_cupy(cp, graph, stream, n_launch: int, reps: int) -> list[float]:
    """Seconds per launch of each of ``reps`` replays of a CuPy ``graph`` of ``n_launch`` launches on ``stream``,
    each timed between two CUDA events."""
    ts = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        graph.launch(stream)
        e1.record(stream)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3 / n_launch)
    return ts


def replay_seconds_torch(torch, graph, n_launch: int, reps: int) -> list[float]:
    """:func:`replay_seconds_cupy` for a ``torch.cuda.CUDAGraph``, replayed on the current stream."""
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e-3 / n_launch)
    return ts


def time_graph_cupy(cp, launch, n_launch, reps=9):
    """Median seconds per launch of ``launch(i)`` for i in 0..n_launch-1, captured in one CUDA graph."""
    cp.cuda.Device().synchronize()  # inputs were made on the default stream
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for i in range(n_launch):
            launch(i)  # compile, allocate workspaces and warm up before capture
        s.synchronize()
        s.begin_capture()
        try:
            for i in range(n_launch):
                launch(i)
        except Exception:
            try:
                s.end_capture()
            except Exception:
                pass
            raise
        g = s.end_capture()
        g.launch(s)
        s.synchronize()
        ts = replay_seconds_cupy(cp, g, s, n_launch, reps)
    return float(np.median(ts))


def time_graph_torch(torch, launch, n_launch, reps=9):
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(n_launch, 3)):
            launch(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_launch):
            launch(i)
    g.replay()
    torch.cuda.synchronize()
    return float(np.median(replay_seconds_torch(torch, g, n_launch, reps)))


def copies_for(nbytes):
    return max(2, math.ceil(ROTATE_BYTES / max(nbytes, 1)))


def _clone(cp, arrays):
    return {k: (v.copy() if isinstance(v, cp.ndarray) else v) for k, v in arrays.items()}


def rotated_copies(cp, torch, W):
    """fp16 weights ``W`` as enough copies to rotate beyond L2: torch tensors for cuBLAS and Tiled-CBC device
    layers (encoded once on the GPU). Returns (torch copies, device layers); the first of each is ``W``'s."""
    from ...kernels.tiled_cbc_device import DeviceTiledCBC, encode_on_device

    Wt = torch.from_dlpack(W)
    Wd = [Wt] + [Wt.clone() for _ in range(copies_for(W.nbytes) - 1)]
    arrays = encode_on_device(W)
    dev0 = DeviceTiledCBC(arrays=arrays)
    devs = [dev0] + [DeviceTiledCBC(arrays=_clone(cp, arrays)) for _ in range(copies_for(dev0.nbytes()) - 1)]
    return Wd, devs


def random_weights(cp, M, K, sparsity, seed):
    rs = cp.random.RandomState(seed)
    W = (rs.standard_normal((M, K), dtype=cp.float32) * 0.02).astype(cp.float16)
    W[rs.random_sample((M, K), dtype=cp.float32) < sparsity] = 0
    return W


def random_codes(cp, M, K, sparsity, bits, group, seed):
    """Nonzero signed ``bits``-bit codes (int8) with a uniformly random mask at ``sparsity``, and fp16 group
    scales [M, ceil(K / group)]."""
    rs = cp.random.RandomState(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = rs.randint(lo, hi, size=(M, K)).astype(cp.int8)  # lo .. hi - 1, then 0 .. hi - 1 -> 1 .. hi
    q += (q >= 0).astype(cp.int8)
    q[rs.random_sample((M, K), dtype=cp.float32) < sparsity] = 0
    scales = (rs.random_sample((M, -(-K // group)), dtype=cp.float32) * 0.01 + 0.001).astype(cp.float16)
    return q, scales


def spmspv_candidates(bits: int = 16, full: bool = True) -> list[dict]:
    """Launch settings the benchmark tries per shape: v2 (warps, stages) x chunk scale x fp16 decode mode with
    split-K, and stream-K at 4 and 8 warps (``full=False``: the default launch only); for b-bit codes, the
    configurations built for them, split-K at two chunk scales and stream-K."""
    from ...kernels.tiled_cbc_spmspv import DEFAULT_MODES, V2_CONFIGS

    if not full:
        w, st = next((w, st) for b, w, st in V2_CONFIGS if b == bits)
        return [dict(warps=w, stages=st, scale=1.0, mode=DEFAULT_MODES[bits], streamk=None)]
    if bits != 16:
        ws = [(w, st) for b, w, st in V2_CONFIGS if b == bits]
        return [dict(warps=w, stages=st, scale=sc, mode=0, streamk=k)
                for w, st in ws for sc, k in ((1.0, False), (0.25, False), (1.0, True))]
    base = [(4, 2, 1.0), (4, 2, 0.25), (4, 3, 1.0), (8, 2, 1.0)]
    split = [dict(warps=w, stages=st, scale=sc, mode=m, streamk=False) for w, st, sc in base for m in (3, 0)]
    return split + [dict(warps=w, stages=2, scale=1.0, mode=m, streamk=True) for w in (4, 8) for m in (3, 0)]


def bench_spmspv(cp, torch, shapes, statics, dp, log, candidates=None, deadline=float("inf"), reps=5, bits=16,
                 group=128):
    """spMspV rows beside cuBLAS fp16 GEMV on the same shape: fp16 values (``bits`` 16) or random nonzero b-bit
    codes with fp16 scales per ``group`` inputs (the kernel's W4A16 / W2A16 path). A candidate's ``within``, if
    given, makes the context it is checked and timed in (a study's kernel build, ``kernels/study.py``)."""
    from ...kernels.tiled_cbc_device import DeviceTiledCBC, encode_on_device
    from ...kernels.tiled_cbc_spmspv import bytes_read, spmspv, v2_default_chunk, v2_default_config
    from ..activation_sparsity.thresholds import tau_from_samples

    candidates = spmspv_candidates(bits) if candidates is None else candidates
    rows = []
    for si, (M, K) in enumerate(shapes):
        if time.time() > deadline:
            log(f"time limit: spMspV stopped after {si} of {len(shapes)} shapes")
            break
        rs = np.random.default_rng(si)
        x_host = rs.standard_normal(K).astype(np.float16)
        tau = tau_from_samples(np.abs(x_host), dp)
        x = cp.asarray(x_host)
        xt = torch.as_tensor(x_host, device="cuda")
        dense_bytes = 2 * M * K
        t_cublas = None
        shape_cands = candidates
        for s in statics:
            W = random_weights(cp, M, K, s, 1000 + si)
            if t_cublas is None:  # cuBLAS time does not depend on the values
                Wt = torch.from_dlpack(W)
                nd = copies_for(dense_bytes)
                Wd = [Wt] + [Wt.clone() for _ in range(nd - 1)]
                t_cublas = time_graph_torch(
                    torch, lambda i, Wd=Wd, xt=xt: torch.matmul(Wd[i % len(Wd)], xt), max(10, nd), reps
                )
                del Wd, Wt
            xm = cp.where(cp.abs(x.astype(cp.float32)) > np.float32(tau), x.astype(cp.float32), 0)
            sc, gs = None, None
            if bits == 16:
                arrays = encode_on_device(W)
                ref = W.astype(cp.float32) @ xm
            else:
                del W
                q, sc = random_codes(cp, M, K, s, bits, group, 2000 + si)
                arrays, gs = encode_on_device(q, bits=bits), group
                W = q.astype(cp.float32) * cp.repeat(sc.astype(cp.float32), group, axis=1)[:, :K]
                ref = W @ xm
                del q
            del W
            dev0 = DeviceTiledCBC(arrays=arrays, w_scales=sc, group_size=gs)
            nbytes = dev0.nbytes()
            nc = copies_for(nbytes)
            devs = [dev0] + [DeviceTiledCBC(arrays=_clone(cp, arrays), w_scales=sc, group_size=gs)
                             for _ in range(nc - 1)]
            out = cp.empty(M, dtype=cp.float16)
            L = max(10, nc)
            y = cp.full(M, cp.nan, dtype=cp.float32)
            spmspv(dev0, x, tau, out=y)
            rel = float(cp.linalg.norm(y - ref) / cp.linalg.norm(ref))
            best = None
            tried = {}
            by_setting = {}  # the same figures keyed by launch setting (warps/stages/scale/mode), not chunk
            bad = {}
            cands = candidates if s == statics[0] else shape_cands  # later statics: the first one's top two
            timed = []
            for cand in cands:
                w, st, md, sk = cand["warps"], cand["stages"], cand["mode"], cand.get("streamk", False)
                chunk = v2_default_chunk(dev0, w, st, scale=cand["scale"], mode=md) if sk is False else 0
                tag = {False: "", True: "/sk", None: "/auto"}[sk] + cand.get("tag", "")  # split-K, stream-K, rule
                key = f"w{w}/d{st}/c{chunk}/m{md}{tag}"
                kw = dict(chunk=chunk or None, stages=st, warps=w, mode=md, streamk=sk, scale=cand["scale"])
                with cand.get("within", contextlib.nullcontext)():  # a study's: e.g. another revision of the .cu
                    yc = cp.full(M, cp.nan, dtype=cp.float32)
                    spmspv(dev0, x, tau, out=yc, **kw)
                    rc = float(cp.linalg.norm(yc - ref) / cp.linalg.norm(ref))

                    def run(i, kw=kw, devs=devs, x=x, tau=tau, out=out):
                        return spmspv(devs[i % len(devs)], x, tau, out=out, **kw)

                    t = time_graph_cupy(cp, run, L, reps) if rc < 1e-4 else None  # a wrong result is never timed
                if t is None:  # (the strict bound is in gpu_check)
                    bad[key] = rc
                    log(f"  candidate {key}: rel err {rc:.1e}, skipped")
                    continue
                tried[key] = t * 1e6
                by_setting[f"w{w}/d{st}/x{cand['scale']:g}/m{md}{tag}"] = t * 1e6
                timed.append((t, cand))
                if best is None or t < best[0]:
                    best = (t, chunk, st, w, md, kw)

            if best is None:
                log(f"spmspv {M}x{K} s={s}: every candidate gave a wrong result; shape skipped")
                continue
            if s == statics[0]:
                shape_cands = [c for _, c in sorted(timed, key=lambda tc: tc[0])[:2]]

            def run_default(i, devs=devs, x=x, tau=tau, out=out):
                return spmspv(devs[i % len(devs)], x, tau, out=out)

            def run_dp_off(i, kw=best[5], devs=devs, x=x, out=out):
                return spmspv(devs[i % len(devs)], x, None, out=out, **kw)

            t_def = time_graph_cupy(cp, run_default, L, reps)
            t_static = time_graph_cupy(cp, run_dp_off, L, reps)
            br = bytes_read(dev0, x_host, tau)
            dw, ds = v2_default_config(dev0)
            row = dict(
                M=M,
                K=K,
                bits=bits,
                group=gs,
                static=s,
                dynamic=dp,
                tau=tau,
                rel_err_vs_fp32=rel,
                t_cublas_us=t_cublas * 1e6,
                t_spmspv_us=best[0] * 1e6,
                best_chunk=best[1],
                best_stages=best[2],
                best_warps=best[3],
                best_mode=best[4],
                best_streamk=best[5]["streamk"],
                t_default_us=t_def * 1e6,
                default_chunk=v2_default_chunk(dev0, dw, ds),
                t_spmspv_dp_off_us=t_static * 1e6,
                speedup=t_cublas / best[0],
                speedup_default=t_cublas / t_def,
                speedup_dp_off=t_cublas / t_static,
                bytes_read=br,
                stored_bytes=nbytes,
                dense_bytes=dense_bytes,
                gbps_spmspv=br / best[0] / 1e9,
                gbps_default=br / t_def / 1e9,
                gbps_cublas=dense_bytes / t_cublas / 1e9,
                tried_us=tried,
                tried_by_setting_us=by_setting,
                rejected_rel_err=bad,
                copies=nc,
            )
            rows.append(row)
            log(
                f"spmspv {M}x{K} {'fp16' if bits == 16 else f'int{bits}'} s={s} dp={dp}: "
                f"cublas {t_cublas * 1e6:.1f}us  ours {best[0] * 1e6:.1f}us "
                f"(w{best[3]}/d{best[2]}/c{best[1]}/m{best[4]}/sk={best[5]['streamk']}; "
                f"default {t_def * 1e6:.1f}) "
                f"x{t_cublas / best[0]:.2f} (default x{t_cublas / t_def:.2f}) dp-off {t_static * 1e6:.1f}us "
                f"{row['gbps_spmspv']:.0f} GB/s"
                + f" rel {rel:.1e}"
            )
            del devs, dev0, arrays
            cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    return rows


def spmm_candidates(n: int) -> list[tuple[int, int, int]]:
    if n <= 32:
        return [(32, 5, 2), (32, 3, 2), (64, 4, 2)]
    if n <= 256:
        return [(64, 4, 2), (64, 3, 2), (128, 4, 1)]
    return [(128, 4, 1), (128, 3, 1), (64, 4, 2)]


def bench_spmm(cp, torch, shapes, ns, static, log, deadline=float("inf"), reps=5):
    from ...kernels.tiled_cbc_spmm import (
        V3_CONFIGS,
        V3_MAX_N,
        auto_method,
        decode_dense,
        default_config,
        default_splits,
        spmm,
        spmm_dense,
        v3_config,
        wgmma_available,
    )

    rows = []
    for si, (M, K) in enumerate(shapes):
        if time.time() > deadline:
            log(f"time limit: SpMM stopped after {si} of {len(shapes)} shapes")
            break
        Wd, devs = rotated_copies(cp, torch, random_weights(cp, M, K, static, 2000 + si))
        Wt, dev0, nd, nc = Wd[0], devs[0], len(Wd), len(devs)
        ws = cp.empty((M, dev0.grid[1] * 16), dtype=cp.float16)
        t_decode = time_graph_cupy(cp, lambda i, devs=devs, ws=ws: decode_dense(devs[i % len(devs)], ws), nc, reps)
        gbs = (dev0.nbytes() + ws.nbytes) / t_decode / 1e9
        log(f"decode to dense {M}x{K}: {t_decode * 1e6:.1f}us ({gbs:.0f} GB/s)")
        del ws
        for n in ns:
            if time.time() > deadline:
                break
            rs = cp.random.RandomState(n)
            X = rs.standard_normal((n, K), dtype=cp.float32).astype(cp.float16)
            Xt = torch.from_dlpack(X)
            out = cp.empty((n, M), dtype=cp.float16)
            flops = 2.0 * n * M * K
            Ld = max(nd, int(min(20, max(2, 1e-3 / max(flops / 600e12, 1e-7)))))

            def dense(i, Xt=Xt, Wd=Wd):
                return torch.nn.functional.linear(Xt, Wd[i % len(Wd)])

            t_cublas = time_graph_torch(torch, dense, Ld, reps)
            best = None
            per = {}
            L = max(nc, Ld)
            for cfg in spmm_candidates(n):

                def sparse(i, cfg=cfg, devs=devs, X=X, out=out):
                    return spmm(devs[i % len(devs)], X, out=out, config=cfg, method="fused")

                t = time_graph_cupy(cp, sparse, L, reps)
                per[str(cfg)] = t * 1e6
                if best is None or t < best[0]:
                    best = (t, cfg)

            # v3 (warp-streamed): the default config and the others that cover n tokens
            warp, rel_warp = {}, float("nan")
            if n <= V3_MAX_N:
                for cfg in [v3_config(n)] + [c for c in V3_CONFIGS if 8 * c[0] >= n and c != v3_config(n)]:

                    def sparse3(i, cfg=cfg, devs=devs, X=X, out=out):
                        return spmm(devs[i % len(devs)], X, out=out, config=cfg, method="warp")

                    warp[cfg] = time_graph_cupy(cp, sparse3, L, reps)
                out.fill(cp.nan)
                spmm(dev0, X, out=out, method="warp")
                ref = torch.nn.functional.linear(Xt.float(), Wt.float())
                rel_warp = float((torch.from_dlpack(out).float() - ref).norm() / ref.norm())
                del ref

            # dense path (decode kernel + cublasGemmEx) captured whole in one graph

            def dense_path(i, devs=devs, X=X, out=out):
                return spmm_dense(devs[i % len(devs)], X, out)

            t_dense = time_graph_cupy(cp, dense_path, L, reps)
            dense_timing = "one graph: decode + cublasGemmEx"
            t_warp = warp[v3_config(n)] if warp else float("nan")
            t_wgmma, rel_wgmma = float("nan"), float("nan")
            if wgmma_available():  # v4, its default launch

                def sparse4(i, devs=devs, X=X, out=out):
                    return spmm(devs[i % len(devs)], X, out=out, method="wgmma")

                t_wgmma = time_graph_cupy(cp, sparse4, L, reps)
                out.fill(cp.nan)
                spmm(dev0, X, out=out, method="wgmma")
                ref = torch.nn.functional.linear(Xt.float(), Wt.float())
                rel_wgmma = float((torch.from_dlpack(out).float() - ref).norm() / ref.norm())
                del ref
            t_auto = dict(warp=t_warp, wgmma=t_wgmma, dense=t_dense, fused=best[0])[auto_method(n, wgmma_available())]
            yd = spmm(dev0, X, method="dense")
            spmm(dev0, X, out=out, config=best[1], method="fused")
            got = torch.from_dlpack(out).float()
            ref = torch.nn.functional.linear(Xt.float(), Wt.float())
            rel = float((got - ref).norm() / ref.norm())
            rel_dense = float((torch.from_dlpack(yd).float() - ref).norm() / ref.norm())
            del got, ref, yd
            rows.append(
                dict(
                    M=M,
                    K=K,
                    N=n,
                    static=static,
                    t_cublas_us=t_cublas * 1e6,
                    t_spmm_us=best[0] * 1e6,
                    best_config=list(best[1]),
                    default_config=list(default_config(n)),
                    splits=default_splits(dev0, n, best[1][0]),
                    per_config_us=per,
                    t_dense_path_us=t_dense * 1e6,
                    t_decode_us=t_decode * 1e6,
                    dense_path_timing=dense_timing,
                    rel_err_dense_path=rel_dense,
                    speedup_fused=t_cublas / best[0],
                    speedup_dense_path=t_cublas / t_dense,
                    t_warp_us=t_warp * 1e6,
                    warp_config=list(v3_config(n)) if warp else None,
                    per_warp_config_us={str(c): t * 1e6 for c, t in warp.items()},
                    speedup_warp=t_cublas / t_warp,
                    rel_err_warp=rel_warp,
                    t_wgmma_us=t_wgmma * 1e6,
                    speedup_wgmma=t_cublas / t_wgmma,
                    rel_err_wgmma=rel_wgmma,
                    auto_method=auto_method(n, wgmma_available()),
                    t_auto_us=t_auto * 1e6,
                    speedup=t_cublas / t_auto,
                    tflops_cublas=flops / t_cublas / 1e12,
                    tflops_fused_dense_equiv=flops / best[0] / 1e12,
                    rel_err_vs_fp32=rel,
                )
            )
            log(
                f"spmm {M}x{K} N={n}: cublas {t_cublas * 1e6:.1f}us warp {t_warp * 1e6:.1f}us "
                f"x{t_cublas / t_warp:.2f} rel {rel_warp:.1e} wgmma {t_wgmma * 1e6:.1f}us x{t_cublas / t_wgmma:.2f} "
                f"rel {rel_wgmma:.1e} fused {best[0] * 1e6:.1f}us "
                f"({best[1]}) x{t_cublas / best[0]:.2f} dense-path {t_dense * 1e6:.1f}us "
                f"x{t_cublas / t_dense:.2f} rel {rel:.1e}/{rel_dense:.1e}"
            )
        del devs, dev0, Wd, Wt
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    return rows


def copy_bandwidth(cp):
    a = cp.empty(2 * 1024**3, dtype=cp.uint8)
    b = cp.empty_like(a)
    t = time_graph_cupy(cp, lambda i: b.__setitem__(Ellipsis, a), 4, 5)
    return 2 * a.nbytes / t / 1e9


def machine_info(cp, torch):
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception as e:  # pragma: no cover
        smi = f"nvidia-smi failed: {e}"
    props = cp.cuda.runtime.getDeviceProperties(0)
    return dict(
        gpu=props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        sms=props["multiProcessorCount"],
        l2_bytes=props["l2CacheSize"],
        nvidia_smi=smi,
        cupy=cp.__version__,
        torch=torch.__version__,
        cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
        python=platform.python_version(),
        host=platform.node(),
    )


def bench_layer(name: str, m, scales, group_size, dp_sparsity, ns, reps: int = 5) -> list[dict]:
    """Rows for ``unionsparse bench ARTIFACT`` on one stored Tiled-CBC layer (its own arrays and scales):
    N = 1 runs spMspV on random N(0, 1) inputs with tau at their ``dp_sparsity`` quantile of |x| (the layer's
    calibrated dynamic sparsity; the stored tau is in the units of the real activations; None: no dynamic
    pruning), N > 1 the SpMM (default method; fp16 values only), each beside cuBLAS fp16 (GEMV / GEMM) on the
    same shape."""
    import cupy as cp
    import torch

    rows = _bench_layer(cp, torch, name, m, scales, group_size, dp_sparsity, ns, reps)
    cp.get_default_memory_pool().free_all_blocks()  # the layer's copies are gone with _bench_layer's frame
    torch.cuda.empty_cache()
    return rows


def _bench_layer(cp, torch, name, m, scales, group_size, dp_sparsity, ns, reps) -> list[dict]:
    from ...kernels.tiled_cbc_device import DeviceTiledCBC
    from ...kernels.tiled_cbc_spmm import spmm
    from ...kernels.tiled_cbc_spmspv import bytes_read, spmspv
    from ..activation_sparsity.thresholds import tau_from_samples

    M, K = m.geometry.shape
    dev0 = DeviceTiledCBC(m, scales, group_size)
    devs = [dev0] + [DeviceTiledCBC(m, scales, group_size) for _ in range(copies_for(dev0.nbytes()) - 1)]
    Wd = [torch.randn(M, K, device="cuda", dtype=torch.float16) for _ in range(copies_for(2 * M * K))]
    rs = np.random.default_rng(0)
    rows = []
    for n in ns:
        if n > 1 and m.geometry.bits is not None:  # the tensor-core SpMM takes fp16 values only
            continue
        X = rs.standard_normal((n, K)).astype(np.float16)
        Xt, xc, out = torch.as_tensor(X, device="cuda"), cp.asarray(X), cp.empty((n, M), dtype=cp.float16)
        if n == 1:
            tau = None if dp_sparsity is None else tau_from_samples(np.abs(X[0]), float(dp_sparsity))

            def ours(i, x=xc[0], tau=tau, out=out[0]):
                return spmspv(devs[i % len(devs)], x, tau, out=out)

            def dense(i, x=Xt[0]):
                return torch.matmul(Wd[i % len(Wd)], x)

            extra = dict(kernel="spmspv", dp_sparsity=dp_sparsity)
        else:

            def ours(i, x=xc, out=out):
                return spmm(devs[i % len(devs)], x, out=out)

            def dense(i, x=Xt):
                return torch.nn.functional.linear(x, Wd[i % len(Wd)])

            extra = dict(kernel="spmm")
        t = time_graph_cupy(cp, ours, max(10, len(devs)), reps)
        tc = time_graph_torch(torch, dense, max(10, len(Wd)), reps)
        if n == 1:
            extra["tiled_cbc_GBps"] = bytes_read(dev0, X[0], tau) / t / 1e9
        rows.append(dict(shape=name, M=M, K=K, N=n, format=TCBC_NAME, bits=m.geometry.bits or 16, **extra,
                         tiled_cbc_us=t * 1e6, cublas_us=tc * 1e6, speedup_vs_cublas=tc / t,
                         fp16_weight_MB=2 * M * K / 1e6))
    return rows


def bench_rows(shapes, ns, sparsity: float = 0.5, dp: float = 0.3, log=print) -> list[dict]:
    """Rows for ``unionsparse bench --format tiled-cbc``: shapes [(label, M, K)]; N = 1 runs spMspV at
    (static ``sparsity`` + dynamic ``dp``), N > 1 runs the SpMM (static only), each beside cuBLAS."""
    import cupy as cp
    import torch

    quiet = log or (lambda _msg: None)
    rows = []
    for label, m, k in shapes:
        if 1 in ns:
            cands = spmspv_candidates(16, full=False)
            for r in bench_spmspv(cp, torch, [(m, k)], (sparsity,), dp, quiet, candidates=cands):
                rows.append(
                    dict(
                        shape=label,
                        M=m,
                        K=k,
                        N=1,
                        kernel="spmspv",
                        sparsity=sparsity,
                        dp_sparsity=dp,
                        tiled_cbc_us=r["t_spmspv_us"],
                        cublas_us=r["t_cublas_us"],
                        speedup_vs_cublas=r["speedup"],
                        tiled_cbc_GBps=r["gbps_spmspv"],
                    )
                )
        big = [n for n in ns if n > 1]
        if big:
            for r in bench_spmm(cp, torch, [(m, k)], big, sparsity, quiet):
                rows.append(
                    dict(
                        shape=label,
                        M=m,
                        K=k,
                        N=r["N"],
                        kernel="spmm",
                        sparsity=sparsity,
                        tiled_cbc_us=r["t_auto_us"],
                        cublas_us=r["t_cublas_us"],
                        speedup_vs_cublas=r["speedup"],
                    )
                )
    return rows
