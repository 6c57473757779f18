"""Activation clip ratio of a layer, chosen by its whole output error on calibration rows."""

from __future__ import annotations

import numpy as np
import torch

from ...formats.arithmetic.activations import fake_quantize_activations

ACT_CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


def calibrate_act_clip(
    x: torch.Tensor | np.ndarray,
    weight: torch.Tensor | np.ndarray,
    w_deq: torch.Tensor | np.ndarray,
    bits: int,
    group_size: int,
    grid: tuple[float, ...] | list[float] = ACT_CLIP_GRID,
) -> tuple[float, dict[float, float]]:
    """The layer's activation clip ratio: argmin over ``grid`` of ||X Wᵀ - Q_c(X) Ŵᵀ||² on calibration rows.

    ``x`` [N, K] are calibration inputs of the layer (a token sample), ``weight`` the full-precision
    (pruned) weight and ``w_deq`` its dequantized codes, so the objective is the layer's whole output error
    with both quantizers on. Returns (best clip, {clip: relative error}); ties go to the larger clip.
    """
    errors, _ = act_clip_errors(x, weight, w_deq, bits, group_size, grid)
    return best_clip(errors), errors


def best_clip(errors: dict[float, float]) -> float:
    """The clip ratio of least error; ties go to the larger clip."""
    return min(errors, key=lambda c: (errors[c], -c))


def act_clip_errors(
    x: torch.Tensor | np.ndarray,
    weight: torch.Tensor | np.ndarray,
    w_deq: torch.Tensor | np.ndarray,
    bits: int,
    group_size: int,
    grid: tuple[float, ...] | list[float] = ACT_CLIP_GRID,
) -> tuple[dict[float, float], float]:
    """({clip: relative output error}, output energy ||X Wᵀ||²) of :func:`calibrate_act_clip`'s objective."""
    xt = torch.as_tensor(x).float()
    ref = xt @ torch.as_tensor(weight).float().to(xt.device).T
    wq = torch.as_tensor(w_deq).float().to(xt.device)
    energy = float((ref * ref).sum())
    denom = energy or 1.0
    errors: dict[float, float] = {}
    for c in sorted({float(c) for c in grid}, reverse=True):
        d = fake_quantize_activations(xt, bits, group_size, c) @ wq.T - ref
        errors[c] = float((d * d).sum()) / denom
    return errors, energy


def shared_act_clip(errors: list[dict[float, float]], energies: list[float]) -> float:
    """One clip ratio for layers that read the same input (their activations are quantized once): the argmin
    of the stacked output's relative error, sum_i err_i(c) * ||X W_iᵀ||² / sum_i ||X W_iᵀ||², from each
    layer's :func:`calibrate_act_clip` errors and output energy; ties go to the larger clip."""
    total = sum(energies) or 1.0
    grid = set.intersection(*(set(e) for e in errors))
    return best_clip({c: sum(e[c] * w for e, w in zip(errors, energies, strict=True)) / total for c in grid})
