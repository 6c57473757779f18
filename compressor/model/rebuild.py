"""Rebuild a runnable causal LM from an artifact (for ``unionsparse eval``).

Every compressed layer is decoded from its stored encoding. Quantized layers become
``FakeQuantLinear`` modules computing the kernels' arithmetic (activations quantized per token when
the layer records ``activations``, e.g. W4A4), or plain linears holding ``code · scale`` with
``act_quant=False``; fp16 Tiled-CBC layers hold their fp16 values. Layers with outlier channels
(``--keep-outliers``) compute main + 8-bit side product; their plain weight is put back in the original
column order. Every other tensor comes from
``dense/``. Used only when ``compressor.artifact`` has no ``rebuild_model`` of its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...formats import registry
from ...formats.arithmetic.outlier_side import dequantize_layer
from ...formats.arithmetic.weights import dequantize
from ...formats.errors import FormatError
from ..artifact.store import Artifact
from ..errors import UserError


def _config(art: Artifact):
    from transformers import AutoConfig

    mc = dict(art.attrs.get("model_config") or {})
    model_type = mc.pop("model_type", None)
    if not model_type:
        raise UserError(f"{art.path}: the artifact does not record the model config (model_config)")
    # the source's quantization_config (e.g. GGUF's) describes its checkpoint, not the decoded weights here
    for k in ("architectures", "transformers_version", "_name_or_path", "quantization_config"):
        mc.pop(k, None)
    return AutoConfig.for_model(model_type, **mc)


def rebuild_model(path: str | Path, act_quant: bool = True, dtype: torch.dtype = torch.float32,
                  dynamic_pruning: bool = True) -> nn.Module:
    """The model stored in artifact ``path``, on CPU, in eval mode.

    With ``act_quant``, Tiled-CBC layers with fp16 activations become :class:`~.dp_linear.TiledCBCLinear`
    (the decode kernel's arithmetic), with their stored ``dp_threshold`` when ``dynamic_pruning``.
    """
    from transformers import AutoModelForCausalLM

    from ..activation_sparsity.linear import TiledCBCLinear
    from ..quantize.fake_quant import FakeQuantLinear, replace_linear

    art = Artifact(path)
    model = AutoModelForCausalLM.from_config(_config(art), dtype=dtype).eval()
    state: dict[str, torch.Tensor] = {}
    for name in art.dense_names:
        state[name] = torch.from_numpy(np.asarray(art.read_dense(name), dtype=np.float32))
    for alias, src in (art.attrs.get("tied") or {}).items():
        if src in state:
            state[alias] = state[src]
    quantized: dict[str, tuple] = {}
    cbc_taus: dict[str, float | None] = {}  # fp16-activation Tiled-CBC layers and their thresholds
    for layer in art.layer_names:
        rec = art.read_layer(layer)
        if registry.get(rec.format).activation_sparsity and not rec.attrs.get("activations"):
            cbc_taus[layer] = rec.attrs.get("dp_threshold") if dynamic_pruning else None
        values = rec.encoding.decode()
        bits = rec.attrs.get("bits")
        if bits is None:
            w = np.asarray(values, dtype=np.float32)
        else:
            gs = int(rec.attrs["group_size"])
            w = dequantize(np.asarray(values, dtype=np.int8), rec.scales, gs)
            if rec.outliers is not None:  # main matrix column-permuted + 8-bit side: back to original order
                w = dequantize_layer(w, rec.outliers)
            quantized[layer] = (values, rec.scales, int(bits), gs, rec.attrs.get("activations"), rec.outliers)
        state[f"{layer}.weight"] = torch.from_numpy(np.ascontiguousarray(w))
    own = model.state_dict()
    missing = [k for k in own if k not in state and own[k].is_floating_point()]
    if missing:
        raise FormatError(f"{path}: the artifact lacks tensors of the model: {missing[:5]}")
    model.load_state_dict(state, strict=False)
    if act_quant:
        for layer, (codes, scales, bits, gs, act, side) in quantized.items():
            if not act:
                continue
            lin = model.get_submodule(layer)
            bias = lin.bias.detach() if getattr(lin, "bias", None) is not None else None
            replace_linear(model, layer, FakeQuantLinear(codes, scales, bits, gs, act, bias, side))
        for layer, tau in cbc_taus.items():
            lin = model.get_submodule(layer)
            replace_linear(model, layer, TiledCBCLinear(lin.weight.data, tau, getattr(lin, "bias", None)))
    return model.eval()
