"""Atom outlier channels at compress time: which channels, the permuted Hessian, the stored figures
(the side matrix's layout and arithmetic are ``formats.arithmetic.outlier_side``)."""

from __future__ import annotations

import numpy as np
import torch

from ...formats.arithmetic.outlier_side import OutlierSide, with_side_bytes
from ..errors import UserError


def select_outlier_channels(x_sq_norm: np.ndarray | torch.Tensor, n: int) -> np.ndarray:
    """The ``n`` most active input channels (largest ``x_sq_norm``), sorted increasing, int64.

    Ties are broken towards the lower channel index (stable sort), so the choice is deterministic.
    """
    stats = np.asarray(torch.as_tensor(x_sq_norm).float().cpu().numpy(), dtype=np.float64).ravel()
    k = stats.size
    if not 0 <= n < k:
        raise UserError(f"number of outlier channels must be in 0..{k - 1} for K={k}, got {n}")
    order = np.argsort(-stats, kind="stable")[:n]
    return np.sort(order).astype(np.int64)


def permute_hessian(h: torch.Tensor | np.ndarray, perm: np.ndarray) -> torch.Tensor:
    """H of the permuted input ``x[:, perm]``."""
    h = torch.as_tensor(h)
    p = torch.from_numpy(np.asarray(perm, dtype=np.int64)).to(h.device)
    return h[p][:, p]


def check_outlier_count(n: int, in_features: dict[str, int]) -> None:
    """``--keep-outliers n`` must leave at least one normal channel in every layer (UserError otherwise)."""
    if not in_features or n <= 0:
        return
    name, k = min(in_features.items(), key=lambda kv: kv[1])
    if n >= k:
        raise UserError(f"--keep-outliers {n}: layer {name} has only {k} input channels (need N < K)")


def add_side_figures(attrs: dict, side: OutlierSide, value_bits: int) -> None:
    """Fold the side matrix's bytes into a layer's ``stats`` and ``baselines`` (in place).

    Every baseline encoding of the main matrix would carry the same side matrix, so it is added to each;
    dense fp16 already holds every weight and stays the reference.
    """
    attrs["stats"] = with_side_bytes(attrs["stats"], side, value_bits)
    attrs["baselines"] = {k: v if k == "dense-fp16" else with_side_bytes(v, side, value_bits)
                          for k, v in attrs.get("baselines", {}).items()}
