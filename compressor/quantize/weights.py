"""Weight quantization entry point: round-to-nearest, GPTQ, clip search (the rule itself is
``formats.arithmetic.weights``)."""

from __future__ import annotations

import numpy as np
import torch

from ...formats.arithmetic.weights import QuantizedWeight, quantize_with_scales, rtn
from ..errors import UserError
from .clip_search import DEFAULT_GRID, clipped_scales, search_clip
from .gptq import gptq as run_gptq


def quantize_weight(
    weight: torch.Tensor | np.ndarray,
    bits: int,
    group_size: int = 128,
    *,
    gptq: bool = False,
    clip_search: bool = False,
    h: torch.Tensor | np.ndarray | None = None,
    mask: torch.Tensor | np.ndarray | None = None,
    clip_grid: np.ndarray | list[float] | None = None,
    act_order: bool = False,
    percdamp: float = 0.01,
) -> QuantizedWeight:
    """One entry point for weight quantization: round-to-nearest or GPTQ, with or without clip search.

    ``h`` [K, K] is the calibration Gram matrix (2/n Σ x xᵀ); GPTQ needs it, clip search scores output
    error with it (weight MSE when None). ``mask`` (True = kept) forces pruned weights to code 0.
    """
    grid = DEFAULT_GRID if clip_grid is None else clip_grid
    w = torch.as_tensor(weight).float()
    if mask is not None:
        mask = torch.as_tensor(mask).bool().to(w.device)
        w = w * mask
    if gptq:
        if h is None:
            raise UserError("GPTQ needs the calibration Hessian h")
        return run_gptq(w, h, bits, group_size, mask=mask, percdamp=percdamp, act_order=act_order,
                        clip_search=clip_search, clip_grid=grid)
    if not clip_search:
        return rtn(w, bits, group_size)
    group_size = min(group_size, w.shape[1])
    scales = clipped_scales(w, search_clip(w, h, bits, group_size, grid), bits, group_size)
    codes = quantize_with_scales(w, scales, bits, group_size)
    return QuantizedWeight(codes.cpu().numpy(), scales.half().cpu().numpy(), bits, group_size)
