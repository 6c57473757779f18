"""Kernel checks on one IE-BME layer for ``verify``: reference vs dense codes, and GPU vs reference.

What is compared (each failure is one message):

* CPU reference partial sums (read from the IE-BME arrays) against a dense integer product of the
  decoded codes: exact equality.
* GPU (``backend="cupy"``): the kernel's debug path returns the int32 group partial sums: exact
  equality with the reference; the fp16 output against the reference output: within 2 fp16 ulps of
  the reference plus 1e-5 of its largest magnitude (split-K changes only the fp32 summation order;
  without split-K the two are bit-identical). Every output element must be written (poisoned first).
"""

from __future__ import annotations

import numpy as np

from ..formats.iebme import IEBMEMatrix
from .activations import quantize_activations
from .iebme_reference import iebme_spmm_reference


def fp16_close(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Element-wise: |got - want| <= 2 ulp16(want) + 1e-5 max|want| (False for NaN)."""
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    ulp = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    tol = 2 * ulp + 1e-5 * (np.abs(w).max() if w.size else 0.0)
    return np.abs(g - w) <= tol


def dense_partials(codes: np.ndarray, x_codes: np.ndarray, group_size: int) -> np.ndarray:
    """int32 [N, M, G] from decoded codes (numpy, int64 accumulation)."""
    m, k = codes.shape
    gs = min(group_size, k)
    gc = -(-k // gs)
    wp = np.zeros((m, gc * gs), np.int64)
    wp[:, :k] = codes
    xp = np.zeros((x_codes.shape[0], gc * gs), np.int64)
    xp[:, :k] = x_codes
    return np.einsum("mgk,ngk->nmg", wp.reshape(m, gc, gs), xp.reshape(-1, gc, gs)).astype(np.int32)


def check_iebme_layer(m: IEBMEMatrix, w_scales: np.ndarray, group_size: int, act_bits: int, ns, backend: str,
                      rng: np.random.Generator, name: str = "layer", splits: int | None = None) -> list[str]:
    """Draw activations for each N in ``ns``, quantize them, run the reference (and the GPU kernel for
    ``backend == "cupy"``) and compare; returns one message per failure (empty: all checks hold)."""
    out: list[str] = []
    _, k = m.shape
    codes = None
    layer = None
    for n in ns:
        x = rng.standard_normal((n, k)).astype(np.float32)
        xq, xs = quantize_activations(x, act_bits, group_size)
        y_ref, p_ref = iebme_spmm_reference(m, w_scales, xq, xs, group_size)
        if codes is None:
            codes = m.decode()
        if not np.array_equal(p_ref, dense_partials(codes, xq, group_size)):
            out.append(f"{name}: CPU reference partial sums differ from the decoded codes (N={n})")
            continue
        if backend != "cupy":
            continue
        from .iebme_spmm import prepare_layer, spmm_iebme

        if layer is None:
            layer = prepare_layer(m, w_scales, group_size)
        p_gpu = spmm_iebme(layer, xq, xs, splits=splits, debug_partials=True).get()
        if not np.array_equal(p_gpu, p_ref):
            bad = int((p_gpu != p_ref).sum())
            out.append(f"{name}: GPU partial sums differ from the reference at {bad} of {p_ref.size} (N={n})")
        y_gpu = spmm_iebme(layer, xq, xs, splits=splits).get()
        ok = fp16_close(y_gpu, y_ref)
        if not ok.all():
            bad = int((~ok).sum())
            out.append(f"{name}: GPU output differs from the reference beyond fp32 rounding at {bad} of "
                       f"{ok.size} elements (N={n})")
    return out


def float_bound(codes: np.ndarray, w_scales: np.ndarray, group_size: int, x: np.ndarray) -> tuple[np.ndarray,
                                                                                                    np.ndarray]:
    """(float64 truth [N, M], bound) of the float16-activation product fp16(x) @ (code · scale)^T: float32 sums of
    the K products ((K + 2) 2^-23 of the magnitude: tensor-core float32 accumulation need not round to nearest),
    then one float16 rounding (2^-11 of the result, plus the subnormal step)."""
    m, k = codes.shape
    w = codes.astype(np.float64) * np.repeat(np.asarray(w_scales, np.float64), group_size, axis=1)[:, :k]
    xf = np.asarray(x, np.float32).astype(np.float16).astype(np.float64)
    truth = xf @ w.T
    return truth, (k + 2) * 2.0**-23 * (np.abs(xf) @ np.abs(w).T) + 2.0**-11 * np.abs(truth) + 2.0**-24


def check_iebme_float_layer(m: IEBMEMatrix, w_scales: np.ndarray, group_size: int, ns, backend: str,
                            rng: np.random.Generator, name: str = "layer") -> list[str]:
    """W4A16 / W2A16 (float16 activations): the CPU reference (:func:`iebme_float_reference`, from the stored
    arrays) and, with ``backend == "cupy"``, the kernel's float16-activation variant (every output written) against
    the float64 product of the decoded codes, within :func:`float_bound`."""
    from .iebme_reference import iebme_float_reference

    out: list[str] = []
    codes = m.decode()
    gs = min(group_size, m.shape[1])
    layer = None
    for n in ns:
        x = rng.standard_normal((n, m.shape[1])).astype(np.float16)
        truth, bound = float_bound(codes, w_scales, gs, x)
        runs = [("CPU reference", iebme_float_reference(m, w_scales, x, group_size))]
        if backend == "cupy":
            from .iebme_spmm import prepare_layer, spmm_iebme16

            if layer is None:
                layer = prepare_layer(m, w_scales, group_size)
            runs.append(("GPU kernel (float16 activations)", spmm_iebme16(layer, x).get()))
        for what, y in runs:
            bad = ~(np.abs(y.astype(np.float64) - truth) <= bound)
            if bad.any():
                out.append(f"{name}: {what} differs from the decoded product beyond float32 sums and one float16 "
                           f"rounding at {int(bad.sum())} of {bad.size} elements (N={n})")
    return out
