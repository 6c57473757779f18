"""Numerical check of one Tiled-CBC layer's kernels, for ``unionsparse verify``.

``check_tiled_cbc_layer`` draws fresh random activations, computes the ground truth in float64 from
``decode()`` (and the scales), and requires every result to lie within the worst-case float32
accumulation bound of it (see :func:`tolerance`). With ``backend="cupy"`` the GPU kernels and the CPU
reference are both checked against the truth (and the GPU output buffers are poisoned with NaN first,
so an unwritten element fails); with ``backend="cpu"`` the reference alone is.

Tolerance: for output i, with S_i = sum_k |W[i,k] x_k| (float64),
  |y - y_true| <= c * (K + 64) * 2^-24 * S_i  [+ 2^-11 |y_true| + 2^-25 for float16 outputs],
the textbook bound for n-term recursive float32 summation (each product of a float16 weight, or an exact
b-bit code x float16 scale, with a float16 input costs at most one more rounding); 64 covers the
split-K and warp partial sums. c = 1 on CUDA cores and the reference; c = 2 for the tensor-core SpMM,
whose fp32 accumulation is not guaranteed round-to-nearest. A dropped or doubled column moves an
output by |W x| of that term, which this catches at the sizes of real layers only when that term is not
buried under the bound; the unit tests cover the layout logic on small shapes where it is.
"""

from __future__ import annotations

import numpy as np

from ..formats.tiled_cbc import TiledCBCMatrix
from .errors import KernelError
from .tiled_cbc_reference import dense_weights_f64, spmm_reference, spmspv_reference, spmspv_rows_reference

U32 = 2.0**-24


def tolerance(w64: np.ndarray, x64: np.ndarray, c: float = 1.0, fp16_out: bool = False) -> np.ndarray:
    """Per-output tolerance (shape of x64 @ w64.T) as in the module docstring."""
    k = w64.shape[1]
    s = np.abs(x64) @ np.abs(w64).T
    tol = c * (k + 64) * U32 * s
    if fp16_out:
        tol = tol + 2.0**-11 * np.abs(x64 @ w64.T) + 2.0**-25
    return tol


def _compare(name: str, got, truth: np.ndarray, tol: np.ndarray) -> list[str]:
    got = np.asarray(got, dtype=np.float64)
    if got.shape != truth.shape:
        return [f"{name}: shape {got.shape}, expected {truth.shape}"]
    if not np.isfinite(got).all():
        bad = int((~np.isfinite(got)).sum())
        return [f"{name}: {bad} outputs not finite (unwritten or overflow)"]
    err = np.abs(got - truth)
    ratio = err / np.maximum(tol, 1e-300)
    if (err > tol).any():
        i = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        return [
            f"{name}: {int((err > tol).sum())} outputs beyond the float32 bound; "
            f"worst at {tuple(map(int, i))}: "
            f"|err| {err[i]:.3e} > tol {tol[i]:.3e}"
        ]
    return []


def check_tiled_cbc_layer(
    m: TiledCBCMatrix,
    w_scales=None,
    group_size=None,
    tau: float | None = None,
    ns=(1, 8, 32),
    backend: str = "cpu",
    rng=None,
) -> list[str]:
    """Run spMspV with dynamic pruning on (``tau``) and off, and for every n > 1 in ``ns`` the SpMM and the
    several-row spMspV (a batched decode step: each row its own threshold mask, so rows' active columns differ).

    Returns failure messages, empty when every check holds. backend: "cupy" (GPU kernels and the
    reference) or "cpu" (reference only). The GPU SpMM takes float16 layers only: for b-bit layers only
    the reference's SpMM is checked.
    """
    if backend not in ("cupy", "cpu"):
        raise KernelError(f"backend must be 'cupy' or 'cpu', got {backend!r}")
    rng = np.random.default_rng() if rng is None else rng
    M, K = m.shape
    w64 = dense_weights_f64(m, w_scales, group_size)
    fails: list[str] = []
    dev = cp = None
    if backend == "cupy":
        from .loader import require_cupy
        from .tiled_cbc_device import DeviceTiledCBC

        cp = require_cupy()
        dev = DeviceTiledCBC(m, w_scales, group_size)

    x = rng.standard_normal(K).astype(np.float16)
    dp_modes = [("dp-off", None)]
    if tau is not None and tau >= 0:
        dp_modes.insert(0, (f"dp-on(tau={tau:.4g})", float(tau)))
    for label, t in dp_modes:
        x_eff = x.astype(np.float64)
        if t is not None:
            x_eff = np.where(np.abs(x.astype(np.float32)) > np.float32(t), x_eff, 0.0)
        truth = w64 @ x_eff
        tol = tolerance(w64, x_eff[None], 1.0)[0]
        y_ref = spmspv_reference(m, x, t, w_scales, group_size)
        fails += _compare(f"spmspv reference {label}", y_ref, truth, tol)
        if dev is not None:
            from .tiled_cbc_spmspv import spmspv

            xd = cp.asarray(x)
            out = cp.full(M, cp.nan, dtype=cp.float32)
            spmspv(dev, xd, t, out=out)
            fails += _compare(f"spmspv gpu {label}", cp.asnumpy(out), truth, tol)
            out16 = cp.full(M, cp.nan, dtype=cp.float16)
            spmspv(dev, xd, t, out=out16)
            tol16 = tolerance(w64, x_eff[None], 1.0, fp16_out=True)[0]
            fails += _compare(f"spmspv gpu fp16-out {label}", cp.asnumpy(out16), truth, tol16)
    for n in ns:
        if n <= 1:
            continue
        X = rng.standard_normal((n, K)).astype(np.float16)
        X64 = X.astype(np.float64)
        truth = X64 @ w64.T
        Y = spmm_reference(m, X, w_scales, group_size)
        fails += _compare(f"spmm reference n={n}", Y, truth, tolerance(w64, X64, 1.0, fp16_out=True))
        for label, t in dp_modes:  # the several-row spMspV: rows of different scales, so masks differ by row
            Xs = (X.astype(np.float32) * np.linspace(0.5, 2.0, n, dtype=np.float32)[:, None]).astype(np.float16)
            Xe = Xs.astype(np.float64)
            if t is not None:
                Xe = np.where(np.abs(Xs.astype(np.float32)) > np.float32(t), Xe, 0.0)
            truth_r, tol_r = Xe @ w64.T, tolerance(w64, Xe, 1.0)
            fails += _compare(f"spmspv rows reference n={n} {label}",
                              spmspv_rows_reference(m, Xs, t, w_scales, group_size), truth_r, tol_r)
            if dev is not None:
                from .tiled_cbc_spmspv import spmspv

                out = cp.full((n, M), cp.nan, dtype=cp.float32)
                spmspv(dev, cp.asarray(Xs), t, out=out)
                fails += _compare(f"spmspv rows gpu n={n} {label}", cp.asnumpy(out), truth_r, tol_r)
        if dev is not None and m.bits is None:
            from .tiled_cbc_spmm import spmm

            for method in ("warp", "fused", "dense"):
                out = cp.full((n, M), cp.nan, dtype=cp.float16)
                spmm(dev, cp.asarray(X), out=out, method=method)
                fails += _compare(
                    f"spmm gpu {method} n={n}", cp.asnumpy(out), truth, tolerance(w64, X64, 2.0, fp16_out=True)
                )
    return fails
