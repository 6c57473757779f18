"""Layer-wise calibration engine: block by block, each block's statistics from the outputs of the already
compressed blocks before it (as both reference codes do); OWL's per-block sparsities; the calibration plan of a
compress run; and ``prune_model``, the whole-model pruning driver of tests and benchmarks.

The parts live in ``blocks`` (catching block 0's inputs, running a block), ``statistics`` (the input taps and
what they collect) and ``stream`` (the windows at the current block); their names are re-exported here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import UserError
from ..model.loading import block_linears, find_blocks
from ..pruning import dispatch
from ..pruning import methods as pruning
from ..pruning.dispatch import METHODS, prune_layer
from ..pruning.nm import parse_nm
from ..pruning.union import UnionGeometry
from .blocks import LoadWeights, capture_block_inputs, device_of, forward_block, non_block_weights
from .statistics import LayerStats, collect_block_stats
from .stream import BlockStream

log = logging.getLogger(__name__)

#: ``on_layer(path, module, mask)`` of :func:`prune_model`
LayerCallback = Callable[[str, nn.Linear, torch.Tensor], None]

__all__ = [
    "find_blocks",
    "block_linears",
    "capture_block_inputs",
    "collect_block_stats",
    "forward_block",
    "LayerStats",
    "BlockStream",
    "owl_block_sparsities",
    "calibrated_blocks",
    "non_block_weights",
    "CalibrationPlan",
    "calibration_plan",
    "load_tokenizer",
    "prune_model",
    "PruneReport",
]

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

    One dense calibration pass (Wanda statistics and the block's outputs from one forward pass, block inputs
    from the dense previous blocks). Returns ``(sparsities, outlier_ratios)``. ``load``: as in
    :func:`calibrated_blocks`.
    """
    ratios = []
    for _, block, stats in _stream_blocks(model, BlockStream(model, samples, device, load), "wanda", device, load,
                                          outputs=True):
        metrics = [pruning.wanda_metric(mod.weight, stats[n].x_sq_norm) for n, mod in block_linears(block)]
        ratios.append(pruning.outlier_ratio(metrics, m))
        del metrics
    return pruning.owl_sparsities(ratios, target, lam), ratios


def calibrated_blocks(
    model: nn.Module, samples: torch.Tensor | None, kind: str | None, device: str | torch.device = "cpu",
    load: LoadWeights | None = None, *, tokens: bool = False, stream: BlockStream | None = None,
) -> Iterator[tuple[int, nn.Module, dict[str, LayerStats]]]:
    """Yield ``(index, block, stats)`` block by block; prune the block's linears before advancing.

    ``kind`` is ``"wanda"``, ``"sparsegpt"``, ``"both"`` or None (no calibration: stats is ``{}``); ``tokens``
    adds each linear's token sample (``LayerStats.tokens``), from the same forward pass. The windows are
    ``samples``, or an open ``stream`` of them (one that something else also runs the blocks on, such as the
    activation-sparsity thresholds: a block it has run is not run again). The block sits on ``device`` while it
    is yielded; when the consumer asks for the next block, the (now pruned) block is run on the current inputs
    to give the next block's inputs (unless it is the last), and is moved back. ``load(module, path)``
    (streaming: the parameters are on the meta device) is a context manager that holds ``module``'s weights
    while open: the embedding part while block 0's inputs are caught, then each block from before its
    statistics until its outputs are computed, so one block is in memory.
    """
    if kind is not None and stream is None:
        if samples is None or samples.numel() == 0:
            raise UserError("calibration samples are needed (--calib)")
        stream = BlockStream(model, samples, device, load)
    return _stream_blocks(model, stream if kind is not None else None, kind, device, load, tokens=tokens)


