"""Rebuild a runnable causal LM from an artifact (for ``unionsparse eval``).

Every compressed layer is decoded from its stored encoding. Quantized layers become
``FakeQuantLinear`` modules computing the kernels' arithmetic (activations quantized per token when
the layer records ``activations``, e.g. W4A4), or plain linears holding ``code · scale`` with
``act_quant=False``; fp16 Tiled-CBC layers hold their fp16 values. Layers with outlier channels
(``--keep-outliers``) compute main + 8-bit side product; their plain weight is put back in the original
column order. Every other tensor comes from
``dense/``. Used only when ``compressor.artifact`` has no ``rebuild_model`` of its own.

The artifact is untrusted: its ``model_config`` is built on the meta device first (no memory), its block
count bounded by the stored layers, and every parameter's shape compared with the stored tensors' declared
shapes (themselves checked against their files) before anything is allocated.
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
    """The Hugging Face config the artifact records, checked for sanity (UserError)."""
    from transformers import AutoConfig

    mc = art.attrs.get("model_config")
    if not isinstance(mc, dict) or not isinstance(mc.get("model_type"), str):
        raise UserError(f"{art.path}: the artifact does not record the model config (model_config)")
    mc = dict(mc)
    model_type = mc.pop("model_type")
    # the source's quantization_config (e.g. GGUF's) describes its checkpoint, not the decoded weights here
    for k in ("architectures", "transformers_version", "_name_or_path", "auto_map", "trust_remote_code",
              "quantization_config"):
        mc.pop(k, None)
    try:
        cfg = AutoConfig.for_model(model_type, **mc)
    except Exception as e:  # unknown model type, values its config class refuses
        raise UserError(f"{art.path}: model_config is not usable ({type(e).__name__}: {str(e)[:150]})") from None
    # every block holds compressed linears: more blocks (or experts) than stored layers is a forged config
    limit = max(1, len(art.layer_names))
    for key in ("num_hidden_layers", "num_experts", "num_local_experts", "n_routed_experts"):
        v = getattr(cfg, key, None)
        if v is not None and (type(v) is not int or not 0 <= v <= limit):
            raise UserError(f"{art.path}: model_config {key} = {v!r} does not fit the {limit} stored layers")
    return cfg


def _stored_shapes(art: Artifact) -> dict[str, tuple[int, ...]]:
    """Declared shape of every tensor the artifact would load (nothing read but metadata)."""
    shapes: dict[str, tuple[int, ...]] = {n: art.dense_meta(n).shape for n in art.dense_names}
    for alias, src in (art.attrs.get("tied") or {}).items():
        if src in shapes:
            shapes[str(alias)] = shapes[src]
    for layer in art.layer_names:
        shape = art.layer_attrs(layer).get("shape")
        if not isinstance(shape, list) or not all(type(v) is int for v in shape):
            raise UserError(f"{art.path}: layer {layer} has no valid shape")
        shapes[f"{layer}.weight"] = tuple(shape)
    return shapes


def check_model_fits(art: Artifact, config, dtype: torch.dtype) -> None:
    """Build ``config`` on the meta device and compare every tensor with the artifact's (UserError)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:
        raise UserError(f"{art.path}: model_config builds no model ({type(e).__name__}: {str(e)[:150]})") from None
    stored = _stored_shapes(art)
    params = 0
    for key, t in meta.state_dict().items():
        if not t.is_floating_point():
            continue
        if key not in stored:
            raise UserError(f"{art.path}: the artifact lacks tensors of the model: {key}")
        if tuple(t.shape) != stored[key]:
            raise UserError(f"{art.path}: model_config gives {key} shape {list(t.shape)}, the artifact stores "
                            f"{list(stored[key])}")
        params += t.numel()
    buffers = sum(b.numel() for b in meta.buffers())  # e.g. rotary tables, causal masks sized by the config
    if buffers > max(params, 1 << 24):
        raise UserError(f"{art.path}: model_config asks for {buffers} buffer elements, more than the model's "
                        f"{params} weights (a forged max_position_embeddings?)")


def rebuild_model(path: str | Path, act_quant: bool = True, dtype: torch.dtype = torch.float32,
                  dynamic_pruning: bool = True) -> nn.Module:
    """The model stored in artifact ``path``, on CPU, in eval mode.

    With ``act_quant``, Tiled-CBC layers with fp16 activations become :class:`~.dp_linear.TiledCBCLinear`
    (the decode kernel's arithmetic), with their stored ``dp_threshold`` when ``dynamic_pruning``.
    """
    from transformers import AutoModelForCausalLM

    art = Artifact(path)
    config = _config(art)
    check_model_fits(art, config, dtype)
    try:
        return _rebuild(art, config, AutoModelForCausalLM, act_quant, dtype, dynamic_pruning)
    except FormatError as e:
        raise UserError(f"{path}: {e} (run unionsparse verify)") from None


def _rebuild(art: Artifact, config, auto, act_quant: bool, dtype: torch.dtype, dynamic_pruning: bool) -> nn.Module:
    from ..activation_sparsity.linear import TiledCBCLinear
    from ..quantize.fake_quant import FakeQuantLinear, replace_linear

    path = art.path
    model = auto.from_config(config, dtype=dtype).eval()
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
