"""Build a runnable transformers model from an artifact: dense parts from ``dense/``, every stored layer a
:class:`~.linear.CompressedLinear` on the stored arrays."""

from __future__ import annotations

import torch
from torch import nn

from ...formats.errors import FormatError
from ..artifact.store import Artifact
from ..model.rebuild import dense_state, empty_model, missing_tensors
from ..quantize.fake_quant import replace_linear
from .linear import BACKENDS, CompressedLinear


def build_model(art: Artifact, backend: str = "cpu", device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None, dynamic_pruning: bool = True) -> nn.Module:
    """The artifact's model in eval mode on ``device``; dense parts in ``dtype`` (float32 on the CPU, float16
    on a GPU by default), compressed linears on ``backend``."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
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
    for name in layers:
        lin = CompressedLinear(art.read_layer(name), biases[name], backend, dynamic_pruning, device)
        replace_linear(model, name, lin)
    return model.eval()
