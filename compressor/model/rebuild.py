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
from ...formats.arithmetic.linears import FakeQuantLinear
from ...formats.arithmetic.outlier_side import dequantize_layer
from ...formats.arithmetic.sparse_inputs import TiledCBCLinear
from ...formats.arithmetic.weights import dequantize
from ...formats.errors import FormatError
from ..artifact.store import Artifact, LayerRecord
from ..errors import UserError
from .modules import replace_linear


def model_config(art: Artifact):
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


def empty_model(art: Artifact, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The artifact's architecture with freshly initialised weights, on CPU, in eval mode; the config is checked
    against the stored tensors before anything is allocated (an untrusted artifact cannot ask for terabytes)."""
    from transformers import AutoModelForCausalLM

    config = model_config(art)
    check_model_fits(art, config, dtype)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def dense_state(art: Artifact) -> dict[str, torch.Tensor]:
    """Every tensor of ``dense/`` as float32, plus the tied aliases (``lm_head.weight`` -> its source)."""
    state = {name: torch.from_numpy(np.asarray(art.read_dense(name), dtype=np.float32)) for name in art.dense_names}
    for alias, src in (art.attrs.get("tied") or {}).items():
        if src in state:
            state[alias] = state[src]
    return state


def layer_weight(rec: LayerRecord, values: np.ndarray | None = None) -> np.ndarray:
    """float32 [M, K] weight of a stored layer in the original column order (fp16 values, or code * scale);
    ``values``: the layer's decoded values or codes, if already at hand."""
    values = rec.encoding.decode() if values is None else values
    if rec.attrs.get("bits") is None:
        return np.ascontiguousarray(values, dtype=np.float32)
    w = dequantize(np.asarray(values, dtype=np.int8), rec.scales, int(rec.attrs["group_size"]))
    if rec.outliers is not None:  # main matrix column-permuted + 8-bit side: back to original order
        w = dequantize_layer(w, rec.outliers)
    return np.ascontiguousarray(w)


def missing_tensors(model: nn.Module, state: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> list[str]:
    """Floating-point tensors of ``model`` that ``state`` lacks (names starting with a ``skip`` prefix aside)."""
    return [k for k, v in model.state_dict().items()
            if k not in state and v.is_floating_point() and not k.startswith(skip)]


def rebuild_model(path: str | Path | Artifact, act_quant: bool = True, dtype: torch.dtype = torch.float32,
                  dynamic_pruning: bool = True) -> nn.Module:
    """The model stored in artifact ``path`` (a path: opened with its manifest checked; or an open Artifact),
    on CPU, in eval mode.

    With ``act_quant``, Tiled-CBC layers with fp16 activations become
    :class:`~unionsparse.formats.arithmetic.sparse_inputs.TiledCBCLinear` (the decode kernel's arithmetic),
    with their stored ``dp_threshold`` when ``dynamic_pruning``.
    """
    art = path if isinstance(path, Artifact) else Artifact(path)
    try:
        return _rebuild(art, act_quant, dtype, dynamic_pruning)
    except FormatError as e:
        raise UserError(f"{art.path}: {e} (run unionsparse verify)") from None


def _rebuild(art: Artifact, act_quant: bool, dtype: torch.dtype, dynamic_pruning: bool) -> nn.Module:
    path = art.path
    model = empty_model(art, dtype)
    state = dense_state(art)
    quantized: dict[str, tuple] = {}
    cbc_taus: dict[str, float | None] = {}  # fp16-activation Tiled-CBC layers and their thresholds
    for layer in art.layer_names:
        rec = art.read_layer(layer)
        if registry.get(rec.format).activation_sparsity and not rec.attrs.get("activations"):
            cbc_taus[layer] = rec.attrs.get("dp_threshold") if dynamic_pruning else None
        values = rec.encoding.decode()
        bits = rec.attrs.get("bits")
        if bits is not None:
            quantized[layer] = (values, rec.scales, int(bits), int(rec.attrs["group_size"]),
                                rec.attrs.get("activations"), rec.outliers)
        state[f"{layer}.weight"] = torch.from_numpy(layer_weight(rec, values))
    missing = missing_tensors(model, state)
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
