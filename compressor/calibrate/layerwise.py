"""Layer-wise calibration engine: catch block 0's inputs, collect per-linear statistics, prune block by block.

Only one block's activations are held at a time (``inps`` and ``outs``, each ``[n, seqlen, hidden]``);
each block sees the outputs of the already-pruned blocks before it, as both reference codes do.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import UserError
from ..model.loading import block_linears, find_blocks
from ..pruning import dispatch
from ..pruning import methods as pruning
from ..pruning.dispatch import METHODS, prune_layer
from ..pruning.nm import parse_nm

log = logging.getLogger(__name__)

__all__ = [
    "find_blocks",
    "block_linears",
    "capture_block_inputs",
    "collect_block_stats",
    "forward_block",
    "LayerStats",
    "owl_block_sparsities",
    "calibrated_blocks",
    "non_block_weights",
    "CalibrationPlan",
    "calibration_plan",
    "load_tokenizer",
    "prune_model",
    "PruneReport",
]

#: ``load(module, path)``: a context manager holding ``module``'s weights (read from the checkpoint) while
#: open; the streaming runs pass ``streaming.loaded_weights``.
LoadWeights = Callable[[nn.Module, str], contextlib.AbstractContextManager]


class _StopForward(Exception):
    pass


class _Catcher(nn.Module):
    """Stands in for block 0: stores its input and keyword arguments, then stops the forward pass."""

    def __init__(self, module: nn.Module, inps: torch.Tensor):
        super().__init__()
        self.module = module
        self.inps = inps
        self.count = 0
        self.kwargs: dict | None = None

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:  # attributes the model reads off its layers (e.g. Qwen2's attention_type)
            return getattr(super().__getattr__("module"), name)

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise RuntimeError(
                "layerwise: the decoder block was called with positional arguments beyond hidden_states"
            )
        self.inps[self.count] = hidden_states[0]
        self.count += 1
        if self.kwargs is None:
            self.kwargs = kwargs
        raise _StopForward


def _base_of(model: nn.Module, prefix: str) -> nn.Module:
    obj = model
    for part in prefix.split(".")[:-1]:
        obj = getattr(obj, part)
    return obj


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, samples: torch.Tensor, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, dict]:
    """Run the embedding part for every sample and return block 0's inputs and keyword arguments.

    ``samples`` is ``LongTensor [n, seqlen]``. Returns ``(inps [n, seqlen, hidden] on device, kwargs)``,
    kwargs being what the model passes to each block (attention_mask, position_ids,
    position_embeddings, ...) for one sample; they are the same for every sample of one length.
    """
    device = torch.device(device)
    blocks, prefix = find_blocks(model)
    base = _base_of(model, prefix)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    first = blocks[0]
    p = next(first.parameters())
    hidden = getattr(model.config, "hidden_size", None) or p.shape[-1]
    inps = torch.zeros(samples.shape[0], samples.shape[1], hidden, dtype=p.dtype, device=device)
    moved = _move_non_blocks(base, blocks, device)
    catcher = _Catcher(first, inps)
    blocks[0] = catcher
    try:
        for j in range(samples.shape[0]):
            try:
                model(samples[j : j + 1].to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        blocks[0] = first
        _move_back(moved)
    if catcher.count != samples.shape[0]:
        raise RuntimeError(f"layerwise: caught {catcher.count} block inputs for {samples.shape[0]} samples")
    kwargs = dict(catcher.kwargs or {})
    kwargs.pop("use_cache", None)
    kwargs["use_cache"] = False
    return inps, kwargs


def _move_non_blocks(
    base: nn.Module, blocks: nn.ModuleList, device: torch.device
) -> list[tuple[nn.Module, torch.device]]:
    """Move the base model's parts other than the blocks (embeddings, rotary, norms) to ``device``."""
    moved = []
    for child in base.children():
        if child is blocks:
            continue
        t = next(iter(list(child.parameters()) + list(child.buffers())), None)
        if t is not None and t.device != device:
            moved.append((child, t.device))
            child.to(device)
    return moved


def _move_back(moved: list[tuple[nn.Module, torch.device]]) -> None:
    for child, dev in moved:
        child.to(dev)


def _out(o):
    return o[0] if isinstance(o, (tuple, list)) else o


@torch.no_grad()
def forward_block(
    block: nn.Module, inps: torch.Tensor, kwargs: dict, outs: torch.Tensor | None = None
) -> torch.Tensor:
    """Outputs of ``block`` for every sample of ``inps``, one sample at a time (``outs`` may be reused)."""
    if outs is None:
        outs = torch.empty_like(inps)
    for j in range(inps.shape[0]):
        outs[j] = _out(block(inps[j : j + 1], **kwargs))[0]
    return outs


