"""GPU Tiled-CBC spMspV (decode, N = 1) with dynamic pruning; see ``tiled_cbc_spmspv.cu``.

``spmspv(dev, x, tau)`` computes ``y[m] = sum over k with |x_k| > tau of W[m, k] x[k]`` (fp32 sums,
fp16 or fp32 out) from a :class:`DeviceTiledCBC`. ``tau=None`` (or negative) turns pruning off.
"""

from __future__ import annotations

import numpy as np

from .tiled_cbc_device import TILE, DeviceTiledCBC, _cupy, load_module

NW = 4  # default warps per block
WARPS = (4, 8)
STAGES = (4, 8)
BITS = (16, 4, 2)
_EXPR = tuple(f"tcbc_spmspv<{b}, {w}, {s}>" for b in BITS for w in WARPS for s in STAGES)


def _module():
    return load_module("tiled_cbc_spmspv", _EXPR)


def _slot_bytes(bits: int) -> int:
    return TILE[0] * bits // 8 + 32


def default_chunk(dev: DeviceTiledCBC, sms: int = 132) -> int:
    """GTiles per block along K: the largest power of two leaving >= 16 blocks per SM (fills the GPU)."""
    gr, gc = dev.grid
    for chunk in (32, 16, 8, 4):
        if gr * -(-gc // chunk) >= 16 * sms:
            return chunk
    return 2


def spmspv(
    dev: DeviceTiledCBC,
    x,
    tau: float | None,
    out=None,
    out_dtype=np.float16,
    chunk: int | None = None,
    stages: int = 4,
    warps: int = NW,
):
    """Launch the kernel on the current stream; returns ``out`` (CuPy [M], fp16 or fp32)."""
    cp = _cupy()
    M, K = dev.shape
    if x.shape != (K,) or x.dtype != cp.float16:
        raise ValueError(f"x must be a CuPy float16 array of shape ({K},), got {x.dtype} {x.shape}")
    bits = 16 if dev.bits is None else int(dev.bits)
    if stages not in STAGES or warps not in WARPS:
        raise ValueError(f"stages must be one of {STAGES} and warps one of {WARPS}")
    if out is None:
        out = cp.empty(M, dtype=out_dtype)
    out_f32 = out.dtype == cp.float32
    if not out_f32 and out.dtype != cp.float16:
        raise ValueError("out must be float16 or float32")
    gr, gc = dev.grid
    chunk = default_chunk(dev) if chunk is None else int(chunk)
    splits = -(-gc // chunk)
    ncol = chunk * TILE[1]
    ring = max(warps * stages * _slot_bytes(bits), warps * TILE[0] * 4)
    smem = ring + ncol * (4 + 4 + 2) + chunk * 4
    f = _module().get_function(f"tcbc_spmspv<{bits}, {warps}, {stages}>")
    t = np.float32(-1.0 if tau is None else tau)
    scales = dev.scales_t if dev.scales_t is not None else dev.dummy
    group = dev.group_size or 1
    f(
        (splits, gr),
        (warps * 32,),
        (
            dev.bitmap,
            dev.colinfo,
            dev.tile_offset,
            dev.values_u8,
            x,
            t,
            scales,
            np.int32(group),
            np.int32(gc),
            np.int32(M),
            np.int32(K),
            np.int32(dev.Mp),
            np.int32(chunk),
            dev.partial(splits),
            dev.tickets,
            out,
            np.int32(out_f32),
        ),
        shared_mem=smem,
    )
    return out


def bytes_read(dev: DeviceTiledCBC, x_host: np.ndarray, tau: float | None) -> int:
    """Bytes the kernel must read for this input: ColInfo, TileOffset and X always; bitmap and values of
    the active columns only (the achieved-bandwidth denominator)."""
    M, K = dev.shape
    gr, gc = dev.grid
    t = -1.0 if tau is None else float(tau)
    act = np.zeros(gc * TILE[1], dtype=bool)
    act[:K] = np.abs(x_host.astype(np.float32)) > t
    ci = _cupy().asnumpy(dev.colinfo).astype(np.int64).reshape(gr, gc * TILE[1])
    nnz = ci & 0xFFFF
    vbits = 16 if dev.bits is None else int(dev.bits)
    padded = -(-nnz * vbits // 128) * 16
    live = act[None, :] & (nnz > 0)
    return int((padded * live).sum() + 32 * live.sum() + dev.colinfo.nbytes + dev.tile_offset.nbytes + 2 * K)
