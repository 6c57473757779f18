"""CPU references for the Tiled-CBC kernels, reading the stored arrays as the GPU kernels do.

Both walk GTile by GTile, column by column: ColInfo gives the column's start and count, the bitmap's
masked popcount gives each nonzero's rank (value index = TileOffset[gtile] + start + rank), so a bug in
the stored layout shows up here exactly as it would on the GPU (nothing goes through ``decode()``).

Arithmetic: weights are float16 values, or b-bit codes times their float16 group scale, formed in
float32 (``w = float(q) * float(s)``; exact for 4- and 2-bit codes); products and sums are float32.

* ``spmspv_reference(m, x, tau)`` - decode, N = 1, with dynamic pruning: input k is active iff
  ``|x_k| > tau``; inactive columns are neither read nor multiplied. ``tau=None`` (or any negative
  value) turns dynamic pruning off.
* ``spmm_reference(m, X)`` - prefill, ``Y[n, m] = sum_k W[m, k] X[n, k]``, float32 sums, float16 out.
* ``decoded_dense_reference(m)`` - the dense float16 weight ``decode_dense`` writes (4-bit codes: two float16
  halves whose sum is the weight).
"""

from __future__ import annotations

import numba as nb
import numpy as np

from ..formats.bitpack import unpack_codes
from ..formats.tiled_cbc import TiledCBCMatrix
from .errors import KernelError


