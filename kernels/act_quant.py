"""Per-token activation quantization of IE-BME kernel inputs in one launch; see ``act_quant.cu``.

``quantize_inputs(x, ...)`` returns exactly what ``formats.arithmetic.activations.quantize_activations_torch``
(no outliers) or ``formats.arithmetic.outlier_side.quantize_inputs_torch`` (outliers) returns, with the main
codes already padded to ``kp`` columns for ``iebme_spmm.launch`` and the scales as float32 (the values are
the float16 scales, widened). :func:`quantize_inputs_reference` is that composition on the CPU, the
kernel's reference.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from ..formats.arithmetic.activations import quantize_activations_torch
from ..formats.arithmetic.outlier_side import quantize_inputs_torch
from ..formats.arithmetic.weights import FP16_TINY, grid_max, n_groups
from .cluster_launch import launch
from .errors import KernelError
from .loader import load_module, require_cupy

THREADS = 128
_EXPR = ("act_quant<float>", "act_quant<unsigned short>")  # float16 inputs as their bits


@cache
def _kernels():
    mod = load_module("act_quant", _EXPR)
    return {np.dtype(np.float32): mod.get_function(_EXPR[0]), np.dtype(np.float16): mod.get_function(_EXPR[1])}


def quantize_inputs(x, bits: int, group_size: int, clip: float, kp: int, perm=None, n_side: int = 0,
                    side_bits: int = 8, side_group: int | None = None, side_clip: float = 1.0, stream=None):
    """CuPy (int8 codes [N, kp], float32 scales [N, G], side int8 codes [N, n_side] or None, side float32
    scales [N, Gs] or None) of ``x`` (CuPy float16 or float32 [N, K]); ``perm`` (int32 [K]) gathers the
    channels first (outliers last). ``group_size`` is clamped to K as the formats' rule does."""
    cp = require_cupy()
    if x.ndim != 2 or x.dtype not in (cp.float16, cp.float32):
        raise KernelError(f"x must be a float16 or float32 [N, K] array, got {x.dtype} {x.shape}")
    x = cp.ascontiguousarray(x)
    n, k = x.shape
    if kp < k or (perm is None) != (n_side == 0):
        raise KernelError(f"kp {kp} < K {k}, or a permutation without outliers (or outliers without one)")
    gm = min(int(group_size), k)
    g = n_groups(k, gm)
    gs = int(side_group or min(int(group_size), n_side)) if n_side else 1
    g_side = n_groups(n_side, gs) if n_side else 0
    codes = cp.empty((n, kp), dtype=cp.int8)
    scales = cp.empty((n, g), dtype=cp.float32)
    side_codes = cp.empty((n, n_side), dtype=cp.int8) if n_side else None
    side_scales = cp.empty((n, g_side), dtype=cp.float32) if n_side else None
    if n == 0:
        return codes, scales, side_codes, side_scales
    null = np.uint64(0)  # a null pointer for the arrays a launch without outliers does not have
    p = null if perm is None else cp.ascontiguousarray(perm, dtype=cp.int32)
    args = (x, p, np.int32(k), np.int32(kp), np.int32(n_side), np.int32(gm),
            np.int32(bits), np.float32(clip), np.float32(grid_max(bits)), np.int32(gs), np.int32(side_bits),
            np.float32(side_clip), np.float32(grid_max(side_bits)), np.float32(FP16_TINY), codes, scales,
            null if side_codes is None else side_codes, null if side_scales is None else side_scales)
    launch(_kernels()[np.dtype(x.dtype)], (g + g_side, n), (THREADS,), args, stream=stream)
    return codes, scales, side_codes, side_scales


def quantize_inputs_reference(x: torch.Tensor, bits: int, group_size: int, clip: float, kp: int,
                              perm: torch.Tensor | None = None, n_side: int = 0, side_bits: int = 8,
                              side_group: int | None = None, side_clip: float = 1.0):
    """The kernel's result computed by the formats' own functions (torch, any device)."""
    k = x.shape[1]
    if n_side:
        act = {"bits": bits, "group_size": group_size, "clip": clip, "outlier_bits": side_bits,
               "outlier_group_size": side_group, "outlier_clip": side_clip}
        xq, sx, oq, osx = quantize_inputs_torch(x, perm, n_side, act)
    else:
        (xq, sx), oq, osx = quantize_activations_torch(x, bits, min(group_size, k), clip), None, None
    xq = torch.nn.functional.pad(xq, (0, kp - k))
    return xq, sx.float(), oq, None if osx is None else osx.float()
