"""Activation quantization for W4A4 / W2A4: per-token, per-group, symmetric, dynamic.

This is the one definition of how a kernel input is quantized; the kernels' CPU references, the
fake-quant model and ``verify`` all call :func:`quantize_activations`, so they agree bit for bit.

The exact rule, for a token row ``x`` (float32) and group ``j`` of ``group_size`` consecutive input
channels (the last group may be shorter):

* ``absmax = max |x[k]|`` over the group (float32),
* ``scale = fp16(clip * absmax / (2^(b-1) - 1/2))``, computed in float32 then rounded to the nearest
  float16; a group whose scale would be below the smallest normal float16 gets that value instead
  (its codes are then all zero or tiny),
* ``code = clamp(rint(x[k] / scale), -2^(b-1), 2^(b-1) - 1)`` with an IEEE float32 division and
  round-half-to-even (CUDA ``__float2int_rn(__fdiv_rn(x, s))``).

It is the weight quantizer's grid (:mod:`.weights`): absmax lands on 2^(b-1) - 1/2 steps, so all
2^b levels are used and the positive extreme is clipped by half a step at most. Scales are float16
so the kernel can read them as ``half``; products of scales are taken in float32.
"""

from __future__ import annotations

import numpy as np
import torch

from ..bitpack import code_range
from ..errors import FormatError
from .weights import FP16_TINY, grid_max, n_groups

SCHEME = "per-token-symmetric"


def _group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, G, group_size], zero padded on the right."""
    n, k = x.shape
    g = n_groups(k, group_size)
    if g * group_size != k:
        x = torch.nn.functional.pad(x, (0, g * group_size - k))
    return x.reshape(n, g, group_size)


def activation_scales(x: torch.Tensor, bits: int, group_size: int, clip: float = 1.0) -> torch.Tensor:
    """float16 scales [N, G] of the rule above (x float32 [N, K])."""
    absmax = _group_view(x, group_size).abs().amax(dim=2)
    s = (absmax * np.float32(clip)) / np.float32(grid_max(bits))
    return s.clamp(min=FP16_TINY).half().clamp(min=FP16_TINY)


def quantize_activations_torch(
    x: torch.Tensor, bits: int, group_size: int, clip: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch version of :func:`quantize_activations`: (int8 codes [N, K], float16 scales [N, G])."""
    if x.ndim != 2:
        raise FormatError(f"activations must be 2-D [tokens, channels], got {tuple(x.shape)}")
    if not 0.0 < clip <= 1.0:
        raise FormatError(f"clip ratio must be in (0, 1], got {clip}")
    x = x.float()
    k = x.shape[1]
    group_size = min(group_size, k)
    scales = activation_scales(x, bits, group_size, clip)
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    lo, hi = code_range(bits)
    codes = torch.clamp(torch.round(x / s), lo, hi).to(torch.int8)
    return codes, scales


def quantize_activations(
    x: np.ndarray | torch.Tensor, bits: int, group_size: int, clip: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize activations ``x`` [N, K] per token and per group of ``group_size`` channels.

    Returns int8 codes [N, K] in -2^(b-1)..2^(b-1)-1 and float16 scales [N, ceil(K/group_size)].
    ``group_size >= K`` means one scale per token.
    """
    codes, scales = quantize_activations_torch(torch.as_tensor(np.asarray(x, dtype=np.float32)), bits,
                                               group_size, clip)
    return codes.numpy(), scales.numpy()


def dequantize_activations(codes: np.ndarray, scales: np.ndarray, group_size: int) -> np.ndarray:
    """float32 [N, K] = code * scale of its group."""
    k = codes.shape[1]
    group_size = min(group_size, k)
    s = np.repeat(scales.astype(np.float32), group_size, axis=1)[:, :k]
    return codes.astype(np.float32) * s


def fake_quantize_activations(x: torch.Tensor, bits: int, group_size: int, clip: float = 1.0) -> torch.Tensor:
    """Quantize-dequantize (float32), for calibration objectives."""
    codes, scales = quantize_activations_torch(x, bits, group_size, clip)
    k = x.shape[1]
    g = min(group_size, k)
    return codes.float() * scales.float().repeat_interleave(g, dim=1)[:, :k]


def activation_scheme(
    bits: int,
    group_size: int,
    clip: float = 1.0,
    outlier_channels: list[int] | None = None,
    outlier_bits: int = 8,
) -> dict:
    """The record stored in a layer's attrs so kernels and ``verify`` quantize inputs identically.

    ``bits`` 16 means fp16 activations (W4A16): no activation quantization at all.
    """
    if bits == 16:
        return {"bits": 16, "scheme": "fp16"}
    code_range(bits)
    rec = {
        "bits": int(bits),
        "group_size": int(group_size),
        "scheme": SCHEME,
        "clip": float(clip),
        "scale_rule": "fp16(clip*absmax/(2^(b-1)-0.5)), min fp16 tiny; code=clamp(rint(x/scale))",
        "outlier_channels": None if outlier_channels is None else [int(c) for c in outlier_channels],
        "outlier_bits": int(outlier_bits),
    }
    if outlier_channels:  # Atom: main input x[:, perm] with the outlier block zeroed; the block at 8 bits
        rec["outlier_group_size"] = min(int(group_size), len(outlier_channels))
        rec["outlier_clip"] = 1.0
        rec["column_order"] = "normal channels ascending, then outlier channels ascending"
    return rec
