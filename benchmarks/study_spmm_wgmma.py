"""Same-run study of the Tiled-CBC SpMM wgmma kernel (v4; sm_90a) beside cuBLAS fp16 and the shipped methods.

    python benchmarks/study_spmm_wgmma.py [--ns 8,16,...] [--shapes 4096x4096,...] [--static 0.5]
        [--out DIR] [--name spmm_wgmma.json]

Per shape and token count N, in one process: cuBLAS fp16 (torch linear), the shipped ``method="auto"``,
the dense path (decode + cuBLAS, one graph), v4 with its default launch and with each variant in VARIANTS
(config, splits), each checked against an fp32 product first (relative error) and timed as CUDA-graph replays
over weight copies beyond L2 (median).
Writes DIR/NAME (JSON) and prints geomean speedups over cuBLAS per N and per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

VARIANTS = ((None, 1),)  # v4: (config or None for the default rule, splits or None for the default rule)


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        v = [tuple(int(d) for d in s.split("x")) for s in text.split(",")]
    except ValueError:
        v = []
    if not v or any(len(s) != 2 or min(s) < 1 for s in v):
        raise argparse.ArgumentTypeError(f"expected shapes like 4096x4096,11008x4096, got {text!r}")
    return v  # type: ignore[return-value]


@contextlib.contextmanager
def _skip_build(skip: int):
    """Launch v4 from a build with -DTCBC_V4_SKIP=skip inside the block."""
    from unionsparse.kernels import tiled_cbc_spmm as k
    from unionsparse.kernels.loader import load_module

    saved, saved_smem = k._module, dict(k._SMEM_SET)
    k._module = lambda: load_module("tiled_cbc_spmm", k._EXPR + k._EXPR_V4,
                                    options=("-arch=sm_90a", f"-DTCBC_V4_SKIP={skip}"))
    k._SMEM_SET.clear()
    try:
        yield
    finally:
        k._module = saved
        k._SMEM_SET.clear()
        k._SMEM_SET.update(saved_smem)


def _study_shape(cp, torch, M, K, static, ns, reps, seed, limit, parts=()):
    """Rows of one shape: cuBLAS, auto, dense path, v4 default and VARIANTS for each N (one weight matrix)."""
    from unionsparse.compressor.bench.tiled_cbc import (
        random_weights,
        rotated_copies,
        time_graph_cupy,
        time_graph_torch,
    )
    from unionsparse.kernels.tiled_cbc_spmm import spmm, v4_config, v4_smem, v4_splits

    Wd, devs = rotated_copies(cp, torch, random_weights(cp, M, K, static, seed))
    Wt, dev0, nd, nc = Wd[0], devs[0], len(Wd), len(devs)
    rows = []
    for n in ns:
        rs = cp.random.RandomState(n)
        X = rs.standard_normal((n, K), dtype=cp.float32).astype(cp.float16)
        Xt = torch.from_dlpack(X)
        out = cp.empty((n, M), dtype=cp.float16)
        ref = torch.nn.functional.linear(Xt.float(), Wt.float())
        L = max(nd, nc, int(min(20, max(2, 1e-3 / max(2.0 * n * M * K / 600e12, 1e-7)))))
        t_cublas = time_graph_torch(torch, lambda i, Xt=Xt: torch.nn.functional.linear(Xt, Wd[i % nd]), L, reps)
        row = dict(M=M, K=K, N=n, t_cublas_us=t_cublas * 1e6, variants={})

        def timed(name, X=X, out=out, ref=ref, L=L, row=row, t_cublas=t_cublas, **kw):
            out.fill(cp.nan)
            spmm(dev0, X, out=out, **kw)
            rel = float((torch.from_dlpack(out).float() - ref).norm() / ref.norm())
            t = time_graph_cupy(cp, lambda i: spmm(devs[i % nc], X, out=out, **kw), L, reps)
            row["variants"][name] = dict(t_us=t * 1e6, speedup=t_cublas / t, rel_err=rel)

        timed("auto")
        timed("dense", method="dense")
        cfg = v4_config(dev0, n, limit)
        row["v4_default"] = dict(config=list(cfg), splits=v4_splits(dev0, n, cfg, v4_smem(dev0, cfg, 1)))
        timed("v4", method="wgmma")
        for skip in parts:  # the default launch without its decode and/or wgmma (results are wrong by design)
            with _skip_build(skip):
                timed(f"v4 skip={skip}", method="wgmma")
        for vc, vs in VARIANTS:
            c = vc or cfg
            fits = v4_smem(dev0, c, -(-dev0.grid[1] // 4)) <= limit
            if fits and c[0] <= max(2 * n, 128) and (vc, vs) != (None, None):
                timed(f"v4 {list(c)} splits={vs or 'rule'}", method="wgmma", config=c, splits=vs)
        rows.append(row)
        del ref
    return rows


def main(argv=None) -> int:
    from bench_tiled_cbc import token_counts  # benchmarks/, beside this script
    from unionsparse.compressor.bench.tiled_cbc import SPMM_NS, SPMM_SHAPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=token_counts, default=SPMM_NS)
    ap.add_argument("--shapes", type=_shapes, default=SPMM_SHAPES)
    ap.add_argument("--static", type=float, default=0.5)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="tiled_cbc_spmm_wgmma_h200.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", action="store_true",
                    help="also time v4 built with -DTCBC_V4_SKIP=1/2/3 (no decode / no wgmma / neither)")
    args = ap.parse_args(argv)
    import cupy as cp
    import torch
    from unionsparse.compressor.bench.tiled_cbc import geomean, machine_info
    from unionsparse.kernels.tiled_cbc_spmm import wgmma_available

    if not wgmma_available():
        print("study_spmm_wgmma: needs a compute-capability 9.0 GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    res = dict(
        command="python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
        machine=machine_info(cp, torch),
        static=args.static,
        rows=[],
    )
    limit = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    for si, (M, K) in enumerate(args.shapes):
        for row in _study_shape(cp, torch, M, K, args.static, args.ns, args.reps, 3000 + si, limit,
                                (1, 2, 3) if args.parts else ()):
            res["rows"].append(row)
            print(
                f"[{time.time() - t0:6.1f}s] {M}x{K} N={row['N']}: cublas {row['t_cublas_us']:.1f}us "
                + " ".join(f"{k} x{d['speedup']:.2f}({d['rel_err']:.0e})" for k, d in row["variants"].items()),
                flush=True,
            )
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    names = sorted({k for r in res["rows"] for k in r["variants"]})
    res["geomean"] = {
        str(n): {
            k: geomean([r["variants"][k]["speedup"] for r in res["rows"] if r["N"] == n and k in r["variants"]])
            for k in names
        }
        for n in args.ns
    }
    res["wall_s"] = time.time() - t0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / args.name).write_text(json.dumps(res, indent=1))
    for n, g in res["geomean"].items():
        print(f"GEOMEAN N={n}: " + " ".join(f"{k} {s:.2f}" for k, s in g.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
