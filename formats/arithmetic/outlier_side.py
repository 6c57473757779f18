"""Atom-style outlier channels: the most active input channels kept at 8 bits, the rest at 4.

Calibration ranks input channels by activity (``x_sq_norm``, the mean squared L2 norm of each channel
over tokens, which the Wanda statistics already hold) and keeps the ``n`` largest at 8 bits.

Layout (one layer, weight W [M, K], outlier channels C, |C| = n):

* column permutation ``perm`` [K]: the K - n normal channels in increasing order, then the channels of
  C in increasing order; the kernel input is ``x[:, perm]`` (Atom fuses this reorder into the op that
  produces x).
* main matrix ``W[:, perm]`` with its last n columns zeroed: M x K, quantized as usual (b-bit codes,
  group scales along the permuted K). The zero columns cost no payload in IE-BME (no union bits).
* side matrix: ``W[:, C]`` as dense int8 codes [M, n] with one fp16 scale per row (W8, per channel over
  those columns, scale = absmax / 127.5, the same grid rule as every other quantizer here).
* activations: the normal channels (permuted, outlier positions set to 0) are quantized per token and
  per group like any input; the outlier block ``x[:, C]`` gets its own per-token 8-bit scales, one per
  ``min(group_size, n)`` channels.

In the artifact (``docs/format.md``) a layer with outliers stores the main matrix in the permuted
column order, plus ``outlier_codes`` int8 [M, n], ``outlier_scales`` float16 [M, 1] and
``outlier_channels`` int32 [n]; ``perm`` is rebuilt from the channels. The side matrix costs
``M*n + 2*M + 4*n`` bytes (:func:`side_bytes`), which ``inspect`` counts in the layer's totals.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import FormatError
from .activations import quantize_activations_torch
from .weights import rtn

OUTLIER_BITS = 8


def column_permutation(k: int, channels: np.ndarray) -> np.ndarray:
    """``perm`` [K] int32: normal channels in order, then the outlier channels in order."""
    channels = np.asarray(channels, dtype=np.int64)
    is_out = np.zeros(k, dtype=bool)
    is_out[channels] = True
    return np.concatenate([np.flatnonzero(~is_out), np.sort(channels)]).astype(np.int32)


@dataclass
class OutlierSide:
    channels: np.ndarray  # int64 [n], sorted: the original input channels kept at 8 bits
    perm: np.ndarray  # int32 [K]
    codes: np.ndarray  # int8 [M, n]
    scales: np.ndarray  # float16 [M, 1]
    bits: int = OUTLIER_BITS

    def dequantize(self) -> np.ndarray:
        return self.codes.astype(np.float32) * self.scales.astype(np.float32)


def split_outliers(
    weight: np.ndarray | torch.Tensor, channels: np.ndarray
) -> tuple[torch.Tensor, OutlierSide]:
    """(main matrix W[:, perm] with the last n columns zeroed [M, K], the quantized side matrix)."""
    w = torch.as_tensor(weight).float()
    m, k = w.shape
    channels = np.sort(np.asarray(channels, dtype=np.int64))
    perm = column_permutation(k, channels)
    n = channels.size
    main = w[:, torch.from_numpy(perm.astype(np.int64)).to(w.device)].clone()
    if n:
        main[:, k - n :] = 0.0
    side_w = w[:, torch.from_numpy(channels).to(w.device)] if n else torch.zeros(m, 0)
    q = rtn(side_w, OUTLIER_BITS, max(n, 1)) if n else None
    codes = q.codes if q is not None else np.zeros((m, 0), np.int8)
    scales = q.scales if q is not None else np.ones((m, 1), np.float16)
    return main, OutlierSide(channels, perm, codes, scales)


def side_bytes(m: int, k: int, n: int) -> dict[str, int]:
    """Bytes the outlier side of one layer adds to the artifact (codes, scales, channel indices)."""
    del k  # the permutation is rebuilt from the channel indices, not stored
    return {"outlier_codes": m * n, "outlier_scales": 2 * m if n else 0, "outlier_channels": 4 * n}


def quantize_inputs_torch(
    x: torch.Tensor, perm: torch.Tensor, n: int, act: dict
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel inputs of a layer with ``n`` outlier channels, from float input ``x`` [N, K] (original order).

    Returns (main codes [N, K] int8, main scales [N, G] fp16, side codes [N, n] int8, side scales
    [N, Gs] fp16): the main input is ``x[:, perm]`` with its last ``n`` columns zeroed, quantized by the
    record ``act`` (bits, group size, clip); the side input is the outlier block ``x[:, perm[K-n:]]``
    quantized per token at ``outlier_bits`` in groups of ``outlier_group_size`` with ``outlier_clip``.
    """
    x = x.float()
    k = x.shape[1]
    xp = x[:, perm]
    main = xp.clone()
    main[:, k - n :] = 0.0
    xq, sx = quantize_activations_torch(main, int(act["bits"]), min(int(act["group_size"]), k),
                                        float(act.get("clip", 1.0)))
    og = int(act.get("outlier_group_size") or min(int(act["group_size"]), n))
    oq, osx = quantize_activations_torch(xp[:, k - n :], int(act.get("outlier_bits", OUTLIER_BITS)), og,
                                         float(act.get("outlier_clip", 1.0)))
    return xq, sx, oq, osx