@dataclass
class LayerStats:
    """Calibration statistics of one linear layer's input."""

    x_sq_norm: torch.Tensor | None = None  # [K], Wanda
    H: torch.Tensor | None = None  # [K, K], SparseGPT
    nsamples: int = 0

    def __getitem__(self, key: str) -> torch.Tensor | None:  # stats["x_sq_norm"], stats["H"]
        return getattr(self, key)


@torch.no_grad()
def collect_block_stats(
    block: nn.Module,
    linear_names: Iterable[str] | None,
    inps: torch.Tensor,
    kwargs: dict,
    kind: str = "wanda",
    outs: torch.Tensor | None = None,
) -> dict[str, LayerStats]:
    """Per-linear input statistics of ``block`` over ``inps`` (hooks, one sample at a time).

    ``kind`` is ``"wanda"`` (x_sq_norm), ``"sparsegpt"`` (H) or ``"both"``. ``linear_names`` are names
    relative to the block (None = every nn.Linear). If ``outs`` is given it receives the block's outputs.
    """
    if kind not in ("wanda", "sparsegpt", "both"):
        raise ValueError(f"kind must be wanda, sparsegpt or both, got {kind!r}")
    modules = dict(block_linears(block))
    names = list(modules) if linear_names is None else list(linear_names)
    missing = [n for n in names if n not in modules]
    if missing:
        raise KeyError(f"not linear layers of the block: {missing}")
    sq: dict[str, pruning.SqNormAccumulator] = {}
    hs: dict[str, pruning.HessianAccumulator] = {}
    handles = []
    for n in names:
        mod = modules[n]
        dev = mod.weight.device
        if kind in ("wanda", "both"):
            sq[n] = pruning.SqNormAccumulator(mod.in_features, dev)
        if kind in ("sparsegpt", "both"):
            hs[n] = pruning.HessianAccumulator(mod.in_features, dev)

        def hook(_m, args, _o, n=n):
            x = args[0].detach()
            if n in sq:
                sq[n].add_batch(x)
            if n in hs:
                hs[n].add_batch(x)

        handles.append(mod.register_forward_hook(hook))
    try:
        for j in range(inps.shape[0]):
            o = _out(block(inps[j : j + 1], **kwargs))
            if outs is not None:
                outs[j] = o[0]
    finally:
        for h in handles:
            h.remove()
    return {
        n: LayerStats(
            x_sq_norm=sq[n].x_sq_norm if n in sq else None,
            H=hs[n].H if n in hs else None,
            nsamples=inps.shape[0],
        )
        for n in names
    }


# --------------------------------------------------------------------------------------------------
# the whole-model driver


@dataclass
class PruneReport:
    """Per-layer outcome of ``prune_model``."""

    method: str
    layers: dict[str, dict] = field(default_factory=dict)  # path -> {shape, target, sparsity, seconds}
    block_sparsity: list[float] = field(default_factory=list)
    outlier_ratios: list[float] | None = None
    seconds: float = 0.0

    def overall_sparsity(self) -> float:
        zeros = sum(v["zeros"] for v in self.layers.values())
        total = sum(v["numel"] for v in self.layers.values())
        return zeros / total if total else 0.0


@torch.no_grad()
def owl_block_sparsities(
    model: nn.Module,
    samples: torch.Tensor,
    target: float,
    lam: float = 0.08,
    m: float = 5.0,
    device: str | torch.device = "cpu",
    load: LoadWeights | None = None,
) -> tuple[list[float], list[float]]:
    """OWL: outlier ratio of every block on the dense model, then per-block sparsities (mean = target).

    One dense calibration pass (Wanda statistics, block inputs from the dense previous blocks).
    Returns ``(sparsities, outlier_ratios)``. ``load``: as in :func:`calibrated_blocks`.
    """
    blocks, prefix = find_blocks(model)
    device = torch.device(device)
    with non_block_weights(model, load):
        inps, kwargs = capture_block_inputs(model, samples, device)
    outs = torch.empty_like(inps)
    ratios = []
    for bi, block in enumerate(blocks):
        with load(block, f"{prefix}.{bi}") if load is not None else contextlib.nullcontext():
            orig = _device_of(block)
            block.to(device)
            stats = collect_block_stats(block, None, inps, kwargs, kind="wanda", outs=outs)
            metrics = [pruning.wanda_metric(mod.weight, stats[n].x_sq_norm) for n, mod in block_linears(block)]
            ratios.append(pruning.outlier_ratio(metrics, m))
            del metrics, stats
            block.to(orig)
        inps, outs = outs, inps
    return pruning.owl_sparsities(ratios, target, lam), ratios


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


