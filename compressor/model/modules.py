"""Swapping one submodule of a model for another (the runtime's, eval's and the benchmarks' linears)."""

from __future__ import annotations

from torch import nn


def replace_linear(model: nn.Module, name: str, module: nn.Module) -> None:
    """Swap the submodule at dotted path ``name`` for ``module``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)
