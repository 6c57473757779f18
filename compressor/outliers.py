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

The side matrix costs ``M*n + 2*M`` bytes plus ``4*K`` for ``perm`` (:func:`side_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .quant import rtn

OUTLIER_BITS = 8


def select_outlier_channels(x_sq_norm: np.ndarray | torch.Tensor, n: int) -> np.ndarray:
    """The ``n`` most active input channels (largest ``x_sq_norm``), sorted increasing, int64.

    Ties are broken towards the lower channel index (stable sort), so the choice is deterministic.
    """
    stats = np.asarray(torch.as_tensor(x_sq_norm).float().cpu().numpy(), dtype=np.float64).ravel()
    k = stats.size
    if not 0 <= n < k:
        raise ValueError(f"number of outlier channels must be in 0..{k - 1} for K={k}, got {n}")
    order = np.argsort(-stats, kind="stable")[:n]
    return np.sort(order).astype(np.int64)


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


def permute_hessian(h: torch.Tensor | np.ndarray, perm: np.ndarray) -> torch.Tensor:
    """H of the permuted input ``x[:, perm]``."""
    h = torch.as_tensor(h)
    p = torch.from_numpy(np.asarray(perm, dtype=np.int64)).to(h.device)
    return h[p][:, p]


def side_bytes(m: int, k: int, n: int) -> dict[str, int]:
    """Bytes the outlier side of one layer adds to the artifact."""
    return {"outlier_codes": m * n, "outlier_scales": 2 * m if n else 0, "outlier_perm": 4 * k if n else 0}
