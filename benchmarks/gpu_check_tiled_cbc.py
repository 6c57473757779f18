"""GPU correctness sweep of the Tiled-CBC kernels against float64 truth (no pytest needed on the device).

Fresh random layers and inputs each run, outputs poisoned with NaN, every kernel version and launch
configuration, split-K launched twice (ticket reuse). Prints one line per failure and a summary; writes
JSON to --out. Exit 1 if anything failed.

    python benchmarks/gpu_check_tiled_cbc.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from unionsparse.formats import tiled_cbc
from unionsparse.kernels.tiled_cbc_check import check_tiled_cbc_layer, tolerance
from unionsparse.kernels.tiled_cbc_reference import dense_weights_f64


def _fp16(rng, M, K, sp):
    W = rng.standard_normal((M, K)).astype(np.float16)
    W[rng.random((M, K)) < sp] = 0
    return W


def _codes(rng, M, K, sp, bits, g):
    q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (M, K)).astype(np.int8)
    q[rng.random((M, K)) < sp] = 0
    return q, (rng.random((M, -(-K // g))) * 0.1 + 0.01).astype(np.float16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=None)
    a = ap.parse_args(argv)
    import cupy as cp
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmm import V2_CONFIGS as MM_CFG
    from unionsparse.kernels.tiled_cbc_spmm import spmm
    from unionsparse.kernels.tiled_cbc_spmspv import MODES, V2_CONFIGS, spmspv

    seed = int(time.time()) if a.seed is None else a.seed
    rng = np.random.default_rng(seed)
    fails: list[str] = []
    n_checks = 0
    t0 = time.time()

    # 1. verify's own check (default kernels), fp16 and b-bit, DP on and off
    for shape in [(256, 16), (300, 70), (1024, 1000), (4096, 4096)]:
        for sp in (0.0, 0.5, 0.95):
            m = tiled_cbc.encode(_fp16(rng, *shape, sp))
            f = check_tiled_cbc_layer(m, tau=0.6, ns=(1, 16, 100), backend="cupy", rng=rng)
            fails += [f"check {shape} s={sp}: {x}" for x in f]
            n_checks += 1
    for bits, g, shape in [(4, 128, (1024, 1024)), (4, 16, (300, 200)), (2, 64, (512, 320)), (2, 32, (2000, 3000))]:
        q, s = _codes(rng, *shape, 0.5, bits, g)
        m = tiled_cbc.encode(q, bits=bits)
        f = check_tiled_cbc_layer(m, s, g, tau=0.5, ns=(1,), backend="cupy", rng=rng)
        fails += [f"check int{bits} g{g} {shape}: {x}" for x in f]
        n_checks += 1

    # 2. every spMspV configuration and chunk, fp16 and b-bit
    layers = [("fp16", 768, 1040, None, None), ("fp16", 3000, 2000, None, None),
              ("int4", 1000, 1200, 4, 128), ("int2", 700, 1100, 2, 32), ("int4", 512, 800, 4, 16)]
    for label, M, K, bits, g in layers:
        if bits is None:
            W = _fp16(rng, M, K, 0.5)
            m, s = tiled_cbc.encode(W), None
        else:
            q, s = _codes(rng, M, K, 0.5, bits, g)
            m = tiled_cbc.encode(q, bits=bits)
        dev = DeviceTiledCBC(m, s, g)
        w64 = dense_weights_f64(m, s, g)
        b = 16 if bits is None else bits
        runs = [dict(warps=w, stages=st, mode=md) for bb, w, st in V2_CONFIGS if bb == b for md in MODES[b]]
        runs += [dict(warps=w, stages=st, streamk=True, blocks=nb) for bb, w, st in V2_CONFIGS if bb == b
                 for nb in (1, 3, None)]
        for tau in (None, 0.0, 0.4, 1.5):
            x = rng.standard_normal(K).astype(np.float16)
            x[rng.random(K) < 0.1] = 0
            xe = x.astype(np.float64)
            if tau is not None:
                xe = np.where(np.abs(x.astype(np.float32)) > tau, xe, 0.0)
            truth = w64 @ xe
            tol = tolerance(w64, xe[None])[0]
            tol16 = tolerance(w64, xe[None], 1.0, True)[0]
            for kw in runs:
                for chunk in (1, 2, 5, 16, 64, None):
                    for rep in range(2):
                        f32 = rep == 0
                        out = cp.full(M, cp.nan, cp.float32 if f32 else cp.float16)
                        y = cp.asnumpy(spmspv(dev, cp.asarray(x), tau, out=out, chunk=chunk, **kw)).astype(np.float64)
                        err = np.abs(y - truth)
                        n_checks += 1
                        if not np.isfinite(y).all() or (err > (tol if f32 else tol16)).any():
                            fails.append(f"spmspv {label} {M}x{K} tau={tau} {kw} chunk={chunk} f32={f32}: "
                                         f"max err {np.nanmax(err):.3e}, finite {np.isfinite(y).all()}")

    # 3. every SpMM configuration and split
    for M, K in [(768, 1040), (1300, 4100), (512, 1001)]:
        W = _fp16(rng, M, K, 0.5)
        m = tiled_cbc.encode(W)
        dev = DeviceTiledCBC(m)
        for n in (1, 16, 33, 200):
            X = rng.standard_normal((n, K)).astype(np.float16)
            truth = X.astype(np.float64) @ W.astype(np.float64).T
            bound = tolerance(W.astype(np.float64), X.astype(np.float64), 2.0, True)
            runs = [dict(config=c, splits=sp, method="fused") for c in MM_CFG for sp in (1, 3, 40, None)]
            runs += [dict(method="dense"), dict(method="auto")]
            for kw in runs:
                for _ in range(2):
                    out = cp.full((n, M), cp.nan, cp.float16)
                    Y = cp.asnumpy(spmm(dev, cp.asarray(X), out=out, **kw)).astype(np.float64)
                    n_checks += 1
                    if not np.isfinite(Y).all() or (np.abs(Y - truth) > bound).any():
                        fails.append(f"spmm {M}x{K} n={n} {kw}: max err {np.nanmax(np.abs(Y - truth)):.3e}")
    cp.cuda.Device().synchronize()
    res = dict(seed=seed, checks=n_checks, failures=fails, seconds=time.time() - t0)
    for f in fails[:40]:
        print("FAIL", f)
    print(f"GPU check: {n_checks} checks, {len(fails)} failures, seed {seed}, {res['seconds']:.0f}s", flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "tiled_cbc_gpu_check.json").write_text(json.dumps(res, indent=1))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
