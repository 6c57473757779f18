"""A LLaMA-family decode step with a static KV cache, fixed shapes and no host synchronisation, so that one
CUDA graph can hold the whole step (docs/runtime.md, "The decode step").

:class:`StaticDecoder` runs the blocks of a transformers LLaMA-style model (LLaMA, Mistral without a sliding
window, Qwen2 without one; SmolLM2 is LLaMA) with its own modules: the embeddings, norms, MLPs and lm_head
are the model's, every linear is whatever module sits there (``nn.Linear``, ``CompressedLinear``, a fused
member), and only attention is its own: rotary tables precomputed for all positions, keys and values written
into preallocated ``[B, H_kv, max_len, D]`` caches at the step's position (a device tensor), and SDPA over the
whole cache with a position mask. Every step has the same shapes and launches the same kernels, so
:class:`GraphedStep` captures it once and replays it per token. The glue (RMSNorm, SiLU·mul, rotary embedding with
the cache write) runs through the runtime's kernels (``kernels/runtime_ops.py``): on a float16 GPU model one
launch each (``kernels/glue.cu``), with the ``reference`` backend their torch references, which is how the GPU
step's logic is tested on the CPU (``glue``, ``prequant``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import attention as attention_ops
from ...kernels import glue as glue_ops
from ...kernels import lm_head as lm_head_ops
from ...kernels import norm_quant, runtime_ops
from ..errors import UserError

ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # static inverse frequencies: a table holds them all


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type") or params.get("type") or "default")


class _TorchGlue:
    """The glue as torch operations (the references of ``kernels/glue.py``)."""

    rms_norm = staticmethod(glue_ops.rms_norm_reference)
    add_rms_norm = staticmethod(glue_ops.add_rms_norm_reference)
    silu_mul = staticmethod(glue_ops.silu_mul_reference)
    rotary_cache = staticmethod(glue_ops.rotary_cache_reference)
    decode_attention = staticmethod(attention_ops.decode_attention_reference)


class _ReferenceProducers:
    """Quantizing producers as torch operations (the references of ``kernels/norm_quant.py``)."""

    rms_norm_quant = staticmethod(norm_quant.rms_norm_quant_reference)
    add_rms_norm_quant = staticmethod(norm_quant.add_rms_norm_quant_reference)
    silu_mul_quant = staticmethod(norm_quant.silu_mul_quant_reference)
    decode_attention_quant = staticmethod(attention_ops.decode_attention_quant_reference)


class StaticDecoder(nn.Module):
    """Batched decoding of ``model`` with a static KV cache of ``max_len`` positions (see the module docstring).

    ``tokens`` ([B] long) holds the next step's input and ``position`` (a long scalar) its position, both on
    the model's device; :meth:`step` reads them, writes the logits into a static buffer and advances
    ``position`` in place, so replaying a captured step needs no host work. ``kernels``: the runtime kernels
    whose glue runs the step (``kernels/runtime_ops.py``; default: the CUDA kernels on a GPU, none on the CPU,
    where transformers' own modules run).
    """

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, kernels=None) -> None:
        super().__init__()
        why = self.unsupported(model, max_len)
        if why is not None:
            raise UserError(f"the static decoder cannot run this model: {why}")
        if batch_size < 1 or max_len < 2:
            raise UserError(f"static decoder: batch size {batch_size} and length {max_len} must be >= 1 and >= 2")
        cfg = model.config
        inner = model.model
        self.model = model
        self.batch_size, self.max_len = int(batch_size), int(max_len)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        emb = inner.embed_tokens.weight
        device, dtype = emb.device, emb.dtype
        n_layers = len(inner.layers)
        shape = (n_layers, self.batch_size, self.n_kv, self.max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        rot = inner.rotary_emb  # transformers' own frequencies and scaling (llama3 / yarn included)
        freqs = torch.arange(self.max_len, device=device).float()[:, None] * rot.inv_freq.float().to(device)[None]
        emb_f = torch.cat((freqs, freqs), dim=-1)  # the arithmetic of LlamaRotaryEmbedding.forward, per position
        scaling = float(getattr(rot, "attention_scaling", 1.0))
        self.register_buffer("cos", (emb_f.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb_f.sin() * scaling).to(dtype), persistent=False)
        self.register_buffer("arange", torch.arange(self.max_len, device=device), persistent=False)
        self.register_buffer("tokens", torch.zeros(self.batch_size, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("position", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        # per row: the cache slots before it are left padding (prompts of different lengths in one batch)
        self.register_buffer("offset", torch.zeros(self.batch_size, dtype=torch.long, device=device),
                             persistent=False)
        self.logits: torch.Tensor | None = None
        self._silu = getattr(cfg, "hidden_act", None) == "silu"
        if kernels is None and device.type == "cuda":
            kernels = runtime_ops.get("cuda")
        self.kernels = kernels
        self.glue = self.GLUE if kernels is not None and dtype in kernels.glue_dtypes() else "torch"

    GLUE = "kernels"  # where the runtime kernels take the model's dtype: "kernels" (one launch each) or "torch"
    PREQUANT = True  # with the glue kernels: quantizing producers (kernels/norm_quant.cu); False: the linears quantize
    # with the glue kernels: a decode step's rotary + KV write inside the attention launch (one launch a layer
    # fewer, the same values bit for bit; step time unchanged on an H100: docs/kernels.md, "Decode attention")
    ROPE_IN_ATTENTION = True
    # with the glue kernels: lm_head and the greedy choice in one launch (kernels/lm_head.cu); False: the model's
    # lm_head, .float() and torch.argmax (docs/kernels.md, "lm_head and the greedy choice")
    HEAD_KERNEL = True

    @property
    def glue(self) -> str:
        """How norms, SiLU·mul and rotary + cache writes run: "kernels" (the runtime kernels' glue: on a GPU
        ``kernels/glue.cu``, one launch each; with the reference kernels their torch references)
        or "torch" (their references: what transformers' modules compute, several launches each)."""
        return self._glue_name

    @glue.setter
    def glue(self, value: str) -> None:
        if value not in ("kernels", "torch"):
            raise UserError(f"glue must be 'kernels' or 'torch', got {value!r}")
        self._glue_name = value
        self._glue = (self.kernels or runtime_ops.get("reference")) if value == "kernels" else _TorchGlue
        self.prequant = value == "kernels" and self.PREQUANT

    @property
    def prequant(self) -> bool:
        """Quantizing producers: the RMSNorms before quantized-input linears (Q/K/V, gate/up), the SiLU·mul
        before down_proj and, at a decode step, attention before o_proj (where its rule fuses) also write that
        linear's quantized input and hand it over, so the linear does not quantize (``kernels/norm_quant.cu``
        and ``kernels/attention.cu`` with the glue kernels; their torch references otherwise, as tests use)."""
        return self._prequant

    @prequant.setter
    def prequant(self, value: bool) -> None:
        self._prequant = bool(value)
        self._producers = self._glue if self._glue_name == "kernels" else _ReferenceProducers

    @staticmethod
    def unsupported(model: nn.Module, max_len: int | None = None) -> str | None:
        """Why ``model`` cannot run here (one line), or None."""
        cfg = getattr(model, "config", None)
        kind = getattr(cfg, "model_type", None)
        if kind not in ARCHITECTURES:
            return f"architecture {kind!r} (supported: {', '.join(ARCHITECTURES)})"
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
            return "the model has no LLaMA-style decoder (model.layers, model.rotary_emb)"
        rope = _rope_type(cfg)
        if rope not in ROPE_TYPES:
            return f"rotary type {rope!r} (supported: {', '.join(ROPE_TYPES)})"
        window = getattr(cfg, "sliding_window", None)
        uses_window = window is not None and getattr(cfg, "use_sliding_window", kind == "mistral")
        if uses_window and (max_len is None or max_len > int(window)):
            return f"a sliding attention window of {window} positions"
        return None

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def reset(self) -> None:
        """Forget every cached position (the caches are masked by position; they are not cleared)."""
        self.position.zero_()

    def prefill(self, ids: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
        """Run the prompts ``ids`` [B, T] from cache slot 0: fills the cache, sets ``position`` to T and returns
        the last slot's logits [B, V]. ``lengths``: each row's prompt length, its tokens at the end of the row
        (left padding); a row's padding slots are never attended to and its rotary positions start at its first
        token, so every row computes what it would alone."""
        if ids.ndim != 2 or ids.shape[0] != self.batch_size:
            raise UserError(f"prefill: ids must be [{self.batch_size}, T], got {tuple(ids.shape)}")
        t = ids.shape[1]
        if not 1 <= t < self.max_len:
            raise UserError(f"prefill: {t} prompt tokens do not fit a cache of {self.max_len} positions")
        lengths = [t] * self.batch_size if lengths is None else [int(n) for n in lengths]
        if len(lengths) != self.batch_size or not all(1 <= n <= t for n in lengths):
            raise UserError(f"prefill: lengths {lengths} must give each of the {self.batch_size} rows 1 to {t} tokens")
        self.reset()
        self.offset.copy_(torch.tensor([t - n for n in lengths]))
        logits = self._forward(ids.to(self.device), self.arange[:t])
        self.position.fill_(t)
        return logits

    def step(self, choose: bool = False) -> torch.Tensor:
        """One decode step on ``tokens`` at ``position``: logits [B, V] (a static buffer when captured). With
        ``choose``, each row's greedy token (the first of its largest logits) replaces ``tokens``, in the lm_head's
        launch with the glue kernels (``kernels/lm_head.cu``)."""
        logits = self._forward(self.tokens[:, None], self.position.view(1), self.tokens if choose else None)
        self.position.add_(1)
        self.logits = logits
        return logits

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, choose: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] of the last of the rows ``ids`` [B, T] at positions ``pos`` [T] (device tensors); with
        ``choose`` ([B] long), each row's argmax written into it."""
        inner = self.model.model
        b, t = ids.shape
        glue = self._glue
        x = inner.embed_tokens(ids)
        # slot j visible to query i of row b iff j <= pos_i and j is not b's padding (a padding query sees itself)
        mask = attention_ops.visible(pos, self.offset, self.arange) if t > 1 else None  # [B, 1, T, L]
        rpos = (pos[None, :] - self.offset[:, None]).clamp(min=0)  # rotary positions [B, T]
        pending = None  # the last block's MLP output, added to the residual stream by the next norm
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x, h = self._norm(layer.input_layernorm, x, pending, attn.q_proj)
            q = attn.q_proj(h).view(b, t, self.n_heads, self.head_dim)
            k = attn.k_proj(h).view(b, t, self.n_kv, self.head_dim)
            v = attn.v_proj(h).view(b, t, self.n_kv, self.head_dim)
            if t == 1:  # a decode step: over the cache's valid length (attention.cu with the kernels)
                o = self._attend(attn, q, k, v, i, pos, rpos)
            else:
                q = glue.rotary_cache(q, k, v, self.cos, self.sin, pos, rpos, self.k_cache[i], self.v_cache[i])
                o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask,
                                                   scale=attn.scaling, enable_gqa=self.n_kv != self.n_heads)
                o = o.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)
            o = attn.o_proj(o)
            x, h = self._norm(layer.post_attention_layernorm, x, o, getattr(layer.mlp, "gate_proj", None))
            pending = self._mlp(layer.mlp, h)
        _, x = self._norm(inner.norm, x[:, -1], None if pending is None else pending[:, -1])
        return self._head(x, choose)

    def _head(self, x: torch.Tensor, choose: torch.Tensor | None) -> torch.Tensor:
        """float32 logits of the final norm's rows ``x`` [B, K], and with ``choose`` the greedy tokens written into
        it: one launch with the glue kernels where lm_head is a plain float linear the kernel takes
        (``kernels/lm_head.py``), the model's lm_head, ``.float()`` and ``torch.argmax`` otherwise."""
        head = self.model.lm_head
        if (self.glue == "kernels" and self.HEAD_KERNEL and type(head) is nn.Linear and head.bias is None
                and x.dtype in self._glue.glue_dtypes() and lm_head_ops.shape_supported(x, head.weight)):
            return self._glue.lm_head_greedy(x, head.weight, choose)
        logits = head(x).float()
        if choose is not None:
            choose.copy_(torch.argmax(logits, dim=-1))
        return logits

    def _attend(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int, pos: torch.Tensor,
                rpos: torch.Tensor) -> torch.Tensor:
        """Rotary + KV write and decode attention of block ``i`` on its raw q, k, v; with quantizing producers and
        an o_proj that takes a quantized input, that input from the attention launch where its rule fuses
        (``attention.quant_fusable``), handed to o_proj. With the glue kernels and :attr:`ROPE_IN_ATTENTION`, the
        rotary and the KV write are in that launch too (``attention.decode_attention_rope``)."""
        k_cache, v_cache = self.k_cache[i], self.v_cache[i]
        consumer = self._consumer(attn.o_proj)
        if self.glue == "kernels" and self.ROPE_IN_ATTENTION:
            done = self._glue.decode_attention_rope(q, k, v, self.cos, self.sin, pos, rpos, k_cache, v_cache,
                                                    self.offset, attn.scaling,
                                                    None if consumer is None else consumer.input_rule())
            if done is not None:
                o, quantized = done
                if quantized is not None:
                    consumer.offer(o.reshape(-1, o.shape[-1]), quantized)
                return o
        q = self._glue.rotary_cache(q, k, v, self.cos, self.sin, pos, rpos, k_cache, v_cache)
        if consumer is not None:
            done = self._producers.decode_attention_quant(q, k_cache, v_cache, pos, self.offset, attn.scaling,
                                                          consumer.input_rule())
            if done is not None:
                o, quantized = done
                consumer.offer(o.reshape(-1, o.shape[-1]), quantized)
                return o
        return self._glue.decode_attention(q, k_cache, v_cache, pos, self.offset, attn.scaling)

    def _consumer(self, linear: nn.Module):
        """The op that quantizes what ``linear`` reads (a fused member's stacked op), when quantizing producers
        are on and it takes a quantized input (``CompressedLinear.input_rule``); else None."""
        if not self.prequant:
            return None
        from .fused import SharedInputMember
        from .linear import CompressedLinear

        op = linear.shared.stacked if isinstance(linear, SharedInputMember) else linear
        return op if isinstance(op, CompressedLinear) and op.input_rule() is not None else None

    def _norm(self, norm: nn.Module, x: torch.Tensor, delta: torch.Tensor | None = None,
              reader: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): the residual add (none without ``delta``) and the norm, one launch with the
        glue kernels; with quantizing producers also the quantized input of ``reader``, handed to it."""
        eps = getattr(norm, "variance_epsilon", None)
        if eps is None or self.glue != "kernels":  # transformers' module, as the model runs it
            x = x if delta is None else x + delta
            consumer = self._consumer(reader) if reader is not None and eps is not None else None
            if consumer is None:
                return x, norm(x)
            y, quantized = self._producers.rms_norm_quant(x, norm.weight, float(eps), consumer.input_rule())
            consumer.offer(y.reshape(-1, y.shape[-1]), quantized)
            return x, y
        consumer = self._consumer(reader) if reader is not None else None
        if consumer is None:
            if delta is None:
                return x, self._glue.rms_norm(x, norm.weight, float(eps))
            return self._glue.add_rms_norm(x, delta, norm.weight, float(eps))
        if delta is None:
            y, quantized = self._producers.rms_norm_quant(x, norm.weight, float(eps), consumer.input_rule())
        else:
            x, y, quantized = self._producers.add_rms_norm_quant(x, delta, norm.weight, float(eps),
                                                                  consumer.input_rule())
        consumer.offer(y.reshape(-1, y.shape[-1]), quantized)
        return x, y

    def _mlp(self, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if not (self._silu and (self.glue == "kernels" or self.prequant)):
            return mlp(h)
        gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        consumer = self._consumer(mlp.down_proj)
        if consumer is None:
            return mlp.down_proj(self._glue.silu_mul(gate, up))
        y, quantized = self._producers.silu_mul_quant(gate, up, consumer.input_rule())
        consumer.offer(y.reshape(-1, y.shape[-1]), quantized)
        return mlp.down_proj(y)


class GraphedStep:
    """:meth:`StaticDecoder.step`, plus the greedy choice into ``decoder.tokens`` when ``greedy``, captured
    once as a CUDA graph and replayed per call; on the CPU (or with ``capture=False``) it runs eagerly (same code,
    same arithmetic). A
    capture that fails raises, or with ``strict=False`` leaves the step eager and says why in
    ``capture_error`` (``generate`` keeps working, slower, and reports it)."""

    WARMUP = 2  # eager runs before capture: lazy initialisation (kernel modules, workspaces) happens outside it

    def __init__(self, decoder: StaticDecoder, greedy: bool = True, strict: bool = True, capture: bool = True) -> None:
        self.decoder = decoder
        self.greedy = greedy
        self.graph = None
        self.out: torch.Tensor | None = None
        self.capture_error: str | None = None  # why the step runs eagerly on a GPU (``strict=False`` only)
        if decoder.device.type == "cuda" and capture:  # capture=False: eager steps (checks that hook the ops)
            try:
                self._capture()
            except RuntimeError as e:  # e.g. an operation that synchronises with the host inside the step
                if strict:
                    raise
                torch.cuda.synchronize(decoder.device)
                self.graph, self.out = None, None
                self.capture_error = " ".join(str(e).split())[:300]

    def _run(self) -> torch.Tensor:
        return self.decoder.step(choose=self.greedy)

    def _capture(self) -> None:
        d = self.decoder
        position, tokens = d.position.clone(), d.tokens.clone()
        side = torch.cuda.Stream(d.device)
        side.wait_stream(torch.cuda.current_stream(d.device))
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                self._run()
                d.position.copy_(position)  # the warm-up steps rewrite the same cache slot the real step will
                d.tokens.copy_(tokens)
        torch.cuda.current_stream(d.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # recorded, not run: position and tokens are as they were
            self.out = self._run()

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self._run()
        self.graph.replay()
        return self.out