@nb.njit(cache=True, inline="always")
def _popcount64(v):
    v = v - ((v >> np.uint64(1)) & np.uint64(0x5555555555555555))
    v = (v & np.uint64(0x3333333333333333)) + ((v >> np.uint64(2)) & np.uint64(0x3333333333333333))
    v = (v + (v >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (v * np.uint64(0x0101010101010101)) >> np.uint64(56)


@nb.njit(cache=True)
def _column_weights(
    bitmap, colinfo, tile_offset, vals, scales, group, gtile, c, tile_k, wpc, gr_row0, k, rows_out, w_out
):
    """Rows and float32 weights of column c of a GTile, via masked popcounts; returns the count."""
    col = gtile * tile_k + c
    info = np.uint32(colinfo[col])
    start = np.int64(tile_offset[gtile]) + np.int64(info >> np.uint32(16))
    n = 0
    for w in range(wpc):
        word = np.uint64(bitmap[col * wpc + w])
        if word == 0:
            continue
        before = np.uint64(0)
        for ww in range(w):
            before += _popcount64(np.uint64(bitmap[col * wpc + ww]))
        for r in range(64):
            if (word >> np.uint64(r)) & np.uint64(1):
                below = word & ((np.uint64(1) << np.uint64(r)) - np.uint64(1))
                rank = np.int64(before + _popcount64(below))
                row = gr_row0 + w * 64 + r
                v = np.float32(vals[start + rank])
                if scales.shape[0] > 0:
                    v = v * np.float32(scales[row, k // group])
                rows_out[n] = row
                w_out[n] = v
                n += 1
    if n != np.int64(info & np.uint32(0xFFFF)):
        raise KernelError("colinfo count disagrees with the bitmap popcount")
    return n


@nb.njit(cache=True)
def _walk(
    bitmap, colinfo, tile_offset, vals, scales, group, grid_c, tile_m, tile_k, m_true, k_true, X, prune, tau
):
    """Y[N, M] = X[N, K] @ W^T, GTile by GTile, column by column; with ``prune`` (N = 1) a column is read only
    where |x_k| > tau."""
    wpc = tile_m // 64
    ngt = tile_offset.size - 1
    nrow = X.shape[0]
    y = np.zeros((nrow, (ngt // grid_c) * tile_m), dtype=np.float32)
    rows = np.empty(tile_m, dtype=np.int64)
    ws = np.empty(tile_m, dtype=np.float32)
    xcol = np.empty(nrow, dtype=np.float32)
    for g in range(ngt):
        tr = g // grid_c
        tc = g % grid_c
        for c in range(tile_k):
            k = tc * tile_k + c
            if k >= k_true:
                continue
            for t in range(nrow):
                xcol[t] = np.float32(X[t, k])
            if prune and not abs(xcol[0]) > tau:  # dynamic pruning: the column is never read
                continue
            n = _column_weights(
                bitmap, colinfo, tile_offset, vals, scales, group, g, c, tile_k, wpc, tr * tile_m, k, rows, ws
            )
            for i in range(n):
                r = rows[i]
                wv = ws[i]
                for t in range(nrow):
                    y[t, r] = y[t, r] + wv * xcol[t]
    return y[:, :m_true]


def _prepare(m: TiledCBCMatrix, w_scales, group_size):
    g = m.geometry
    if g.bits is None:
        if w_scales is not None:
            raise KernelError("w_scales given for a float16 Tiled-CBC matrix")
        return m.values.astype(np.float32), np.zeros((0, 1), dtype=np.float32), 1
    if w_scales is None or group_size is None:
        raise KernelError(f"a {g.bits}-bit Tiled-CBC matrix needs w_scales and group_size")
    vals = unpack_codes(m.values, g.bits).astype(np.float32)
    scales = np.asarray(w_scales)
    ngroups = -(-g.shape[1] // int(group_size))
    if scales.shape != (g.shape[0], ngroups):
        raise KernelError(
            f"w_scales must be [{g.shape[0]}, {ngroups}] for group size {group_size}, got {scales.shape}"
        )
    # padded rows (beyond M) have no nonzeros, so they never index the scales
    return vals, scales.astype(np.float32), int(group_size)


def _layout_args(m: TiledCBCMatrix, w_scales, group_size) -> tuple:
    """The stored arrays and geometry in the order the numba kernels take them."""
    g = m.geometry
    vals, scales, group = _prepare(m, w_scales, group_size)
    return (m.bitmap, m.colinfo, m.tile_offset, vals, scales, group, g.grid[1], g.tile[0], g.tile[1],
            g.shape[0], g.shape[1])


def _threshold(tau) -> np.float32:
    return np.float32(-1.0) if tau is None else np.float32(tau)


def _product(m: TiledCBCMatrix, X: np.ndarray, w_scales, group_size) -> np.ndarray:
    """float32 Y[N, M] = X[N, K] @ W^T by :func:`_walk`, every column read (no dynamic pruning)."""
    return _walk(*_layout_args(m, w_scales, group_size), X, False, np.float32(0.0))


def spmspv_reference(
    m: TiledCBCMatrix, x: np.ndarray, tau: float | None, w_scales=None, group_size=None, out_dtype=np.float32
) -> np.ndarray:
    """y[M] = sum over active k of W[:, k] * x[k]; active iff |x_k| > tau (tau None/negative: all)."""
    g = m.geometry
    x = np.asarray(x)
    if x.shape != (g.shape[1],):
        raise KernelError(f"x must have shape ({g.shape[1]},), got {x.shape}")
    y = _walk(*_layout_args(m, w_scales, group_size), x.astype(np.float16).astype(np.float32)[None, :], True,
              _threshold(tau))[0]
    return y.astype(out_dtype)


def spmspv_rows_reference(
    m: TiledCBCMatrix, X: np.ndarray, tau: float | None, w_scales=None, group_size=None, out_dtype=np.float32
) -> np.ndarray:
    """Y[N, M]: each row of X [N, K] its own :func:`spmspv_reference` (what the several-row kernel computes)."""
    X = np.asarray(X)
    if X.ndim != 2:
        raise KernelError(f"X must have shape (N, {m.geometry.shape[1]}), got {X.shape}")
    return np.stack([spmspv_reference(m, x, tau, w_scales, group_size, out_dtype) for x in X])


def spmm_reference(
    m: TiledCBCMatrix, X: np.ndarray, w_scales=None, group_size=None, out_dtype=np.float16
) -> np.ndarray:
    """Y[N, M] = X[N, K] @ W^T with float32 sums (float16 out by default)."""
    g = m.geometry
    X = np.asarray(X)
    if X.ndim != 2 or X.shape[1] != g.shape[1]:
        raise KernelError(f"X must have shape (N, {g.shape[1]}), got {X.shape}")
    Y = _product(m, np.ascontiguousarray(X.astype(np.float16).astype(np.float32)), w_scales, group_size)
    return Y.astype(out_dtype)


def decoded_dense_reference(m: TiledCBCMatrix, w_scales=None, group_size=None) -> np.ndarray:
    """``decode_dense``'s output, read from the stored arrays as the kernels read them: the float16 values, or the
    weights w = code x scale (float32, exact) rounded to float16, [M, K]; for 4-bit codes then lo = fp16(w - hi)
    beside them, [M, 2K] (``tiled_cbc_spmm.dense_halves``)."""
    # the SpMM walk of the identity: output (k, r) is the one product w[r, k] * 1, exact
    w = _product(m, np.eye(m.geometry.shape[1], dtype=np.float32), w_scales, group_size).T
    hi = w.astype(np.float16)
    if m.geometry.bits is None or m.geometry.bits <= 2:
        return hi
    return np.concatenate([hi, (w - hi.astype(np.float32)).astype(np.float16)], axis=1)


def dense_weights_f64(m: TiledCBCMatrix, w_scales=None, group_size=None) -> np.ndarray:
    """W [M, K] in float64 from ``decode()`` (and the scales): the independent ground truth for tests."""
    w = m.decode().astype(np.float64)
    if m.geometry.bits is not None:
        s = np.asarray(w_scales, dtype=np.float64)
        w = w * np.repeat(s, int(group_size), axis=1)[:, : w.shape[1]]
    return w


