"""Build a runnable transformers model from an artifact: dense parts from ``dense/``, every stored layer a
:class:`~.linear.CompressedLinear` on the stored arrays; with ``fuse``, the stored linears that read the same input
(Q/K/V, gate/up) one :class:`~.linear.CompressedLinear` on their stacked arrays (:mod:`.fused`)."""

from __future__ import annotations

import torch
from torch import nn

from ...formats.errors import FormatError
from ..artifact.store import Artifact
from ..errors import UserError
from ..model.modules import replace_linear
from ..model.rebuild import dense_state, empty_model, missing_tensors
from .fused import SharedInputLinear, plan_group, shared_input_groups
from .linear import CompressedLinear
from .plan import BACKENDS


def build_model(art: Artifact, backend: str = "cpu", device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None, dynamic_pruning: bool = True, fuse: bool = False) -> nn.Module:
    """The artifact's model in eval mode on ``device``; dense parts in ``dtype`` (float32 on the CPU, float16
    on a GPU by default), compressed linears on ``backend``.

    ``fuse``: the stored linears of a block that read the same input and share their stored options run as one
    stacked op (docs/runtime.md, "Fused linears"). ``model.unionsparse_fusion`` records what was done:
    ``enabled``, ``layers`` (stored layers), ``ops`` (compressed ops in the model), ``fused`` (per stacked op: its
    ``name``, its ``layers`` and their ``row_offsets``) and ``separate`` (per linear of a shared-input group left
    alone: ``layer``, ``stored``, ``reason``)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    if backend not in BACKENDS:
        raise UserError(f"backend must be one of {BACKENDS}, got {backend!r}")
    device = torch.device(device)
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.float16)
    with no_init_weights():  # every weight comes from the artifact; built in its dtype (RoPE buffers stay fp32)
        model = empty_model(art, dtype)
    model.tie_weights()  # skipped with the initialisation: lm_head shares the embeddings where the config says so
    layers = art.layer_names
    state = dense_state(art)
    biases = {name: state.pop(f"{name}.bias", None) for name in layers}
    for name in layers:  # placeholders until the dense parts are loaded and moved
        replace_linear(model, name, nn.Identity())
    missing = missing_tensors(model, state)
    if missing:
        raise FormatError(f"{art.path}: the artifact lacks tensors of the model: {missing[:5]}")
    model.load_state_dict(state, strict=False)  # copied into the parameters' dtype
    model.to(device=device)
    fusion: dict = {"enabled": bool(fuse), "layers": len(layers), "ops": 0, "fused": [], "separate": []}
    done: set[str] = set()
    for group in shared_input_groups(layers) if fuse else []:
        records = [art.read_layer(name) for name in group.members]
        plan = plan_group(group, records, ignore_thresholds=not dynamic_pruning)
        for rec, members in plan.stacked:
            op = CompressedLinear(rec, None, backend, dynamic_pruning, device)
            names = [m.name for m in members]
            shared = SharedInputLinear(op, names, rec.attrs["fused"]["row_offsets"], rec.attrs["fused"]["rows"],
                                       [None if biases[n] is None else biases[n].to(device) for n in names])
            replace_linear(model, rec.name, shared)  # registered once, beside the members
            for name, member in zip(names, shared.members(), strict=True):
                replace_linear(model, name, member)
            done.update(names)
            fusion["fused"].append({"name": rec.name, "layers": names, "row_offsets": list(shared.offsets)})
        separate = {r.name: r for r in records if r.name not in done}
        for name, rec in separate.items():
            replace_linear(model, name, CompressedLinear(rec, biases[name], backend, dynamic_pruning, device))
            done.add(name)
        fusion["separate"] += plan.separate
    for name in layers:
        if name not in done:
            lin = CompressedLinear(art.read_layer(name), biases[name], backend, dynamic_pruning, device)
            replace_linear(model, name, lin)
    fusion["ops"] = sum(isinstance(m, CompressedLinear) for m in model.modules())
    model.unionsparse_fusion = fusion
    return model.eval()


def thresholds_on_every_row(model: nn.Module) -> nn.Module:
    """Apply every stored activation-sparsity threshold to every token row, not only at decode steps: what
    ``eval`` measures (TEAL's protocol, each row as one decode step). Returns ``model``."""
    from dataclasses import replace

    for m in model.modules():
        if isinstance(m, CompressedLinear) and m.plan.tau is not None:
            m.plan = m.op.plan = replace(m.plan, every_row=True)
    return model
