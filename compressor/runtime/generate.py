"""Load an artifact once, generate many times: :func:`load` and :class:`Runtime`.

A generation is one sequence (batch 1): the prompt runs as one prefill forward, then one token per decode
step. LLaMA-family models run on :class:`~.decoder.StaticDecoder` (a static KV cache; on a GPU every step is
one replay of a captured CUDA graph and the token is chosen on the device); other architectures run the
model's own forward with transformers' ``DynamicCache``. Every compressed linear runs its kernel's arithmetic
(:mod:`.linear`), so Tiled-CBC thresholds apply at the decode steps (every row of a batched step too) and not
at prefill. Text in and out goes through the tokenizer stored in the artifact; token ids
work without one.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..artifact.store import Artifact
from ..artifact.tokenizer import has_tokenizer, load_generation_config, load_tokenizer
from ..errors import UserError
from .decoder import GraphedStep, StaticDecoder
from .plan import backend_kernels
from .sampling import check_sampling, choose

DEVICES = ("cpu", "cuda")
StreamCallback = Callable[[int | None, str], None]


@dataclass
class Generation:
    """One finished generation: the new tokens, their text and the timings."""

    prompt_ids: list[int]
    ids: list[int]                 # new tokens, the stopping token excluded
    text: str | None               # decoded new tokens (None without a tokenizer)
    stop: str                      # "eos", "length" (max_new_tokens) or "context" (the model's positions ran out)
    seed: int | None               # the sampling seed (None when greedy)
    first_token_s: float           # from the call to the first token chosen (prefill + first choice)
    decode_s: float                # from the first token to the last
    steps: int = 0                 # decode forwards run
    stats: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float | None:
        """Decode rate after the first token (None with fewer than two tokens)."""
        return self.steps / self.decode_s if self.steps and self.decode_s > 0 else None


class TextStream:
    """Incremental detokenization: the text each new token adds, holding back an incomplete UTF-8 character."""

    MAX_HELD = 3  # a UTF-8 character has at most 4 bytes: after that many held tokens the text is sent anyway

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""
        self.held = 0

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.text()
        if text.endswith("\ufffd") and self.held < self.MAX_HELD:  # part of a multi-byte character: wait
            self.held += 1
            return ""
        self.held = 0
        return self._advance(text)

    def flush(self) -> str:
        return self._advance(self.text())

    def _advance(self, text: str) -> str:
        delta = text[len(os.path.commonprefix([text, self.sent])):]  # decoding may revise earlier text: not resent
        self.sent = text
        return delta


class Runtime:
    """An artifact loaded for generation (see :func:`load`)."""

    LENGTH_STEP = 256
    graphs = True  # capture each decode step as a CUDA graph on a GPU (False: eager steps, e.g. to hook the ops)

    def __init__(self, path: Path, model: nn.Module, tokenizer, generation_config, device: torch.device,
                 backend: str, load_s: float) -> None:
        self.path = path
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.device = device
        self.backend = backend
        self.kernels = backend_kernels(backend)  # the decode step's glue (None: transformers' modules)
        self.load_s = load_s
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.25: cache
        self._keep_arg = "logits_to_keep" in params
        self.static_unsupported = StaticDecoder.unsupported(model)  # None: the static decoder runs this model
        self._decoder: StaticDecoder | None = None
        self._graph: GraphedStep | None = None
        self._batched: dict[int, tuple[StaticDecoder, GraphedStep]] = {}  # batch size -> decoder, captured step

    @property
    def n_compressed(self) -> int:
        """Stored linears the model runs (each a compressed op, or a member of a fused one)."""
        fusion = getattr(self.model, "unionsparse_fusion", None)
        if fusion and fusion.get("enabled"):
            return int(fusion["layers"])
        from .linear import CompressedLinear

        return sum(isinstance(m, CompressedLinear) for m in self.model.modules())

    @property
    def n_ops(self) -> int:
        """Compressed ops the model runs (a fused Q/K/V or gate/up set counts once)."""
        from .linear import CompressedLinear

        return sum(isinstance(m, CompressedLinear) for m in self.model.modules())

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a generation: the stored generation config's eos, else the model config's, else
        the tokenizer's."""
        for owner in (self.generation_config, self.model.config, self.tokenizer):
            v = getattr(owner, "eos_token_id", None)
            if v is not None:
                return {int(v)} if isinstance(v, int) else {int(i) for i in v}
        return set()

    def encode(self, prompt: str | Sequence[int] | torch.Tensor, chat: bool = False) -> list[int]:
        """Token ids of ``prompt`` (text through the stored tokenizer; ``chat``: with its chat template)."""
        if isinstance(prompt, str):
            tok = self._need_tokenizer("a text prompt")
            if chat:
                if not getattr(tok, "chat_template", None):
                    raise UserError(f"--chat: the tokenizer stored in {self.path} has no chat template")
                ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
            else:
                ids = tok(prompt, verbose=False)["input_ids"]
        else:
            if chat:
                raise UserError("--chat applies to text prompts, not token ids")
            ids = prompt.reshape(-1).tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        ids = [int(i) for i in ids]
        vocab = getattr(self.model.config, "vocab_size", None)
        if not ids:
            raise UserError("the prompt is empty (no tokens)")
        if vocab is not None and not all(0 <= i < vocab for i in ids):
            raise UserError(f"prompt token ids must lie in [0, {vocab})")
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise UserError(f"the prompt has {len(ids)} tokens; the model holds at most {self.max_positions} positions")
        return ids

    def _need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise UserError(f"{what} needs a tokenizer: {self.path} holds none (written before unionsparse stored "
                            "one, or its model had none); compress the model again, or pass token ids")
        return self.tokenizer

    def _forward(self, ids: list[int], cache) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        kw = {self._cache_arg: cache, **({"logits_to_keep": 1} if self._keep_arg else {})}
        return self.model(input_ids=x, use_cache=True, **kw).logits[:, -1]

    def new_cache(self):
        """An empty transformers KV cache (the path of models the static decoder does not run)."""
        from transformers import DynamicCache

        try:
            return DynamicCache(config=self.model.config)
        except TypeError:  # transformers before 4.56 takes no config
            return DynamicCache()

    def step_stats(self) -> dict:
        """How decode steps run: ``decoder`` ("static" or "transformers"), ``graph`` (one captured CUDA graph
        per step) and, when a capture failed, ``graph_error``."""
        if self.static_unsupported is not None:
            return {"decoder": "transformers", "graph": False, "why": self.static_unsupported}
        out = {"decoder": "static", "graph": self._graph is not None and self._graph.graph is not None}
        if self._graph is not None and self._graph.capture_error:
            out["graph_error"] = self._graph.capture_error
        return out

    def _generator(self, temperature: float, seed: int | None) -> tuple[int | None, torch.Generator | None]:
        """(the seed, a generator on the device seeded with it) for sampling; (None, None) at temperature 0. A
        seed is drawn from the OS when none is given, and reported, so that the draw can be repeated."""
        if temperature == 0:
            return None, None
        seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
        return seed, torch.Generator(device=self.device).manual_seed(seed)

    def decoder_length(self, need: int) -> int:
        """The static cache length for ``need`` positions: rounded up to whole 256s (one cache and one captured
        graph serve every later generation that fits), at most the model's positions."""
        length = -(-need // self.LENGTH_STEP) * self.LENGTH_STEP
        return min(length, self.max_positions) if self.max_positions else length

    def session(self, prompt_ids: Sequence[int], need: int) -> _StaticSession | _CacheSession:
        """A decoding session for one sequence: prefill ``prompt_ids`` with room for ``need`` positions."""
        if self.static_unsupported is None:
            if self._decoder is None or self._decoder.max_len < need:
                self._decoder = self._graph = None
                self._decoder = StaticDecoder(self.model, 1, self.decoder_length(need), self.kernels)
            if self._graph is None:
                # greedy: every step also writes its greedy tokens (in the lm_head launch with the glue kernels),
                # which generate takes at temperature 0; sampling overwrites them before the next step
                self._graph = GraphedStep(self._decoder, greedy=True, strict=False, capture=self.graphs)
            return _StaticSession(self._decoder, self._graph, prompt_ids)
        return _CacheSession(self, prompt_ids)

    @torch.inference_mode()
    def warm_up(self, length: int | None = None) -> None:
        """Do once what a first generation would otherwise pay for: allocate the static cache (``length``
        positions, default two 256s), compile the kernels (prefill and step), capture the step's graph. ``load``
        calls it on a GPU, inside the load time it reports, so that the first token comes at once."""
        if self.static_unsupported is not None:
            return
        length = self.decoder_length(length or 2 * self.LENGTH_STEP)
        s = self.session([0, 0], length)
        s.feed(torch.zeros(1, dtype=torch.long, device=self.device))
        s.advance()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def step_logits(self, prompt_ids: Sequence[int], new_ids: Sequence[int] = ()) -> torch.Tensor:
        """float32 [1 + len(new_ids), V]: the logits a generation sees, from the prefill of ``prompt_ids`` and
        then one decode step per token of ``new_ids`` (for comparing backends and devices)."""
        s = self.session(list(prompt_ids), len(prompt_ids) + len(new_ids) + 1)
        rows = [s.logits]
        for t in new_ids:
            s.feed(torch.tensor([int(t)], device=self.device))
            rows.append(s.advance().clone())  # a replayed graph returns its one static buffer
        return torch.cat(rows).float().cpu()

    @torch.inference_mode()
    def step_logits_batch(self, prompts: Sequence[Sequence[int]], new_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """float32 [1 + T, B, V]: :meth:`step_logits` for several prompts decoded together (left-padded, as
        :meth:`generate_batch` runs them); ``new_ids`` holds T tokens per row."""
        if self.static_unsupported is not None:
            raise UserError(f"batched decoding needs the static decoder: {self.static_unsupported}")
        rows = [list(map(int, r)) for r in prompts]
        feed = [list(map(int, r)) for r in new_ids]
        b, t = len(rows), max(len(r) for r in rows)
        steps = len(feed[0]) if feed else 0
        if len(feed) != b or any(len(f) != steps for f in feed):
            raise UserError(f"new_ids must hold the same number of tokens for each of the {b} prompts")
        dec, graph = self._batch_decoder(b, t + steps + 1)
        out = [dec.prefill(torch.tensor([[0] * (t - len(r)) + r for r in rows], dtype=torch.long),
                           [len(r) for r in rows]).float().cpu()]
        for i in range(steps):
            dec.tokens.copy_(torch.tensor([f[i] for f in feed], device=self.device))
            out.append(graph().float().cpu())
        return torch.stack(out)

    @torch.inference_mode()
    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stream: StreamCallback | None = None, chat: bool = False, ignore_eos: bool = False) -> Generation:
        """Generate up to ``max_new_tokens`` after ``prompt`` (text or token ids): greedy at ``temperature`` 0,
        else top-p sampling from ``seed`` (None: a fresh random seed, recorded in the result). ``stream(id,
        text)`` is called for every new token with the text it adds ("" without a tokenizer) and once more with
        ``id`` None for text held back at the end. Stops at an eos token unless ``ignore_eos``."""
        check_sampling(max_new_tokens, temperature, top_p)
        t0 = time.perf_counter()
        prompt_ids = self.encode(prompt, chat)
        seed, gen = self._generator(temperature, seed)
        text = TextStream(self.tokenizer) if self.tokenizer is not None else None
        eos = set() if ignore_eos else self.eos_ids
        limit = len(prompt_ids) + max_new_tokens
        if self.max_positions is not None:
            limit = min(limit, self.max_positions)
        s = self.session(prompt_ids, limit)
        logits = s.logits
        new: list[int] = []
        stop, t_first, steps = "length", None, 0
        while True:
            chosen = s.chosen if temperature == 0 else None  # the step's own greedy tokens
            if chosen is None:
                chosen = choose(logits, temperature, top_p, gen)  # on the device
                s.feed(chosen)
            n_after = len(prompt_ids) + len(new) + 1  # positions used once this token is fed
            ahead = s.overlaps and len(new) + 1 < max_new_tokens and n_after < limit
            if ahead:  # the GPU runs the next step while the host reads, checks and streams this token
                host = s.to_host(chosen)
                logits = s.advance()
                token = s.read(host)
            else:
                token = int(chosen[0])
            if t_first is None:
                t_first = time.perf_counter()
            if token in eos:
                stop = "eos"
                break
            new.append(token)
            if stream is not None:
                stream(token, text.push(token) if text is not None else "")
            if len(new) >= max_new_tokens:
                break
            if self.max_positions is not None and n_after >= self.max_positions:
                stop = "context"
                break
            if not ahead:
                logits = s.advance()
            steps += 1
        t_end = time.perf_counter()
        if stream is not None and text is not None:
            rest = text.flush()
            if rest:
                stream(None, rest)
        if text is not None:
            text.ids = list(new)
        return Generation(prompt_ids, new, text.text() if text is not None else None, stop, seed,
                          t_first - t0, t_end - t_first, steps,
                          self.step_stats())


    def _batch_decoder(self, batch: int, need: int) -> tuple[StaticDecoder, GraphedStep]:
        """The static decoder (and its captured step) for ``batch`` rows of at least ``need`` positions."""
        dec, graph = self._batched.get(batch, (None, None))
        if dec is None or dec.max_len < need:
            self._batched.pop(batch, None)
            dec = StaticDecoder(self.model, batch, self.decoder_length(need), self.kernels)
            graph = GraphedStep(dec, greedy=False, strict=False, capture=self.graphs)
            self._batched[batch] = (dec, graph)
        return dec, graph

    @torch.inference_mode()
    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int = 128,
                       temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, chat: bool = False,
                       ignore_eos: bool = False) -> list[Generation]:
        """:meth:`generate` for several prompts at once: one batch, each decode step one forward for all rows
        (prompts left-padded; each row computes what it would alone, except that a Tiled-CBC layer's threshold
        applies only when a step has one row, as its spMspV kernel runs there). A row that ends stops adding
        tokens; the batch runs until every row has ended. Timings are the batch's. Models the static decoder does
        not run generate one prompt after another."""
        check_sampling(max_new_tokens, temperature, top_p)
        if len(prompts) == 1 or self.static_unsupported is not None:
            return [self.generate(p, max_new_tokens, temperature, top_p, seed, chat=chat, ignore_eos=ignore_eos)
                    for p in prompts]
        t0 = time.perf_counter()
        rows = [self.encode(p, chat) for p in prompts]
        b, t = len(rows), max(len(r) for r in rows)
        limit = t + max_new_tokens if self.max_positions is None else min(t + max_new_tokens, self.max_positions)
        seed, gen = self._generator(temperature, seed)
        eos = set() if ignore_eos else self.eos_ids
        dec, graph = self._batch_decoder(b, limit)
        ids = torch.tensor([[0] * (t - len(r)) + r for r in rows], dtype=torch.long)
        logits = dec.prefill(ids, [len(r) for r in rows])
        new: list[list[int]] = [[] for _ in rows]
        stop = ["length"] * b
        done = [False] * b
        t_first, steps = None, 0
        while True:
            chosen = choose(logits, temperature, top_p, gen)
            dec.tokens.copy_(chosen)
            tokens = chosen.tolist()
            if t_first is None:
                t_first = time.perf_counter()
            for r, token in enumerate(tokens):
                if done[r]:
                    continue
                if token in eos:
                    done[r], stop[r] = True, "eos"
                    continue
                new[r].append(token)
                done[r] = len(new[r]) >= max_new_tokens
            if all(done):
                break
            if t + steps >= limit:  # the cache (the model's positions) is full
                stop = [s if d else "context" for s, d in zip(stop, done, strict=True)]
                break
            logits = graph()
            steps += 1
        t_end = time.perf_counter()
        stats = {**self.step_stats(), "batch": b}
        stats["graph"] = graph.graph is not None
        return [Generation(r, n, self.tokenizer.decode(n, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                           if self.tokenizer is not None else None, st, seed, t_first - t0, t_end - t_first, steps,
                           dict(stats))
                for r, n, st in zip(rows, new, stop, strict=True)]


class _StaticSession:
    """One sequence on the static decoder: prefill, then captured steps (``overlaps``: on a GPU the next step
    is launched before the host reads the current token)."""

    def __init__(self, decoder: StaticDecoder, graph: GraphedStep, prompt_ids: Sequence[int]) -> None:
        self.decoder, self.graph = decoder, graph
        self.overlaps = decoder.device.type == "cuda"
        self.logits = decoder.prefill(torch.tensor([list(prompt_ids)], dtype=torch.long))
        self._host = torch.empty(1, dtype=torch.long, pin_memory=self.overlaps)
        self.chosen: torch.Tensor | None = None  # the last step's greedy tokens (none after the prefill)

    def feed(self, token: torch.Tensor) -> None:
        self.decoder.tokens.copy_(token)

    def advance(self) -> torch.Tensor:
        out = self.graph()
        self.chosen = self.decoder.tokens if self.graph.greedy else None
        return out

    def to_host(self, token: torch.Tensor) -> torch.cuda.Event:
        self._host.copy_(token, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return done

    def read(self, done: torch.cuda.Event) -> int:
        done.synchronize()
        return int(self._host[0])


class _CacheSession:
    """One sequence through the model's own forward and transformers' DynamicCache (other architectures)."""

    overlaps = False
    chosen = None  # no step chooses a token here: generate does

    def __init__(self, rt: Runtime, prompt_ids: Sequence[int]) -> None:
        self.rt = rt
        self.cache = rt.new_cache()
        self.logits = rt._forward(list(prompt_ids), self.cache)
        self.token: list[int] = []

    def feed(self, token: torch.Tensor) -> None:
        self.token = [int(token.reshape(-1)[0])]

    def advance(self) -> torch.Tensor:
        return self.rt._forward(self.token, self.cache)


def load(path: str | Path | Artifact, device: str = "cpu", backend: str | None = None, dynamic_pruning: bool = True,
         tokenizer=None, fuse: bool | None = None, dtype: torch.dtype | str | None = None) -> Runtime:
    """Load artifact ``path`` for generation on ``device`` (``"cpu"``: the kernels' arithmetic in torch, exact;
    ``"cuda"``: the artifact's CuPy kernels, needs CuPy and a GPU). ``backend`` overrides the linears' backend
    (``"reference"``: the kernels' numba CPU references, slow). The stored tokenizer is loaded when there is
    one (``tokenizer``: one already loaded from it); token-id prompts work without one. ``dynamic_pruning``
    False ignores stored activation-sparsity thresholds. ``fuse`` runs the stored Q/K/V and gate/up linears of
    a block as one stacked product each (docs/runtime.md, "Fused linears"; default: on ``cuda``, where it
    saves launches, off on the CPU, whose reference arithmetic stays layer by layer); the model's
    ``unionsparse_fusion`` says what was fused. ``dtype``: the dense parts' dtype (embeddings, norms, attention,
    lm_head; default float32 on the CPU, float16 on a GPU); ``float16`` on the CPU computes what the GPU computes
    (docs/runtime.md, "Agreement"). ``Runtime.load_s`` holds the load time. A path is opened with its manifest
    checked (:class:`~..artifact.store.Artifact`); an open Artifact is used as it was opened."""
    from .model import build_model
    from .plan import BACKENDS

    t0 = time.perf_counter()
    if device not in DEVICES:
        raise UserError(f"--device: unknown value {device!r} (choose from {', '.join(DEVICES)})")
    backend = backend or device
    if backend not in BACKENDS:
        raise UserError(f"backend: unknown value {backend!r} (choose from {', '.join(BACKENDS)})")
    if (backend == "cuda") != (device == "cuda"):
        raise UserError(f"backend {backend} does not run on device {device}")
    if device == "cuda":
        from .cuda import require_cuda

        require_cuda()
    art = path if isinstance(path, Artifact) else Artifact(path)
    tok = tokenizer if tokenizer is not None else load_tokenizer(art) if has_tokenizer(art) else None
    gen_cfg = load_generation_config(art)
    fuse = device == "cuda" if fuse is None else bool(fuse)
    model = build_model(art, backend, device, dtype=parse_dtype(dtype), dynamic_pruning=dynamic_pruning, fuse=fuse)
    rt = Runtime(Path(art.path), model, tok, gen_cfg, torch.device(device), backend, 0.0)
    if device == "cuda":  # kernel compilation and graph capture belong to the load, not to the first token
        rt.warm_up()
    rt.load_s = time.perf_counter() - t0
    return rt


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a torch dtype ("auto" and None: the device's default, None)."""
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return None if dtype == "auto" else dtype
    if dtype not in DTYPES:
        raise UserError(f"--dtype: unknown value {dtype!r} (choose from auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]
