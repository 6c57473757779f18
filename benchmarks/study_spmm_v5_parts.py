"""Where the v5 SpMM's time goes: v5 built with -DTCBC_V5_SKIP=bits (2: no decode, 4: no wgmma, 6: neither, only
the data movement; results are wrong by design) beside the shipped build and cuBLAS, same process.

    python benchmarks/study_spmm_v5_parts.py [--out DIR] [--skips 2,4,6]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SHAPES = ((4096, 11008), (28672, 8192))
NS = (16, 512, 4096)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skips", default="2,4,6")
    args = ap.parse_args(argv)
    import cupy as cp
    import torch
    from unionsparse.compressor.bench.tiled_cbc import (
        _clone,
        copies_for,
        machine_info,
        random_weights,
        time_graph_cupy,
        time_graph_torch,
    )
    from unionsparse.kernels import tiled_cbc_spmm as k
    from unionsparse.kernels.loader import load_module
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC, encode_on_device

    skips = [0] + [int(x) for x in args.skips.split(",")]
    rows = []
    t0 = time.time()
    for M, K in SHAPES:
        W = random_weights(cp, M, K, 0.5, 7)
        Wt = torch.from_dlpack(W)
        nd = copies_for(2 * M * K)
        Wd = [Wt] + [Wt.clone() for _ in range(nd - 1)]
        arrays = encode_on_device(W)
        devs = [DeviceTiledCBC(arrays=arrays)]
        nc = copies_for(devs[0].nbytes())
        devs += [DeviceTiledCBC(arrays=_clone(cp, arrays)) for _ in range(nc - 1)]
        for n in NS:
            X = cp.random.RandomState(n).standard_normal((n, K), dtype=cp.float32).astype(cp.float16)
            Xt = torch.from_dlpack(X)
            out = cp.empty((n, M), dtype=cp.float16)
            L = max(nd, nc, 10)
            tc = time_graph_torch(torch, lambda i, Xt=Xt, Wd=Wd: torch.nn.functional.linear(Xt, Wd[i % len(Wd)]), L, 5)
            row = dict(M=M, K=K, N=n, t_cublas_us=tc * 1e6, v5={})
            for sk in skips:
                saved = k._module
                k._module = lambda sk=sk: load_module("tiled_cbc_spmm", k._EXPR + k._EXPR_V4 + k._EXPR_V5,
                                                      options=("-arch=sm_90a", f"-DTCBC_V5_SKIP={sk}"))
                k._SMEM_SET.clear()
                try:
                    t = time_graph_cupy(cp, lambda i, X=X, out=out, devs=devs: k.spmm(devs[i % len(devs)], X, out=out,
                                                                                      method="wgmma5"), L, 5)
                finally:
                    k._module = saved
                    k._SMEM_SET.clear()
                row["v5"][str(sk)] = t * 1e6
            rows.append(row)
            print(f"[{time.time() - t0:5.1f}s] {M}x{K} N={n}: cublas {tc * 1e6:.1f}us "
                  + " ".join(f"skip{s} {v:.1f}" for s, v in row["v5"].items()), flush=True)
        devs, Wd = [], []
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = dict(machine=machine_info(cp, torch), command=" ".join(sys.argv), rows=rows)
    (out / "tiled_cbc_spmm_v5_parts.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