LayerCallback = Callable[[str, nn.Linear, torch.Tensor], None]


def non_block_weights(model: nn.Module, load: LoadWeights | None) -> contextlib.AbstractContextManager:
    """Weights of the base model's parts other than the blocks (embeddings, norms), loaded while open.

    What ``capture_block_inputs`` needs when the parameters are on the meta device (a no-op when
    ``load`` is None).
    """
    if load is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    blocks, prefix = find_blocks(model)
    base = _base_of(model, prefix)
    base_path = prefix.rsplit(".", 1)[0] if "." in prefix else ""
    for name, child in base.named_children():
        if child is not blocks:
            stack.enter_context(load(child, f"{base_path}.{name}" if base_path else name))
    return stack


def calibrated_blocks(
    model: nn.Module, samples: torch.Tensor | None, kind: str | None, device: str | torch.device = "cpu",
    load: LoadWeights | None = None,
) -> Iterator[tuple[int, nn.Module, dict[str, LayerStats]]]:
    """Yield ``(index, block, stats)`` block by block; prune the block's linears before advancing.

    ``kind`` is ``"wanda"``, ``"sparsegpt"``, ``"both"`` or None (no calibration: stats is ``{}``).
    The block sits on ``device`` while it is yielded; when the consumer asks for the next block, the
    (now pruned) block is run on the current inputs to give the next block's inputs, and is moved back.
    ``load(module, path)`` (streaming: the parameters are on the meta device) is a context manager that
    holds ``module``'s weights while open: the embedding part while block 0's inputs are caught, then
    each block from before its statistics until its outputs are computed, so one block is in memory.
    """
    device = torch.device(device)
    blocks, prefix = find_blocks(model)
    inps = kwargs = outs = None
    if kind is not None:
        if samples is None or samples.numel() == 0:
            raise UserError("calibration samples are needed (--calib)")
        with non_block_weights(model, load):
            inps, kwargs = capture_block_inputs(model, samples, device)
        outs = torch.empty_like(inps)
    for bi, block in enumerate(blocks):
        with load(block, f"{prefix}.{bi}") if load is not None else contextlib.nullcontext():
            orig = _device_of(block)
            block.to(device)
            try:
                stats = collect_block_stats(block, None, inps, kwargs, kind=kind) if kind is not None else {}
                yield bi, block, stats
                del stats
                if kind is not None:
                    forward_block(block, inps, kwargs, outs)
                    inps, outs = outs, inps
            finally:
                block.to(orig)


@dataclass
class CalibrationPlan:
    """What the compress pipeline needs for pruning: samples, statistics kind, per-block sparsity."""

    samples: torch.Tensor | None
    kind: str | None
    block_sparsity: list[float]
    info: dict = field(default_factory=dict)


