"""IE-BME prompts: decode the layer once to a dense weight, then dense products (docs/kernels.md, "IE-BME prefill").

* float16 activations (W4A16 / W2A16, :func:`spmm_dense16`): the dense float16 weight (``iebme_decode.cu``; 4-bit
  weights as exact hi | lo halves), then one cuBLAS GEMM (``cublas_gemm.gemm_decoded``); the result is
  ``iebme_reference.iebme_float_reference``'s up to float32 summation order (every product exact);
* quantized activations (W4A4 / W2A4 / W4A8 / W2A8, :func:`spmm_dense_int`): the codes as a dense float16 matrix,
  then every quantization group's integer product in one batched float32 GEMM (exact: codes of at most 8 bits,
  group sums far below 2^24) and the scaled groups summed (``formats.arithmetic.grouped``), the outlier side
  product added in float32, one float16 rounding: ``iebme_spmm``'s function up to float32 summation order.

The IE-BME kernels take 32 tokens a launch, so a prompt of N tokens re-reads the layer N / 32 times; from
``DENSE_FROM_N`` rows the runtime decodes once instead (``KernelOp``), when ``DENSE_PREFILL`` is on.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from .cublas_gemm import dense_halves, gemm_decoded
from .errors import KernelError
from .loader import require_cupy

#: Off until their GPU tests pass (written 2026-12-07 without a GPU: ``bash benchmarks/union_h200.sh`` runs them);
#: meanwhile prompts go through the kernel 32 tokens a launch.
DENSE_PREFILL = False
DENSE_FROM_N = 64  # rows from which an IE-BME product decodes once (not yet measured: the kernel's N = 32 launches)
_WS: dict[tuple, object] = {}  # decode workspaces, one per shape


_NAMES = tuple(f"iebme_decode_dense<{b}, {c}>" for b in (4, 2) for c in ("false", "true"))


@cache
def _function(bits: int, codes: bool = False):
    from .loader import load_module

    return load_module("iebme_decode", _NAMES).get_function(f"iebme_decode_dense<{bits}, {str(codes).lower()}>")


def decode_dense(layer, out=None, codes: bool = False):
    """The layer (``iebme_spmm.DeviceLayer``, tile 16x64, areas 2x2) as a dense CuPy float16 [M, halves * Kp]
    (Kp = 64 x tile columns; ``dense_halves``): w = code x scale, 4-bit as hi = fp16(w) in [0, Kp) and
    lo = fp16(w - hi) in [Kp, 2 Kp) (``iebme_reference.decoded_dense_reference``). ``codes``: the codes themselves,
    [M, Kp] (``iebme_matrix.decode()``, padded)."""
    cp = require_cupy()
    m, k = layer.shape
    kp = layer.tc * 64
    width = (1 if codes else dense_halves(layer.bits)) * kp
    if out is None:
        out = cp.empty((m, width), dtype=cp.float16)
    if out.shape != (m, width) or out.dtype != cp.float16 or not out.flags.c_contiguous:
        raise KernelError(f"out must be a contiguous float16 [{m}, {width}] array")
    _function(layer.bits, codes)((layer.tr * layer.tc,), (256,), (
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


def spmm_dense_int(layer, xq, sx, side: tuple | None = None):
    """float16 Y [N, M] (torch) of the layer on quantized activations: codes ``xq`` int8 [N, >= K] with scales
    ``sx`` [N, G] (``InputRule``), and the outlier ``side`` (codes, scales, weight codes, weight scales, group) or
    None. The layer's codes are decoded into a workspace (one per shape), then :func:`dense_int_product`."""
    import torch

    cp = require_cupy()
    m, k = layer.shape
    key = ("codes", m, layer.tc * 64)
    if key not in _WS:
        _WS[key] = cp.empty(key[1:], dtype=cp.float16)
    codes = torch.from_dlpack(decode_dense(layer, _WS[key], codes=True))
    w_scales = torch.from_dlpack(layer.wsT)[:, :m].T
    return dense_int_product(codes[:, :k], w_scales, xq[:, :k], sx, min(layer.group_size, k), side)


def dense_int_product(w_codes, w_scales, xq, sx, group_size: int, side: tuple | None = None):
    """float16 [N, M]: the grouped integer product of activation codes ``xq`` [N, K] (scales ``sx`` [N, G]) and
    weight codes ``w_codes`` [M, K] (scales ``w_scales`` [M, G]) by ``grouped_int_matmul_batched``, plus the
    outlier ``side`` product in float32 (``grouped_int_matmul``), rounded once: what the IE-BME kernel computes,
    up to float32 summation order. Any device (the CPU tests run it on decoded codes)."""
    from ..formats.arithmetic.grouped import grouped_int_matmul, grouped_int_matmul_batched

    y = grouped_int_matmul_batched(xq, sx, w_codes, w_scales, group_size)
    if side is not None:
        oq, osx, wq, sw, group = side
        grouped_int_matmul(oq, osx, wq, sw, group, out=y)
    return y.half()
