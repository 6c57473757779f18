"""IE-BME prompts: decode the layer once to a dense weight, then dense products (docs/kernels.md, "IE-BME prefill").

* float16 activations (W4A16 / W2A16, :func:`spmm_dense16`): the dense float16 weight (``iebme_decode.cu``; 4-bit
  weights as exact hi | lo halves), then one cuBLAS GEMM (``cublas_gemm.gemm_decoded``); the result is
  ``iebme_reference.iebme_float_reference``'s up to float32 summation order (every product exact);
* quantized activations (W4A4 / W2A4 / W4A8 / W2A8, :func:`spmm_dense_int`): the same dense weight, and each input
  s_x · q_x (exact in float32) as two float16 halves; two cuBLAS GEMMs (hi, then lo added) into one float32 result,
  so every product is exact and every sum float32, the outlier side product added, one float16 rounding:
  ``iebme_spmm``'s function up to float32 rounding of the sums (the group scaling is folded into the products).

The IE-BME kernels take 32 tokens a launch, so a prompt of N tokens re-reads the layer N / 32 times; from
``DENSE_FROM_N`` rows (float16 activations) or ``DENSE_INT_FROM_N`` rows (quantized ones) the runtime decodes once
instead (``KernelOp``), while ``DENSE_PREFILL`` is on (the default).
"""

from __future__ import annotations

from functools import cache

import numpy as np

from .cublas_gemm import dense_halves, gemm_decoded
from .errors import KernelError
from .loader import require_cupy

#: On since the runtime's GPU agreement passed with it (H100, 2026-12-07; ``bash benchmarks/union_h200.sh prefill``).
DENSE_PREFILL = True
#: Rows from which a prompt decodes once, from the H100 timings of a LLaMA-2-7B block (docs/kernels.md, "IE-BME
#: prefill"): W4A16 1.42 against the kernel's 1.84 ms at 64 rows; quantized inputs 2.94 against 3.66 at 128 rows, but
#: 3.03 against 1.73 at 64. Decode steps (at most 32 rows) stay on the kernel either way.
DENSE_FROM_N = 64
DENSE_INT_FROM_N = 128
_WS: dict[tuple, object] = {}  # decode workspaces, one per shape


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


def _decoded(layer):
    """:func:`decode_dense` into the workspace of the layer's shape (one per shape, shared by the layers of it)."""
    cp = require_cupy()
    key = (layer.shape[0], dense_halves(layer.bits) * layer.tc * 64)
    if key not in _WS:
        _WS[key] = cp.empty(key, dtype=cp.float16)
    return decode_dense(layer, _WS[key])


def spmm_dense16(layer, x, out=None):
    """float16 Y [N, M] (CuPy) of the layer on float16 activations ``x`` [N, K]: decode into a workspace (one per
    shape, shared by the layers of that shape), then one cuBLAS GEMM with float32 accumulation."""
    cp = require_cupy()
    m, k = layer.shape
    x = cp.ascontiguousarray(x)
    if x.dtype != cp.float16 or x.ndim != 2 or x.shape[1] < k:
        raise KernelError(f"x must be a float16 [N, >= {k}] array, got {x.dtype} {x.shape}")
    kp, halves = layer.tc * 64, dense_halves(layer.bits)
    ws = _decoded(layer)
    if out is None:
        out = cp.empty((x.shape[0], m), dtype=cp.float16)
    gemm_decoded(ws, x, k, kp, halves, out)
    return out


def spmm_dense_int(layer, xq, sx, side: tuple | None = None):
    """float16 Y [N, M] (torch) of the layer on quantized activations: codes ``xq`` int8 [N, >= K] with scales
    ``sx`` [N, G] (``InputRule``), and the outlier ``side`` (codes, scales, weight codes, weight scales, group) or
    None. The dense weight (:func:`decode_dense`, shared with :func:`spmm_dense16`) times the inputs' exact halves
    (:func:`scaled_inputs`): two cuBLAS GEMMs into one float32 result, the side added, one rounding."""
    import torch

    cp = require_cupy()
    m, k = layer.shape
    kp, halves = layer.tc * 64, dense_halves(layer.bits)
    ws = _decoded(layer)
    y = torch.empty(xq.shape[0], m, dtype=torch.float32, device=xq.device)
    yc = cp.from_dlpack(y)
    for i, part in enumerate(scaled_inputs(xq, sx, min(layer.group_size, k), k)):
        gemm_decoded(ws, cp.from_dlpack(part), k, kp, halves, yc, accumulate=i > 0)
    return _with_side(y, side)


def scaled_inputs(xq, sx, group_size: int, k: int):
    """(hi, lo) float16 [N, K] with hi + lo = s_x · q_x exactly: a code of at most 8 bits times a float16-valued scale
    has at most 18 significant bits, hi = fp16 of it (11), lo = fp16 of the rest (exact unless it falls below
    float16's normal range, where it keeps 2^-24 absolute). Any device."""
    xs = xq[:, :k].float() * sx.float().repeat_interleave(group_size, dim=1)[:, :k]
    hi = xs.half()
    return hi, (xs - hi.float()).half()


def dense_int_product(w_halves, xq, sx, group_size: int, side: tuple | None = None):
    """:func:`spmm_dense_int`'s arithmetic in torch on any device: ``w_halves`` the dense weight as float16
    ``[M, halves * K]`` (``iebme_reference.decoded_dense_reference``: hi | lo for 4-bit codes), every product
    exact, float32 sums, the side product added, one float16 rounding (the CPU tests run it)."""
    import torch

    k = xq.shape[1]
    halves = w_halves.shape[1] // k
    wf = w_halves.float()
    y = torch.zeros(xq.shape[0], w_halves.shape[0], dtype=torch.float32, device=xq.device)
    for part in scaled_inputs(xq, sx, group_size, k):
        y += torch.cat([part.float()] * halves, dim=1) @ wf.T
    return _with_side(y, side)


def _with_side(y, side: tuple | None):
    """float16 of float32 ``y`` plus the outlier side product (``grouped_int_matmul``), rounded once."""
    from ..formats.arithmetic.grouped import grouped_int_matmul

    if side is not None:
        oq, osx, wq, sw, group = side
        grouped_int_matmul(oq, osx, wq, sw, group, out=y)
    return y.half()