def load_tokenizer(source: str, flag: str = "MODEL", purpose: str = " for calibration"):
    """The tokenizer of MODEL (a model folder, a .gguf file or a hub id); errors name ``flag``."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from ..model.hub import hub_local_only
    from ..model.loading import classify_source

    p = Path(source)
    try:
        hub = classify_source(source) == "hub"
    except UserError:
        hub = False  # a local path: the loader below names what is wrong with it
    local = hub and hub_local_only(source)  # offline or unreachable: the cache, or one line at once
    try:
        if p.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(p.resolve().parent), gguf_file=p.name)
        return AutoTokenizer.from_pretrained(source, local_files_only=local)
    except Exception as e:  # missing tokenizer files, hub unreachable, unsupported GGUF tokenizer
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(f"{flag}: cannot load the tokenizer of {source}{purpose}: {first}") from None


def calibration_plan(
    model: nn.Module,
    model_source: str,
    prune: str,
    sparsity: float,
    profile: str = "uniform",
    calib: str = "c4",
    nsamples: int = 128,
    seqlen: int = 2048,
    seed: int = 0,
    device: str | torch.device = "cpu",
    owl_lambda: float = 0.08,
    owl_m: float = 5.0,
    note: Callable[[str], None] | None = None,
    tokenizer=None,
    nm: str | tuple[int, int] | None = None,
    load: LoadWeights | None = None,
) -> CalibrationPlan:
    """Load calibration windows when ``prune`` / ``profile`` need them, and the per-block sparsities.

    ``load``: as in :func:`calibrated_blocks` (streaming: the OWL pass fills one block in at a time).
    """
    from .samples import load_calibration

    if profile not in ("uniform", "owl"):
        raise UserError(f"--sparsity-profile must be uniform or owl, got {profile!r}")
    if profile == "owl" and nm is not None:
        raise UserError("--sparsity-profile owl applies to unstructured sparsity; drop --nm or use uniform")
    blocks, _ = find_blocks(model)
    kind = METHODS[prune].statistics if prune in METHODS else None
    needs = kind is not None or (prune in METHODS and profile == "owl")
    if not needs:
        return CalibrationPlan(None, None, [float(sparsity)] * len(blocks))
    say = note or (lambda _m: None)
    tok = tokenizer if tokenizer is not None else load_tokenizer(model_source)
    samples, info = load_calibration(calib, tok, nsamples, seqlen, seed, return_info=True)
    say(f"calibration: {nsamples} x {seqlen} tokens from {calib} (seed {seed}), {info.get('mode')} sampling "
        f"from {info.get('documents')} documents")  # after loading: no note before an error line
    info = dict(info)
    if profile == "owl":
        say("OWL: outlier ratios on the dense model")
        sps, ratios = owl_block_sparsities(model, samples, sparsity, owl_lambda, owl_m, device, load)
        info["owl_outlier_ratios"] = ratios
        info["owl_lambda"], info["owl_m"] = owl_lambda, owl_m
    else:
        sps = [float(sparsity)] * len(blocks)
    return CalibrationPlan(samples, kind, sps, info)


@torch.no_grad()
def prune_model(
    model: nn.Module,
    samples: torch.Tensor | None,
    method: str,
    sparsity: float = 0.5,
    nm: str | tuple[int, int] | None = None,
    profile: str = "uniform",
    device: str | torch.device = "cpu",
    blocksize: int = 128,
    percdamp: float = 0.01,
    owl_lambda: float = 0.08,
    owl_m: float = 5.0,
    on_layer: LayerCallback | None = None,
    skip: Callable[[str], bool] | None = None,
) -> PruneReport:
    """Prune every nn.Linear of every decoder block in place, block by block.

    ``method`` is magnitude | wanda | sparsegpt, each layer pruned by ``pruning.dispatch.prune_layer`` as in
    ``compress``. Calibration ``samples`` ([n, seqlen] token ids) are
    needed by wanda, sparsegpt and by ``profile="owl"``. Block i's statistics come from the outputs
    of the already-pruned blocks 0..i-1. ``on_layer(path, module, mask)`` is called right after each
    layer is pruned (path = full module path of the linear, mask True = kept); ``skip(path)`` leaves a
    layer dense. lm_head and embeddings are never pruned.
    """
    kind = dispatch.method(method).statistics
    if profile not in ("uniform", "owl"):
        raise UserError(f"--sparsity-profile must be uniform or owl, got {profile!r}")
    nm_t = parse_nm(nm)
    if nm_t is not None and profile == "owl":
        raise UserError("--sparsity-profile owl applies to unstructured sparsity; drop --nm or use uniform")
    needs_data = kind is not None or profile == "owl"
    if needs_data and (samples is None or samples.numel() == 0):
        raise UserError(f"--prune {method} needs calibration samples (--calib)")
    t0 = time.perf_counter()
    device = torch.device(device)
    blocks, prefix = find_blocks(model)
    report = PruneReport(method=method)
    if profile == "owl":
        sps, ratios = owl_block_sparsities(model, samples, sparsity, owl_lambda, owl_m, device)
        report.outlier_ratios = ratios
    else:
        sps = [pruning._check_sparsity(sparsity)] * len(blocks)
    report.block_sparsity = list(sps)
    options = {"blocksize": blocksize, "percdamp": percdamp} if method == "sparsegpt" else {}
    for bi, block, stats in calibrated_blocks(model, samples, kind, device):
        linears = [(n, m) for n, m in block_linears(block) if not (skip and skip(f"{prefix}.{bi}.{n}"))]
        for sub, mod in linears:
            path = f"{prefix}.{bi}.{sub}"
            tl = time.perf_counter()
            W = mod.weight.data
            W_new, mask = prune_layer(method, W, sps[bi], nm_t, stats.pop(sub, None), **options)
            W.copy_(W_new)
            del W_new
            zeros = int((W == 0).sum())
            report.layers[path] = {
                "shape": list(W.shape),
                "target": 1 - nm_t[0] / nm_t[1] if nm_t else sps[bi],
                "zeros": zeros,
                "numel": W.numel(),
                "sparsity": zeros / W.numel(),
                "seconds": time.perf_counter() - tl,
            }
            if on_layer is not None:
                on_layer(path, mod, mask)
        log.info("pruned block %d/%d (%s, sparsity %.3f)", bi + 1, len(blocks), method, sps[bi])
    report.seconds = time.perf_counter() - t0
    return report
