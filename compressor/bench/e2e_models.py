"""Synthetic LLaMA-family models for `unionsparse bench --e2e`: the shapes of real models, random weights.

A :class:`ModelSpec` gives a model's shape; :func:`build_model` makes a transformers ``LlamaForCausalLM`` of it
directly on the device (no hub, no initialisation pass: memory is allocated there and filled with random
numbers), so a 32-block 7B model is built on a GPU in about a second. Its decoder linears are then replaced by
the benchmark's peers (``e2e_peers``), Q/K/V as one stacked product and gate/up as one through the runtime's
``SharedInputLinear`` (:func:`install_group`), as ``runtime.load`` runs a fused artifact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..model.modules import replace_linear


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a LLaMA-family decoder."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    max_positions: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def groups(self) -> dict[str, tuple[int, int]]:
        """The decoder linears of one block as the step runs them, (M, K) each: Q/K/V stacked, O, gate/up
        stacked, down."""
        kv = self.kv_heads * self.head_dim
        return {"qkv": (self.hidden + 2 * kv, self.hidden), "o": (self.hidden, self.hidden),
                "gateup": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}

    def splits(self) -> dict[str, tuple[int, ...]]:
        """Output sizes of each stacked group's members, in ``GROUP_MEMBERS`` order."""
        kv = self.kv_heads * self.head_dim
        return {"qkv": (self.hidden, kv, kv), "o": (self.hidden,),
                "gateup": (self.intermediate, self.intermediate), "down": (self.hidden,)}

    def linear_params(self) -> int:
        """Weights of all decoder linears (lm_head aside)."""
        return self.layers * sum(m * k for m, k in self.groups().values())

    def kv_bytes(self, batch: int, context: int, dtype_bytes: int = 2) -> int:
        """Bytes of the K and V cache of ``context`` positions for ``batch`` sequences."""
        return 2 * self.layers * batch * context * self.kv_heads * self.head_dim * dtype_bytes

    def as_dict(self) -> dict:
        return {"name": self.name, "hidden": self.hidden, "intermediate": self.intermediate, "layers": self.layers,
                "heads": self.heads, "kv_heads": self.kv_heads, "vocab": self.vocab,
                "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling}


GROUP_MEMBERS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
                 "gateup": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
GROUPS = tuple(GROUP_MEMBERS)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

SPECS = {
    "llama2-7b": ModelSpec("llama2-7b", 4096, 11008, 32, 32, 32, 32000, max_positions=4096),
    # Llama-3.1-8B's config: llama3 rotary scaling of an 8192-position original to 131072 positions
    "llama3-8b": ModelSpec("llama3-8b", 4096, 14336, 32, 32, 8, 128256, max_positions=131072,
                           rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    # for CPU tests and the CPU smoke mode: K multiples of 128 (W4A16's int4 packing, IE-BME groups of 128)
    "tiny": ModelSpec("tiny", 256, 512, 2, 4, 2, 512, max_positions=1024),
}
GPU_SPECS = ("llama2-7b", "llama3-8b")


def llama_config(spec: ModelSpec):
    from transformers import LlamaConfig

    kw = {}
    if spec.rope_scaling is not None:
        kw["rope_scaling"] = dict(spec.rope_scaling)
    return LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                       num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                       num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_positions,
                       rope_theta=spec.rope_theta, rms_norm_eps=spec.rms_eps, tie_word_embeddings=False,
                       attention_bias=False, mlp_bias=False, **kw)


def build_model(spec: ModelSpec, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float16,
                seed: int = 0, linears: bool = True) -> nn.Module:
    """``LlamaForCausalLM`` of ``spec`` on ``device`` in ``dtype``, eval mode, random weights made there: every
    matrix N(0, 0.02²), norms 1. ``linears=False`` leaves the decoder linears unfilled (uninitialised memory
    about to be replaced by peers)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights
    from transformers import LlamaForCausalLM

    device = torch.device(device)
    config = llama_config(spec)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with no_init_weights(), device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator(device=device).manual_seed(seed)
    skip = () if linears else tuple(f".{m}." for ms in GROUP_MEMBERS.values() for m in ms)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if skip and any(s in f".{name}" for s in skip):
                continue
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    # transformers 5 may leave the generation config asking for an eos: random weights must generate to the end
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def install_group(model: nn.Module, layer: int, group: str, module: nn.Module, sizes: tuple[int, ...]) -> None:
    """Put ``module`` (an [..., K] -> [..., sum(sizes)] linear) in place of block ``layer``'s ``group`` linears.
    A stacked group (Q/K/V, gate/up) becomes the runtime's ``SharedInputLinear`` over ``module``, registered
    beside its members as ``runtime.load`` registers a fused artifact's (``fused_q_k_v_proj``,
    ``fused_gate_up_proj``), and its members replace the model's linears: one product per input."""
    from ..runtime.fused import SharedInputLinear, fused_name

    prefix = f"model.layers.{layer}."
    names = [prefix + n for n in GROUP_MEMBERS[group]]
    if len(names) == 1:
        replace_linear(model, names[0], module)
        return
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    shared = SharedInputLinear(module, names, offsets, sizes)
    parent = names[0].rpartition(".")[0]
    replace_linear(model, fused_name(parent, names), shared)
    for name, member in zip(names, shared.members(), strict=True):
        replace_linear(model, name, member)


def _fused_attrs(part: nn.Module) -> list[str]:
    return [n for n, _ in part.named_children() if n.startswith("fused_")]


def clear_groups(model: nn.Module, spec: ModelSpec) -> None:
    """Drop every decoder linear (placeholders in their place) and every stacked op, so their memory is freed
    before the next peers are built (unless a snapshot holds them)."""
    for i in range(spec.layers):
        block = model.get_submodule(f"model.layers.{i}")
        for part in (block.self_attn, block.mlp):
            for name in _fused_attrs(part):
                delattr(part, name)
        for names in GROUP_MEMBERS.values():
            for name in names:
                replace_linear(model, f"model.layers.{i}.{name}", nn.Identity())


def snapshot_linears(model: nn.Module, spec: ModelSpec) -> list[dict]:
    """The decoder linears as installed now (members and shared products of every block), for
    :func:`restore_linears`: every kind stays resident and is put back in place in microseconds."""
    snap = []
    for i in range(spec.layers):
        block = model.get_submodule(f"model.layers.{i}")
        entry = {name: block.get_submodule(name) for names in GROUP_MEMBERS.values() for name in names}
        fused = {f"{p}.{n}": getattr(getattr(block, p), n) for p in ("self_attn", "mlp")
                 for n in _fused_attrs(getattr(block, p))}
        snap.append({"linears": entry, "fused": fused})
    return snap


def restore_linears(model: nn.Module, spec: ModelSpec, snap: list[dict]) -> None:
    """Put the linears of a :func:`snapshot_linears` back into ``model``."""
    for i, entry in enumerate(snap):
        block = model.get_submodule(f"model.layers.{i}")
        for part in (block.self_attn, block.mlp):
            for name in _fused_attrs(part):
                delattr(part, name)
        for name, mod in {**entry["fused"], **entry["linears"]}.items():
            replace_linear(block, name, mod)
