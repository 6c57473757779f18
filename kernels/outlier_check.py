"""Kernel check of one IE-BME layer with Atom outlier channels, for ``verify``.

The layer computes Y = (main IE-BME W4A4/W2A4 product) + (8-bit side product): the main matrix is stored
column-permuted (normal channels, then the outlier columns, which are zero), the side matrix [M, n] holds
the outlier channels as int8 codes with one fp16 scale per row. Per N in ``ns``, on random activations
whose outlier channels are made hot, quantized by the layer's activation record
(:func:`unionsparse.formats.arithmetic.outlier_side.quantize_inputs`, the one definition):

* reference: the main integer partial sums read from the IE-BME arrays (``iebme_reference``), the side
  partial sums as an int64 product of the side codes, then Y = fp16 of the float32 sum over the main
  groups and then the side groups of (s_w * s_x) * P (the kernels' order);
* independent dense computation: weights and inputs dequantized and put back in the original column
  order (from ``decode()``, the side matrix and the channel indices), Y = X Wᵀ in float64; the reference
  must agree within :func:`~.iebme_check.fp16_close`;
* GPU (``backend="cupy"``): the main partial sums from the IE-BME kernel's debug path and the side
  partial sums from a CuPy int32 matmul must equal the reference's exactly, and Y composed from them must
  agree with the reference output.
"""

from __future__ import annotations

import numpy as np

from ..formats.arithmetic.outlier_side import OutlierSide, quantize_inputs
from ..formats.iebme import IEBMEMatrix
from .iebme_check import dense_partials, fp16_close
from .iebme_reference import iebme_partial_sums

HOT = 30.0  # outlier channels of real inputs are 10-100x larger than the rest


def combine(p_main: np.ndarray, sw: np.ndarray, sx: np.ndarray, p_side: np.ndarray, so: np.ndarray,
            osx: np.ndarray) -> np.ndarray:
    """fp16 [N, M]: acc = acc + (s_w * s_x) * P in float32, main groups in order, then the side groups."""
    n, m = p_main.shape[:2]
    acc = np.zeros((n, m), np.float32)
    for p, w_s, x_s in ((p_main, sw, sx), (p_side, np.broadcast_to(so, (m, p_side.shape[2])), osx)):
        for j in range(p.shape[2]):
            s = x_s[:, j : j + 1].astype(np.float32) * w_s[:, j].astype(np.float32)[None, :]
            acc = acc + s * p[:, :, j].astype(np.float32)
    return acc.astype(np.float16)


def _expand(codes: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """float64 code * scale of its group (codes [R, C], scales [R, ceil(C/group)])."""
    c = codes.shape[1]
    return codes.astype(np.float64) * np.repeat(scales.astype(np.float64), group, axis=1)[:, :c]


def dense_truth(main_codes: np.ndarray, sw: np.ndarray, group: int, side: OutlierSide, side_group: int,
                xq: np.ndarray, sx: np.ndarray, oq: np.ndarray, osx: np.ndarray) -> np.ndarray:
    """float64 [N, M] = X Wᵀ with W and X dequantized and put back in the original column order."""
    m, k = main_codes.shape
    n_out = side.channels.size
    normal = side.perm[: k - n_out].astype(np.int64)
    w = np.zeros((m, k))
    w[:, normal] = _expand(main_codes, sw, group)[:, : k - n_out]
    w[:, side.channels] = side.codes.astype(np.float64) * side.scales.astype(np.float64)
    x = np.zeros((xq.shape[0], k))
    x[:, normal] = _expand(xq, sx, group)[:, : k - n_out]
    x[:, side.channels] = _expand(oq, osx, side_group)
    return x @ w.T


def check_outlier_layer(m: IEBMEMatrix, w_scales: np.ndarray, group_size: int, act: dict, side: OutlierSide,
                        ns, backend: str, rng: np.random.Generator, name: str = "layer") -> list[str]:
    """One message per failed check (empty: Y = main + side holds on every N, CPU and GPU alike)."""
    out: list[str] = []
    _, k = m.shape
    gs = min(group_size, k)
    og = int(act.get("outlier_group_size") or min(gs, side.channels.size))
    codes = m.decode()
    dev = None
    for n in ns:
        x = rng.standard_normal((n, k)).astype(np.float32)
        x[:, side.channels] *= HOT
        xq, sx, oq, osx = quantize_inputs(x, side, act)
        p_main = iebme_partial_sums(m, xq, gs)
        p_side = dense_partials(side.codes, oq, og)
        y_ref = combine(p_main, w_scales, sx, p_side, side.scales, osx)
        truth = dense_truth(codes, w_scales, gs, side, og, xq, sx, oq, osx)
        ok = fp16_close(y_ref, truth)
        if not ok.all():
            out.append(f"{name}: main + outlier reference differs from the dense computation at "
                       f"{int((~ok).sum())} of {ok.size} outputs (N={n})")
            continue
        if backend != "cupy":
            continue
        import cupy as cp

        from .iebme_spmm import prepare_layer, spmm_iebme

        if dev is None:
            dev = prepare_layer(m, w_scales, group_size)
        p_gpu = spmm_iebme(dev, xq, sx, debug_partials=True).get()
        if not np.array_equal(p_gpu, p_main):
            out.append(f"{name}: GPU main partial sums differ from the reference at "
                       f"{int((p_gpu != p_main).sum())} of {p_main.size} (N={n})")
        oq_d = cp.asarray(oq, dtype=cp.int32)
        wq_d = cp.asarray(side.codes, dtype=cp.int32)
        p_side_gpu = cp.stack([cp.matmul(oq_d[:, a : a + og], wq_d[:, a : a + og].T)
                               for a in range(0, side.channels.size, og)], axis=2).get()
        if not np.array_equal(p_side_gpu, p_side):
            out.append(f"{name}: GPU outlier partial sums differ from the reference at "
                       f"{int((p_side_gpu != p_side).sum())} of {p_side.size} (N={n})")
        y_gpu = combine(p_gpu, w_scales, sx, p_side_gpu, side.scales, osx)
        if not fp16_close(y_gpu, y_ref.astype(np.float64)).all():
            out.append(f"{name}: GPU main + outlier output differs from the reference (N={n})")
    return out
