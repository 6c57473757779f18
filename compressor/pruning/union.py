"""Union-structured masks: sparsity that IE-BME's union bitmap turns into fewer bytes (docs/pruning.md, "Union").

IE-BME cuts a layer into local tiles of H_L x K_L and each tile into R_A x C_A areas of h x w; a position of the
h x w union mask is stored (with the codes of all R_A * C_A areas) when ANY area holds a nonzero there. With an
unstructured 50% mask almost every position is active in one of the 4 areas (1 - 0.5^4 = 94%), so the layer stores
about as many codes as a dense one and reads as many bytes (measured: 3.41 GB against 3.57 at 0%, LLaMA-2-7B).
A union-structured mask prunes the Q = R_A * C_A weights of one union position together: for the rows
{i, i + h, ..., i + (R_A - 1) h} of each row block of H_L, it keeps the union positions (i, j) of every tile whose
summed metric is highest, the same number in every row set, so every row loses exactly ``int(K * sparsity)``
weights rounded down to a multiple of C_A (when K is a multiple of K_L) and the layer stores about ``1 - sparsity``
of the positions.
"""

from __future__ import annotations

import torch

from ..errors import UserError

# IE-BME (tile, areas) or (tile, areas, union density) a union-structured mask follows; None: unstructured
UnionGeometry = tuple[tuple[int, int], tuple[int, int]] | tuple[tuple[int, int], tuple[int, int], float | None] | None


def union_mask(metric: torch.Tensor, sparsity: float, tile: tuple[int, int], areas: tuple[int, int],
               density: float | None = None) -> torch.Tensor:
    """Bool mask [M, K] (True = kept) of ``metric`` [M, K] that prunes whole IE-BME union positions: per row set,
    the ``int(K * sparsity) // C_A`` groups (union positions) of lowest summed metric (stable: among equal sums the
    lower tile column, then the lower j, goes first). Rows past the last whole tile add nothing to a group's sum;
    columns past K make it infinite (never pruned: the budget goes to weights that exist).

    ``density`` (above 1 - sparsity; ``--union-density``) relaxes the structure: the union keeps that fraction of
    the positions (by summed metric), and each row then keeps its ``K - int(K * sparsity)`` highest weights among
    them (stable: among equal metrics the lower column)."""
    (hl, kl), (ra, ca) = tile, areas
    if hl % ra or kl % ca:
        raise UserError(f"--structure union: areas {ra}x{ca} do not divide the tile {hl}x{kl}")
    h, w = hl // ra, kl // ca
    m, k = metric.shape
    mp, kp = -(-m // hl) * hl, -(-k // kl) * kl
    padded = torch.zeros((mp, kp), dtype=torch.float32, device=metric.device)
    padded[:m, :k] = metric.float()
    padded[:, k:] = float("inf")
    # [row blocks, ra, h, tile columns, ca, w] -> summed over the areas: [row blocks, h, tile columns, w]
    blocks = padded.reshape(mp // hl, ra, h, kp // kl, ca, w)
    groups = blocks.sum(dim=(1, 4)).reshape(mp // hl * h, (kp // kl) * w)  # one row per row set
    k_prune = int(k * sparsity) // ca  # groups per row set: ca of a row's weights each
    if density is not None:
        k_prune = min(k_prune, int(k * (1 - density)) // ca)
    keep = torch.ones_like(groups, dtype=torch.bool)
    if k_prune:
        idx = torch.sort(groups, dim=1, stable=True)[1][:, :k_prune]
        keep.scatter_(1, idx, False)
    keep = keep.reshape(mp // hl, 1, h, kp // kl, 1, w).expand(mp // hl, ra, h, kp // kl, ca, w)
    allowed = keep.reshape(mp, kp)[:m, :k].contiguous()
    if density is None:
        return allowed
    # each row: its highest metrics among the allowed positions, K - int(K s) of them
    kept = k - int(k * sparsity)
    score = torch.where(allowed, metric.float(), torch.full_like(metric, -1.0, dtype=torch.float32))
    idx = torch.sort(score, dim=1, descending=True, stable=True)[1][:, :kept]
    top = torch.zeros_like(allowed).scatter_(1, idx, True)
    return top & allowed