def quantize_inputs(x: np.ndarray, side: OutlierSide, act: dict) -> tuple[np.ndarray, ...]:
    """numpy version of :func:`quantize_inputs_torch` (what ``verify`` feeds the kernels)."""
    p = torch.from_numpy(side.perm.astype(np.int64))
    out = quantize_inputs_torch(torch.from_numpy(np.asarray(x, np.float32)), p, side.channels.size, act)
    return tuple(t.numpy() for t in out)


def side_arrays(side: OutlierSide) -> dict[str, np.ndarray]:
    """The arrays a layer with outliers stores next to its main encoding."""
    return {"outlier_codes": np.ascontiguousarray(side.codes, dtype=np.int8),
            "outlier_scales": np.ascontiguousarray(side.scales, dtype=np.float16),
            "outlier_channels": np.ascontiguousarray(side.channels, dtype=np.int32)}


def side_from_arrays(name: str, shape: tuple[int, int], codes: np.ndarray, scales: np.ndarray,
                     channels: np.ndarray, recorded: list | None) -> OutlierSide:
    """Rebuild and structurally check a stored side matrix; FormatError names what is wrong."""
    m, k = shape
    if channels.dtype != np.int32 or channels.ndim != 1:
        raise FormatError(f"layer {name}: outlier_channels must be int32 [n], got {channels.dtype} {channels.shape}")
    n = channels.size
    if not 0 < n < k:
        raise FormatError(f"layer {name}: {n} outlier channels for K={k} (need 1..{k - 1})")
    if channels.min() < 0 or channels.max() >= k or (np.diff(channels.astype(np.int64)) <= 0).any():
        raise FormatError(f"layer {name}: outlier_channels must be strictly increasing in 0..{k - 1}")
    if not isinstance(recorded, list) or [int(c) for c in recorded] != channels.tolist():
        raise FormatError(f"layer {name}: outlier_channels differ from the activation record's")
    if codes.dtype != np.int8 or codes.shape != (m, n):
        raise FormatError(f"layer {name}: outlier_codes must be int8 {(m, n)}, got {codes.dtype} {codes.shape}")
    if scales.dtype != np.float16 or scales.shape != (m, 1):
        raise FormatError(f"layer {name}: outlier_scales must be float16 {(m, 1)}, got {scales.dtype} {scales.shape}")
    ch = channels.astype(np.int64)
    return OutlierSide(ch, column_permutation(k, ch), codes, scales)


def with_side_bytes(fig: dict, side: OutlierSide, value_bits: int) -> dict:
    """Storage figures (``formats.stats`` keys) of a layer's main encoding plus its outlier side.

    Codes count as payload, their scales as scale bytes, the channel indices as metadata; ``nnz`` adds the
    side's nonzero codes (8-bit values in PMR); ratios are recomputed from the new sums.
    """
    m, k = fig["shape"]
    b = side_bytes(m, k, side.channels.size)
    out = dict(fig)
    nnz_side = int(np.count_nonzero(side.codes))
    out["nnz"] = fig["nnz"] + nnz_side
    out["payload_bytes"] = fig["payload_bytes"] + b["outlier_codes"]
    out["scale_bytes"] = fig["scale_bytes"] + b["outlier_scales"]
    out["meta_bytes"] = fig["meta_bytes"] + b["outlier_channels"]
    out["total_bytes"] = out["payload_bytes"] + out["meta_bytes"] + out["scale_bytes"]
    out["sparsity"] = 1.0 - out["nnz"] / (m * k)
    out["bits_per_weight"] = out["total_bytes"] * 8 / (m * k)
    out["cr"] = 2 * m * k / out["total_bytes"]
    out["pmr"] = (value_bits / 8 * fig["nnz"] + nnz_side) / out["meta_bytes"]
    out["outliers"] = int(side.channels.size)
    out["outlier_bytes"] = sum(b.values())
    return out


def dequantize_layer(main_deq: np.ndarray, side: OutlierSide) -> np.ndarray:
    """float32 [M, K] weight in the original column order from the permuted main part and the side."""
    m, k = main_deq.shape
    out = np.zeros((m, k), np.float32)
    n = side.channels.size
    out[:, side.perm[: k - n]] = main_deq[:, : k - n]
    out[:, side.channels] = side.dequantize()
    return out
