"""GPU Tiled-CBC SpMM (prefill) on tensor cores; see ``tiled_cbc_spmm.cu``.

``spmm(dev, X)`` computes ``Y[N, M] = X[N, K] @ W^T`` (fp16 in, fp32 mma accumulation, fp16 out)
from a float16-valued :class:`DeviceTiledCBC`. b-bit layers are not handled by this kernel (prefill
of quantized layers: use the reference, or dequantize); it raises ``NotImplementedError``.
"""

from __future__ import annotations

import numpy as np

from .tiled_cbc_device import TILE, DeviceTiledCBC, _cupy, load_module

GK = 2
CONFIGS = {128: 1, 64: 2}  # BN -> min blocks per SM (launch bounds)
_SMEM_SET: dict[int, int] = {}
_EXPR = tuple(f"tcbc_spmm<{bn}, {GK}, {mb}>" for bn, mb in CONFIGS.items())


def _module():
    return load_module("tiled_cbc_spmm", _EXPR)


def default_bn(n: int) -> int:
    return 64 if n <= 256 else 128


def spmm(dev: DeviceTiledCBC, X, out=None, bn: int | None = None):
    cp = _cupy()
    if dev.bits is not None:
        raise NotImplementedError("the tensor-core SpMM kernel takes float16 Tiled-CBC values only")
    M, K = dev.shape
    if X.ndim != 2 or X.shape[1] != K or X.dtype != cp.float16:
        raise ValueError(f"X must be a CuPy float16 array [N, {K}], got {X.dtype} {X.shape}")
    if K % 8:
        Xp = cp.zeros((X.shape[0], -(-K // 8) * 8), dtype=cp.float16)
        Xp[:, :K] = X
        X, Kx = Xp, Xp.shape[1]
    else:
        X, Kx = cp.ascontiguousarray(X), K
    N = X.shape[0]
    bn = default_bn(N) if bn is None else int(bn)
    if bn not in CONFIGS:
        raise ValueError(f"bn must be one of {tuple(CONFIGS)}")
    if out is None:
        out = cp.empty((N, M), dtype=cp.float16)
    gr, gc = dev.grid
    if not hasattr(dev, "_spmm_raw"):
        dev._spmm_raw = -(-dev.max_window_bytes(GK) // 16) * 16
    raw = dev._spmm_raw
    bk = TILE[1] * GK
    smem = 2 * raw + bk * (TILE[0] + 8) * 2 + 2 * bn * (bk + 8) * 2
    f = _module().get_function(f"tcbc_spmm<{bn}, {GK}, {CONFIGS[bn]}>")
    if _SMEM_SET.get(bn, -1) < smem:  # set once per size (no driver query while a graph is captured)
        f.max_dynamic_shared_size_bytes = smem
        _SMEM_SET[bn] = smem
    # K passed is X's row length; columns beyond the true K have no weights, so the padding is inert
    f((-(-N // bn), gr), (256,),
      (dev.bitmap, dev.colinfo, dev.tile_offset, dev.values_u16, X, out, np.int32(gc), np.int32(M),
       np.int32(Kx), np.int32(N), np.int32(raw)), shared_mem=smem)
    return out
