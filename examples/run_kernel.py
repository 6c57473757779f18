"""Run the kernels' arithmetic on one layer: IE-BME W4A4 SpMM and Tiled-CBC spMspV / SpMM.

Uses the CPU references (same arithmetic as the CUDA kernels) everywhere, and the CuPy kernels as well
when CuPy and a GPU are present, checking each result against a dense float64 product.
Run: python examples/run_kernel.py [--m 256] [--k 512] [--n 8]
"""

from __future__ import annotations

import argparse

import numpy as np
from unionsparse import kernels
from unionsparse.formats import iebme, tiled_cbc
from unionsparse.formats.arithmetic.activations import dequantize_activations, quantize_activations
from unionsparse.formats.arithmetic.weights import dequantize, rtn
from unionsparse.kernels.iebme_reference import iebme_spmm_reference
from unionsparse.kernels.tiled_cbc_reference import spmm_reference, spmspv_reference

FP16_TOL = 2e-3  # fp16 outputs: a few ulps of the largest |y|


def max_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--n", type=int, default=8, help="decode width (tokens)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.m, args.k)).astype(np.float32)
    w[np.abs(w) < np.quantile(np.abs(w), 0.5)] = 0.0
    g = 128
    q = rtn(w, bits=4, group_size=g)
    x = rng.standard_normal((args.n, args.k)).astype(np.float32)

    # IE-BME W4A4: int4 activations with per-token, per-group scales; exact integer partial sums
    m = iebme.encode(q.codes, bits=4, tile=(16, 64), areas=(2, 2))
    xq, xs = quantize_activations(x, 4, g)
    y, _ = iebme_spmm_reference(m, q.scales, xq, xs, g)
    w_deq = dequantize(q.codes, q.scales, g).astype(np.float64)
    want = dequantize_activations(xq, xs, g).astype(np.float64) @ w_deq.T
    print(f"IE-BME W4A4 SpMM (CPU reference), N={args.n}: max rel. error vs dense {max_rel(y, want):.2e}")
    assert max_rel(y, want) < FP16_TOL

    # Tiled-CBC fp16: spMspV with a dynamic-pruning threshold tau, SpMM for prefill
    w16 = w.astype(np.float16)
    c = tiled_cbc.encode(w16, tile=(256, 16))
    tau = float(np.quantile(np.abs(x[0]), 0.5))  # skip the 50% smallest inputs
    x0 = x[0].astype(np.float16)
    y1 = spmspv_reference(c, x0, tau)
    active = np.abs(x0.astype(np.float32)) > tau
    want1 = w16.astype(np.float64)[:, active] @ x0.astype(np.float64)[active]
    print(f"Tiled-CBC spMspV (CPU reference), tau={tau:.3f} ({100 * active.mean():.0f}% inputs active): "
          f"max rel. error {max_rel(y1, want1):.2e}")
    assert max_rel(y1, want1) < 1e-5  # fp32 output
    Y = spmm_reference(c, x.astype(np.float16))
    wantY = x.astype(np.float16).astype(np.float64) @ w16.astype(np.float64).T
    print(f"Tiled-CBC SpMM (CPU reference), N={args.n}: max rel. error {max_rel(Y, wantY):.2e}")
    assert max_rel(Y, wantY) < FP16_TOL

    if not kernels.available():
        print("no CuPy/GPU here: the CUDA kernels were not run")
        return
    import cupy as cp
    from unionsparse.kernels.iebme_spmm import prepare_layer, spmm_iebme
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmspv import spmspv

    yg = cp.asnumpy(spmm_iebme(prepare_layer(m, q.scales, g), xq, xs))
    print(f"IE-BME W4A4 SpMM (GPU): max rel. error vs dense {max_rel(yg, want):.2e}, "
          f"vs CPU reference {max_rel(yg, y.astype(np.float64)):.2e}")
    y1g = cp.asnumpy(spmspv(DeviceTiledCBC(c), cp.asarray(x0), tau))
    print(f"Tiled-CBC spMspV (GPU): max rel. error {max_rel(y1g, want1):.2e}")
    assert max_rel(yg, want) < FP16_TOL and max_rel(y1g, want1) < FP16_TOL  # fp16 outputs


if __name__ == "__main__":
    main()
