"""IE-BME prefill for float16 activations (W4A16 / W2A16): decode the layer once to a dense float16 weight
(``iebme_decode.cu``; 4-bit weights as exact hi | lo halves), then one cuBLAS GEMM (``cublas_gemm.gemm_decoded``).

The float16-activation IE-BME kernel takes 32 tokens a launch, so a prompt of N tokens re-reads the layer N / 32
times; from ``DENSE_FROM_N`` rows the runtime decodes once instead (``KernelOp``), when ``DENSE_PREFILL`` is on.
The result is ``iebme_reference.iebme_float_reference``'s up to float32 summation order (every product exact).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from .cublas_gemm import dense_halves, gemm_decoded
from .errors import KernelError
from .loader import require_cupy

#: Off until its GPU tests pass (written 2026-12-07 without a GPU: ``bash benchmarks/tcbc_batch_ab_h200.sh`` runs
#: them); meanwhile prompts go through the kernel 32 tokens a launch.
DENSE_PREFILL = False
DENSE_FROM_N = 64  # rows from which a W4A16 product decodes once (not yet measured: the kernel's N = 32 launches)
_WS: dict[tuple[int, int], object] = {}


@cache
def _function(bits: int):
    from .loader import load_module

    return load_module("iebme_decode", (f"iebme_decode_dense<{bits}>",)).get_function(f"iebme_decode_dense<{bits}>")


def decode_dense(layer, out=None):
    """The layer (``iebme_spmm.DeviceLayer``, tile 16x64, areas 2x2) as a dense CuPy float16 [M, halves * Kp]
    (Kp = 64 x tile columns; ``dense_halves``): w = code x scale, 4-bit as hi = fp16(w) in [0, Kp) and
    lo = fp16(w - hi) in [Kp, 2 Kp) (``iebme_reference.decoded_dense_reference``)."""
    cp = require_cupy()
    m, k = layer.shape
    kp = layer.tc * 64
    width = dense_halves(layer.bits) * kp
    if out is None:
        out = cp.empty((m, width), dtype=cp.float16)
    if out.shape != (m, width) or out.dtype != cp.float16 or not out.flags.c_contiguous:
        raise KernelError(f"out must be a contiguous float16 [{m}, {width}] array")
    _function(layer.bits)((layer.tr * layer.tc,), (256,), (
        layer.values, layer.bitmaps, layer.offsets, layer.pinv if layer.pinv is not None else np.uint64(0),
        layer.wsT, out, np.int32(m),
        np.int32(layer.tc), np.int32(kp), np.int32(layer.mp), np.int32(min(layer.group_size, k))))
    return out


def spmm_dense16(layer, x, out=None):
    """float16 Y [N, M] (CuPy) of the layer on float16 activations ``x`` [N, K]: decode into a workspace (one per
    shape, shared by the layers of that shape), then one cuBLAS GEMM with float32 accumulation."""
    cp = require_cupy()
    m, k = layer.shape
    x = cp.ascontiguousarray(x)
    if x.dtype != cp.float16 or x.ndim != 2 or x.shape[1] < k:
        raise KernelError(f"x must be a float16 [N, >= {k}] array, got {x.dtype} {x.shape}")
    kp, halves = layer.tc * 64, dense_halves(layer.bits)
    key = (m, halves * kp)
    if key not in _WS:
        _WS[key] = cp.empty(key, dtype=cp.float16)
    ws = decode_dense(layer, _WS[key])
    if out is None:
        out = cp.empty((x.shape[0], m), dtype=cp.float16)
    gemm_decoded(ws, x, k, kp, halves, out)
    return out
