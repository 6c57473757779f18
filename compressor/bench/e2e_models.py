"""Synthetic LLaMA-family models for `unionsparse bench --e2e`: the shapes of real models, random weights.

A :class:`ModelSpec` gives a model's shape; :func:`build_model` makes a transformers ``LlamaForCausalLM`` of it
directly on the device (no hub, no initialisation pass: memory is allocated there and filled with random
numbers), so a 32-block 7B model is built on a GPU in about a second. Its decoder linears are then replaced by
the benchmark's peers (``e2e_peers``), Q/K/V as one stacked product and gate/up as one
(:func:`install_group`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..quantize.fake_quant import replace_linear


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


class SharedProduct(nn.Module):
    """One product ``x -> inner(x)`` whose output columns are split among members (Q/K/V, gate/up).

    TODO: switch to ``compressor.runtime.fused.SharedInputLinear`` (branch ``fuse``) when it lands on main.
    Each member returns its slice of the one product of its input: the first member called with an input
    computes it, the others reuse it when called with the same tensor (same object, unmodified), so the
    model's own code (which calls q, k and v one after another) runs one launch per group.
    """

    def __init__(self, inner: nn.Module, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.inner = inner
        self.sizes = tuple(int(s) for s in sizes)
        self.in_features = int(getattr(inner, "in_features", 0))
        self.out_features = sum(self.sizes)
        self._key = None
        self._out = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        try:
            version = x._version
        except RuntimeError:  # inference tensors keep no version counter
            version = -1
        key = (id(x), version, x.data_ptr(), tuple(x.shape))
        if self._key != key or self._out is None:
            self._out = self.inner(x)
            self._key = key
            self._x = x  # keeps id(x) from being reused while the cached product is kept
        return self._out

    def release(self) -> None:
        self._key = self._out = self._x = None

    def members(self) -> list[nn.Module]:
        out, start = [], 0
        for i, s in enumerate(self.sizes):
            out.append(_Member(self, start, s, i == len(self.sizes) - 1))
            start += s
        return out


class _Member(nn.Module):
    """A drop-in linear: columns [start, start + size) of its :class:`SharedProduct`'s output."""

    def __init__(self, parent: SharedProduct, start: int, size: int, last: bool) -> None:
        super().__init__()
        self.__dict__["parent"] = parent  # not a submodule: the parent is registered once, on the block
        self.start, self.size, self.last = start, size, last
        self.in_features, self.out_features = parent.in_features, size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parent.product(x).narrow(-1, self.start, self.size)
        if self.last:
            self.parent.release()
        return y

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.start + self.size} of the shared product"


def install_group(model: nn.Module, layer: int, group: str, module: nn.Module, sizes: tuple[int, ...]) -> None:
    """Put ``module`` (an [..., K] -> [..., sum(sizes)] linear) in place of block ``layer``'s ``group`` linears;
    stacked groups get a :class:`SharedProduct` (registered on the block as ``shared_<group>``) whose members
    replace the model's q/k/v (gate/up) linears."""
    prefix = f"model.layers.{layer}."
    names = GROUP_MEMBERS[group]
    if len(names) == 1:
        replace_linear(model, prefix + names[0], module)
        return
    shared = SharedProduct(module, sizes)
    block = model.get_submodule(prefix.rstrip("."))
    setattr(block, f"shared_{group}", shared)
    for name, member in zip(names, shared.members(), strict=True):
        replace_linear(model, prefix + name, member)


def group_module(model: nn.Module, layer: int, group: str) -> nn.Module:
    """The module computing block ``layer``'s ``group`` product (the stacked one for Q/K/V and gate/up)."""
    block = model.get_submodule(f"model.layers.{layer}")
    shared = getattr(block, f"shared_{group}", None)
    return shared.inner if shared is not None else block.get_submodule(GROUP_MEMBERS[group][0])


def clear_groups(model: nn.Module, spec: ModelSpec) -> None:
    """Drop every decoder linear (placeholders in their place), so their memory is freed before the next peers
    are built."""
    for i in range(spec.layers):
        block = model.get_submodule(f"model.layers.{i}")
        for group, names in GROUP_MEMBERS.items():
            if hasattr(block, f"shared_{group}"):
                delattr(block, f"shared_{group}")
            for name in names:
                replace_linear(model, f"model.layers.{i}.{name}", nn.Identity())


def snapshot_linears(model: nn.Module, spec: ModelSpec) -> list[dict]:
    """The decoder linears as installed now (members and shared products of every block), for
    :func:`restore_linears`: every kind stays resident and is put back in place in microseconds."""
    snap = []
    for i in range(spec.layers):
        block = model.get_submodule(f"model.layers.{i}")
        entry = {name: block.get_submodule(name) for names in GROUP_MEMBERS.values() for name in names}
        entry.update({f"shared_{g}": getattr(block, f"shared_{g}", None) for g in GROUP_MEMBERS})
        snap.append(entry)
    return snap


def restore_linears(model: nn.Module, spec: ModelSpec, snap: list[dict]) -> None:
    """Put the linears of a :func:`snapshot_linears` back into ``model``."""
    for i, entry in enumerate(snap):
        block = model.get_submodule(f"model.layers.{i}")
        for name, mod in entry.items():
            if name.startswith("shared_"):
                if hasattr(block, name):
                    delattr(block, name)
                if mod is not None:
                    setattr(block, name, mod)
            else:
                replace_linear(block, name, mod)
