"""One pruning method by name, for one layer: the dispatch that ``compress`` and ``layerwise.prune_model`` share.

One function per method, as the Wanda reference code (``lib/prune.py``: ``prune_magnitude``, ``prune_wanda``,
``prune_sparsegpt``) has, each here for one layer: ``(weight, sparsity, nm, stats) -> (pruned weight, kept
mask)``. :data:`METHODS` names them with the calibration statistics each needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import UserError
from .methods import magnitude, sparsegpt, wanda
from .nm import parse_nm
from .union import UnionGeometry

NM = tuple[int, int] | None


class InputStats(Protocol):
    """Calibration statistics of one layer's input (``calibrate.statistics.LayerStats``)."""

    x_sq_norm: torch.Tensor | None
    H: torch.Tensor | None


def _statistic(stats: InputStats | None, key: str, method: str) -> torch.Tensor:
    value = None if stats is None else getattr(stats, key)
    if value is None:
        raise UserError(f"--prune {method} needs calibration statistics ({key}); give calibration text (--calib)")
    return value


def prune_magnitude(w: torch.Tensor, sparsity: float, nm: NM = None, stats: InputStats | None = None,
                    union: UnionGeometry = None):
    """Magnitude pruning (no statistics); ``union``: IE-BME (tile, areas) of a union-structured mask."""
    mask = magnitude(w, sparsity, nm=nm, union=union)
    return w * mask, mask


def prune_wanda(w: torch.Tensor, sparsity: float, nm: NM = None, stats: InputStats | None = None,
                union: UnionGeometry = None):
    """Wanda: ``|W|·sqrt(x_sq_norm)`` per output row (or per union position, ``union``)."""
    mask = wanda(w, _statistic(stats, "x_sq_norm", "wanda"), sparsity, nm=nm, union=union)
    return w * mask, mask


def prune_sparsegpt(w: torch.Tensor, sparsity: float, nm: NM = None, stats: InputStats | None = None,
                    blocksize: int = 128, percdamp: float = 0.01, union: UnionGeometry = None):
    """SparseGPT: OBS updates from the layer's H (the kept weights change too)."""
    if union is not None:
        raise UserError("--structure union: use --prune magnitude or wanda (SparseGPT chooses its mask column "
                        "block by column block, inside its updates)")
    return sparsegpt(w, _statistic(stats, "H", "sparsegpt"), sparsity, blocksize, percdamp, nm=nm)


@dataclass(frozen=True)
class Method:
    """A pruning method: its one-layer function, and the calibration statistics kind it needs (None: none;
    ``"wanda"``: x_sq_norm; ``"sparsegpt"``: H; as ``calibrate.statistics`` collects them)."""

    prune: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    statistics: str | None


METHODS: dict[str, Method] = {
    "magnitude": Method(prune_magnitude, None),
    "wanda": Method(prune_wanda, "wanda"),
    "sparsegpt": Method(prune_sparsegpt, "sparsegpt"),
}


def method(name: str) -> Method:
    """The method called ``name``; UserError naming the choices."""
    try:
        return METHODS[name]
    except KeyError:
        raise UserError(f"--prune must be one of {', '.join(METHODS)} or none, got {name!r}") from None


def prune_layer(name: str, w: torch.Tensor, sparsity: float, nm: str | Sequence[int] | None = None,
                stats: InputStats | None = None, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune one layer's weight ``w`` [M, K] with method ``name``; returns ``(pruned weight, kept mask)``.

    ``none``, and a sparsity of 0 without N:M, leave ``w`` as it is (the mask: its nonzeros). ``options``
    go to the method (SparseGPT's ``blocksize``, ``percdamp``; ``union``: a union-structured mask).
    """
    nm_t = parse_nm(nm)
    if name == "none" or (sparsity == 0 and nm_t is None):
        return w, w != 0
    return method(name).prune(w, sparsity, nm_t, stats, **options)
