"""Weight quantization: symmetric round-to-nearest group quantization to b-bit signed codes.

Codes are int8 in -2^(b-1)..2^(b-1)-1, scales float16 [M, ceil(K/g)] (g = K gives per channel).
A zero weight always maps to code 0, so pruned weights stay pruned. The scale is
absmax / (2^(b-1) - 1/2), the symmetric grid GPTQ uses: all 2^b levels are reachable (for 2 bits
-2, -1, 0, 1), the positive extreme is clipped by half a step at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..bitpack import code_range
from ..errors import FormatError

FP16_TINY = float(np.finfo(np.float16).tiny)


@dataclass
class QuantizedWeight:
    codes: np.ndarray  # int8 [M, K]
    scales: np.ndarray  # float16 [M, G]
    bits: int
    group_size: int

    def dequantize(self) -> np.ndarray:
        """float32 [M, K] = code * scale of its group."""
        return dequantize(self.codes, self.scales, self.group_size)


def n_groups(k: int, group_size: int) -> int:
    return -(-k // group_size)


def grid_max(bits: int) -> float:
    """absmax maps to this many steps: 2^(b-1) - 1/2."""
    return (1 << (bits - 1)) - 0.5


def group_absmax(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """absmax of every group along K: [M, G] (ragged last group allowed)."""
    m, k = w.shape
    g = n_groups(k, group_size)
    if k == g * group_size:  # no ragged group: reduce a view, no padded copy
        return w.reshape(m, g, group_size).abs().amax(dim=2)
    padded = torch.zeros(m, g * group_size, dtype=w.dtype, device=w.device)
    padded[:, :k] = w
    return padded.abs().reshape(m, g, group_size).amax(dim=2)


def scales_from_absmax(absmax: torch.Tensor, bits: int) -> torch.Tensor:
    """fp16-representable positive scales (an all-zero group gets the smallest normal fp16)."""
    s = (absmax.float() / grid_max(bits)).clamp(min=FP16_TINY)
    return s.half().float().clamp(min=FP16_TINY)


def quantize_with_scales(w: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Round-to-nearest codes for given per-group scales [M, G] (int8 tensor)."""
    lo, hi = code_range(bits)
    m, k = w.shape
    g = scales.shape[1]
    if k == g * group_size:  # broadcast the scales over each group: same quotients, one temporary
        q = w.float().reshape(m, g, group_size) / scales.float().reshape(m, g, 1)
        return q.round_().clamp_(lo, hi).to(torch.int8).reshape(m, k)
    s = scales.float().repeat_interleave(group_size, dim=1)[:, : w.shape[1]]
    return torch.clamp(torch.round(w.float() / s), lo, hi).to(torch.int8)


def rtn(weight: torch.Tensor | np.ndarray, bits: int, group_size: int = 128) -> QuantizedWeight:
    """Symmetric round-to-nearest group quantization of a [M, K] weight."""
    w = torch.as_tensor(weight).float()
    if w.ndim != 2:
        raise FormatError(f"weight must be 2-D, got {tuple(w.shape)}")
    group_size = min(group_size, w.shape[1])
    scales = scales_from_absmax(group_absmax(w, group_size), bits)
    codes = quantize_with_scales(w, scales, bits, group_size)
    return QuantizedWeight(codes.cpu().numpy(), scales.half().cpu().numpy(), bits, group_size)


def dequantize(codes: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """float32 weights from codes [M, K] and scales [M, G]."""
    k = codes.shape[1]
    s = np.repeat(scales.astype(np.float32), group_size, axis=1)[:, :k]
    return codes.astype(np.float32) * s
