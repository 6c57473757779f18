"""CPU reference of the IE-BME W4A4 / W2A4 SpMM (docs/kernels.md), read straight from the stored arrays.

``Y[n, m] = sum_g s_w[m, g] * s_x[n, g] * sum_{k in g} q_w[m, k] * q_x[n, k]``: the integer partial sum
of every group is exact (int32), the scaled groups are accumulated in float32 in group order as
``acc = acc + (s_w * s_x) * float(partial)`` (two separately rounded products, then one add: no fused
multiply-add), and the result is rounded once to float16. The GPU kernel without split-K performs the
same operations in the same order, so its output is bit-identical; with split-K only the float32
summation order differs.

The weights are read from the IE-BME arrays themselves (bitmap ranks, the Q aligned value streams and
the per-tile row permutations), never through ``IEBMEMatrix.decode``, so this is an independent check
of the format as well as of the kernel.
"""

from __future__ import annotations

import numba
import numpy as np

from ..formats.iebme import IEBMEMatrix
from .errors import KernelError


@numba.njit(cache=True, nogil=True)
def _partials(bitmaps, offsets, values, perm, has_perm, bits, hl, kl, ra, ca, tc_count, m_true, k_true,
              x, group_size, n_groups):
    """int64 partial sums [M, G, N] (int64 so overflow can be detected by the caller)."""
    h = hl // ra
    w = kl // ca
    q_count = ra * ca
    hw = h * w
    wpt = (hw + 63) // 64
    n = x.shape[0]
    n_tiles = offsets.shape[0] - 1
    out = np.zeros((m_true, n_groups, n), dtype=np.int64)
    mask = (1 << bits) - 1
    sign = 1 << (bits - 1)
    for t in range(n_tiles):
        tr = t // tc_count
        tcol = t % tc_count
        base_v = np.int64(offsets[t])
        # popcount of the tile = P_t
        p_t = 0
        for wi in range(wpt):
            word = bitmaps[t * wpt + wi]
            for b in range(64):
                if (word >> np.uint64(b)) & np.uint64(1):
                    p_t += 1
        rank = 0
        for p in range(hw):
            word = bitmaps[t * wpt + p // 64]
            if not ((word >> np.uint64(p % 64)) & np.uint64(1)):
                continue
            i = p // w
            j = p % w
            for q in range(q_count):
                v = base_v + q * p_t + rank
                byte = values[(v * bits) // 8]
                code = (np.int64(byte) >> ((v * bits) % 8)) & mask
                if code >= sign:
                    code -= 1 << bits
                if code == 0:
                    continue
                a = q // ca
                c = q % ca
                r = a * h + i
                orig = perm[t, r] if has_perm else r
                row = tr * hl + orig
                k = tcol * kl + c * w + j
                if row >= m_true or k >= k_true:
                    continue  # padding (always zero codes in a valid encoding)
                g = k // group_size
                for nn in range(n):
                    out[row, g, nn] += code * np.int64(x[nn, k])
            rank += 1
    return out


@numba.njit(cache=True, nogil=True)
def _scale(partial, w_scales, x_scales):
    """fp32 acc over groups in order: acc += (s_w * s_x) * float(partial); returns float32 [N, M]."""
    m, g_count, n = partial.shape
    y = np.zeros((n, m), dtype=np.float32)
    for row in range(m):
        for nn in range(n):
            acc = np.float32(0.0)
            for g in range(g_count):
                s = np.float32(w_scales[row, g]) * np.float32(x_scales[nn, g])
                acc = acc + s * np.float32(partial[row, g, nn])
            y[nn, row] = acc
    return y


def check_group_size(k: int, group_size: int) -> int:
    """Number of groups; the kernels need a group size that is a multiple of 64 or covers all of K."""
    if group_size <= 0:
        raise KernelError(f"group_size must be positive, got {group_size}")
    if group_size < k and group_size % 64:
        raise KernelError(f"group_size {group_size} must be a multiple of 64 (or >= K = {k})")
    return -(-k // group_size)


def iebme_partial_sums(m: IEBMEMatrix, x_codes: np.ndarray, group_size: int) -> np.ndarray:
    """Exact integer partial sums int32 [N, M, G] of the product, read from the IE-BME arrays."""
    g = m.geometry
    mm, k = g.shape
    x = np.ascontiguousarray(x_codes, dtype=np.int8)
    if x.ndim != 2 or x.shape[1] != k:
        raise KernelError(f"x_codes must be [N, {k}], got {x.shape}")
    n_groups = check_group_size(k, group_size)
    gs = min(group_size, k)
    has_perm = m.perm is not None
    perm = np.ascontiguousarray(m.perm if has_perm else np.zeros((1, g.tile[0]), np.uint8), dtype=np.int64)
    p = _partials(m.bitmaps.astype(np.uint64, copy=False), m.offsets.astype(np.int64),
                  m.values.astype(np.uint8, copy=False), perm, has_perm, g.bits, g.tile[0], g.tile[1],
                  g.areas[0], g.areas[1], g.grid[1], mm, k, x, gs, n_groups)
    if p.size and np.abs(p).max() >= 2**31:
        raise KernelError("a group's integer partial sum exceeds int32")
    return np.ascontiguousarray(p.transpose(2, 0, 1)).astype(np.int32)


def scale_partials(partial: np.ndarray, w_scales: np.ndarray, x_scales: np.ndarray,
                   dtype: type = np.float16) -> np.ndarray:
    """fp16 [N, M] from int32 partial sums [N, M, G] (fp32 accumulation in group order); ``dtype=np.float32``:
    the float32 sums before the rounding (to which the outlier side product is added)."""
    n, mm, gc = partial.shape
    ws = np.asarray(w_scales)
    xs = np.asarray(x_scales)
    if ws.shape != (mm, gc) or xs.shape != (n, gc):
        raise KernelError(f"scales must be w [{mm}, {gc}] and x [{n}, {gc}], got {ws.shape} and {xs.shape}")
    y = _scale(np.ascontiguousarray(partial.transpose(1, 2, 0)), ws.astype(np.float32), xs.astype(np.float32))
    return y.astype(dtype)


def iebme_spmm_reference(m: IEBMEMatrix, w_scales: np.ndarray, x_codes: np.ndarray, x_scales: np.ndarray,
                         group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(y fp16 [N, M], partial int32 [N, M, G]) of the W4A4 / W2A4 product (module docstring)."""
    partial = iebme_partial_sums(m, x_codes, group_size)
    return scale_partials(partial, w_scales, x_scales), partial


def iebme_float_reference(m: IEBMEMatrix, w_scales: np.ndarray, x: np.ndarray, group_size: int) -> np.ndarray:
    """fp16 Y [N, M] of W4A16 / W2A16 (float16 activations, the ``iebme_spmm`` kernel's AF16 variant): per group the
    sum of code times fp16(x) (float64 here: exact for the kernel's float32 sums up to their rounding), times the
    weight scale, summed over groups in float32 order, one float16 rounding. The codes are decoded from the stored
    bitmaps, value streams and row permutations."""
    g = m.geometry
    mm, k = g.shape
    xf = np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float64)
    if xf.ndim != 2 or xf.shape[1] != k:
        raise KernelError(f"x must be [N, {k}], got {xf.shape}")
    n_groups = check_group_size(k, group_size)
    gs = min(group_size, k)
    ws = np.asarray(w_scales, dtype=np.float32)
    if ws.shape != (mm, n_groups):
        raise KernelError(f"w_scales must be [{mm}, {n_groups}], got {ws.shape}")
    codes = m.decode().astype(np.float64)
    y = np.zeros((xf.shape[0], mm), dtype=np.float32)
    for j in range(n_groups):
        part = (xf[:, j * gs:(j + 1) * gs] @ codes[:, j * gs:(j + 1) * gs].T).astype(np.float32)
        y = y + part * ws[:, j][None, :]
    return y.astype(np.float16)


def decoded_dense_reference(m: IEBMEMatrix, w_scales: np.ndarray, group_size: int) -> np.ndarray:
    """``iebme_decode.decode_dense``'s output without its padding: w = code x scale (float32, exact) from the
    decoded codes, as float16 [M, K]; for 4-bit codes lo = fp16(w - hi) beside it, [M, 2K]."""
    mm, k = m.geometry.shape
    n_groups = check_group_size(k, group_size)
    ws = np.asarray(w_scales, dtype=np.float32)
    if ws.shape != (mm, n_groups):
        raise KernelError(f"w_scales must be [{mm}, {n_groups}], got {ws.shape}")
    w = m.decode().astype(np.float32) * np.repeat(ws, min(group_size, k), axis=1)[:, :k]
    hi = w.astype(np.float16)
    if m.geometry.bits <= 2:
        return hi
    return np.concatenate([hi, (w - hi.astype(np.float32)).astype(np.float16)], axis=1)
