"""Which sibling linears of a LLaMA-style block read the same input tensor: ``self_attn.{q,k,v}_proj`` (after the
input norm) and ``mlp.{gate,up}_proj`` (after the post-attention norm). The runtime runs each such set as one
stacked product (docs/runtime.md, "Fused linears"); compress gives each set one activation clip so that one
quantized input serves it (docs/quantization.md)."""

from __future__ import annotations

from collections.abc import Iterable

# (parent module's last name component, the sibling linears that read its one input, in stacking order)
SHARED_INPUTS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def shared_input_sets(names: Iterable[str]) -> list[tuple[str, ...]]:
    """The sets of two or more of ``names`` (module paths) that read one input, each in stacking order, in order
    of first appearance."""
    names = list(names)
    present = set(names)
    sets: dict[str, tuple[str, ...]] = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        for part, siblings in SHARED_INPUTS:
            if child in siblings and (parent == part or parent.endswith(f".{part}")) and parent not in sets:
                sets[parent] = tuple(p for p in (f"{parent}.{s}" for s in siblings) if p in present)
    return [s for s in sets.values() if len(s) > 1]
