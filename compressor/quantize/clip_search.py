"""Per-group clip ratios for weight quantization, chosen by output error on calibration inputs.

For weight row m and input-channel group j, clip ratio c gives scale fp16(c * absmax / (2^(b-1) - 1/2))
and error e(c) = w - Q_c(w) on the group's columns. The output error of the layer on calibration inputs
X is ||(W - Q(W)) X^T||^2 = sum_m e_m^T H e_m with H = X^T X (any positive multiple works, e.g.
SparseGPT's 2/n X^T X). We keep only H's diagonal blocks H_jj, so that every (row, group) is scored on
its own, e_mj^T H_jj e_mj, and choose its clip independently: the exact objective couples groups through
the off-diagonal blocks, which a per-group search cannot see. ``H=None`` scores plain weight MSE.

The search uses the fp16-rounded scales that will be stored, so the scored error is the final one.
"""

from __future__ import annotations

import numpy as np
import torch

from ...formats.arithmetic.weights import group_absmax, n_groups, scales_from_absmax
from ...formats.bitpack import code_range
from ..errors import UserError

DEFAULT_GRID = np.linspace(1.0, 0.5, 11)


def gram(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    """X^T X of calibration inputs [N, K] (float32 [K, K])."""
    x = torch.as_tensor(x).float()
    return x.T @ x


def diagonal_blocks(h: torch.Tensor, group_size: int) -> torch.Tensor:
    """H's diagonal blocks [G, g, g], the ragged last one zero padded."""
    k = h.shape[0]
    g = n_groups(k, group_size)
    blocks = torch.zeros(g, group_size, group_size, dtype=torch.float32, device=h.device)
    for j in range(g):
        a, b = j * group_size, min((j + 1) * group_size, k)
        blocks[j, : b - a, : b - a] = h[a:b, a:b]
    return blocks


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    m, k = w.shape
    g = n_groups(k, group_size)
    padded = torch.zeros(m, g * group_size, dtype=torch.float32, device=w.device)
    padded[:, :k] = w
    return padded.reshape(m, g, group_size)


def group_errors(
    w: torch.Tensor, absmax: torch.Tensor, clip: torch.Tensor | float, bits: int, group_size: int,
    blocks: torch.Tensor | None,
) -> torch.Tensor:
    """Score [M, G] of every (row, group) for clip ratios ``clip`` (scalar or [M, G])."""
    lo, hi = code_range(bits)
    wg = _grouped(w, group_size)
    s = scales_from_absmax(absmax * clip, bits).unsqueeze(2)
    e = wg - torch.clamp(torch.round(wg / s), lo, hi) * s
    if blocks is None:
        return (e * e).sum(dim=2)
    return torch.einsum("mgi,gij,mgj->mg", e, blocks, e)


def search_clip(
    weight: torch.Tensor | np.ndarray,
    h: torch.Tensor | np.ndarray | None,
    bits: int,
    group_size: int = 128,
    grid: np.ndarray | list[float] = DEFAULT_GRID,
) -> np.ndarray:
    """Clip ratio per (row, group) [M, G] minimising e^T H_jj e over ``grid`` (ties: the larger clip).

    ``h`` is [K, K] (a Gram matrix of calibration inputs; use :func:`gram` on raw X) or None for weight MSE.
    """
    w = torch.as_tensor(weight).float()
    if w.ndim != 2:
        raise UserError(f"weight must be 2-D, got {tuple(w.shape)}")
    k = w.shape[1]
    group_size = min(group_size, k)
    grid = sorted({float(c) for c in grid}, reverse=True)
    if not grid or grid[0] > 1.0 or grid[-1] <= 0.0:
        raise UserError(f"clip grid must lie in (0, 1], got {grid}")
    blocks = None
    if h is not None:
        h = torch.as_tensor(h).float().to(w.device)
        if h.shape != (k, k):
            raise UserError(f"H must be [{k}, {k}] for a weight with K={k}, got {tuple(h.shape)}")
        blocks = diagonal_blocks(h, group_size)
    absmax = group_absmax(w, group_size)
    best = torch.full_like(absmax, float("inf"))
    best_clip = torch.ones_like(absmax)
    for c in grid:
        err = group_errors(w, absmax, c, bits, group_size, blocks)
        better = err < best
        best = torch.where(better, err, best)
        best_clip = torch.where(better, torch.full_like(best_clip, c), best_clip)
    return best_clip.cpu().numpy().astype(np.float32)


def clipped_scales(
    weight: torch.Tensor, clip: np.ndarray | torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """fp16-representable scales [M, G] = fp16(clip * absmax / (2^(b-1) - 1/2))."""
    w = torch.as_tensor(weight).float()
    group_size = min(group_size, w.shape[1])
    return scales_from_absmax(group_absmax(w, group_size) * torch.as_tensor(clip).float().to(w.device), bits)