def _stream_blocks(model: nn.Module, stream: BlockStream | None, kind: str | None, device: str | torch.device,
                   load: LoadWeights | None, tokens: bool = False,
                   outputs: bool = False) -> Iterator[tuple[int, nn.Module, dict[str, LayerStats]]]:
    """:func:`calibrated_blocks` on an open stream (None: no statistics, the blocks only); ``outputs``: the
    statistics pass gives the outputs too (blocks that stay as they are)."""
    device = torch.device(device)
    blocks, prefix = find_blocks(model)
    for bi, block in enumerate(blocks):
        with load(block, f"{prefix}.{bi}") if load is not None else contextlib.nullcontext():
            orig = device_of(block)
            block.to(device)
            try:
                stats = stream.statistics(block, kind, tokens, outputs) if stream is not None else {}
                yield bi, block, stats
                del stats
                if stream is not None:
                    if not stream.ran and bi + 1 < len(blocks):  # the last block's outputs feed nothing
                        stream.run(block)
                    stream.advance()
            finally:
                block.to(orig)


@dataclass
class CalibrationPlan:
    """What the compress pipeline needs for pruning: samples, statistics kind, per-block sparsity."""

    samples: torch.Tensor | None
    kind: str | None
    block_sparsity: list[float]
    info: dict = field(default_factory=dict)  # what the artifact records: the windows' sampling, OWL's figures
    windows: dict = field(default_factory=dict)  # how the windows were sampled (``samples.load_calibration``)


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
    outliers: bool = False,
) -> CalibrationPlan:
    """Load calibration windows when ``prune`` / ``profile`` / ``outliers`` need them, and the per-block
    sparsities.

    ``load``: as in :func:`calibrated_blocks` (streaming: the OWL pass fills one block in at a time).
    ``outliers``: some layer keeps outlier channels, chosen by each input channel's ``x_sq_norm`` (or diag H),
    so the statistics are collected whatever the pruning method.
    """
    from .samples import load_calibration

    if profile not in ("uniform", "owl"):
        raise UserError(f"--sparsity-profile must be uniform or owl, got {profile!r}")
    if profile == "owl" and nm is not None:
        raise UserError("--sparsity-profile owl applies to unstructured sparsity; drop --nm or use uniform")
    blocks, _ = find_blocks(model)
    kind = METHODS[prune].statistics if prune in METHODS else None
    only_outliers = outliers and kind is None and profile != "owl"  # the one reason to calibrate
    if outliers and kind is None:
        kind = "wanda"  # x_sq_norm: what outlier channels are chosen by
    needs = kind is not None or (prune in METHODS and profile == "owl")
    if not needs:
        return CalibrationPlan(None, None, [float(sparsity)] * len(blocks))
    say = note or (lambda _m: None)
    purpose = (" to choose outlier channels (--keep-outliers auto, the default; --keep-outliers 0 needs no "
               "calibration)" if only_outliers else " for calibration")
    tok = tokenizer if tokenizer is not None else load_tokenizer(model_source, purpose=purpose)
    samples, info = load_calibration(calib, tok, nsamples, seqlen, seed, return_info=True)
    say(f"calibration: {nsamples} x {seqlen} tokens from {calib} (seed {seed}), {info.get('mode')} sampling "
        f"from {info.get('documents')} documents")  # after loading: no note before an error line
    windows, info = dict(info), dict(info)
    if profile == "owl":
        say("OWL: outlier ratios on the dense model")
        sps, ratios = owl_block_sparsities(model, samples, sparsity, owl_lambda, owl_m, device, load)
        info["owl_outlier_ratios"] = ratios
        info["owl_lambda"], info["owl_m"] = owl_lambda, owl_m
    else:
        sps = [float(sparsity)] * len(blocks)
    return CalibrationPlan(samples, kind, sps, info, windows)


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
    union: UnionGeometry = None,
) -> PruneReport:
    """Prune every nn.Linear of every decoder block in place, block by block.

    ``method`` is magnitude | wanda | sparsegpt, each layer pruned by ``pruning.dispatch.prune_layer`` as in
    ``compress``. Calibration ``samples`` ([n, seqlen] token ids) are
    needed by wanda, sparsegpt and by ``profile="owl"``. Block i's statistics come from the outputs
    of the already-pruned blocks 0..i-1. ``on_layer(path, module, mask)`` is called right after each
    layer is pruned (path = full module path of the linear, mask True = kept); ``skip(path)`` leaves a
    layer dense. lm_head and embeddings are never pruned. ``union``: IE-BME (tile, areas[, union density]) of
    union-structured masks (``pruning.union``; magnitude and wanda).
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
    if union is not None:
        options["union"] = union
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
