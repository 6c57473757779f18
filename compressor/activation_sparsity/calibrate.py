"""Activation-sparsity (TEAL) threshold calibration inside ``compress``, for any static pruning method.

A calibration stream (``--act-sparsity-calib``, Alpaca by default, ``--nsamples`` x ``--seqlen`` tokens) runs
through the model block by block *after* each block has been pruned (and quantized), so every linear layer's
input distribution is the one the compressed model produces at that layer. It is a stream of its own, which
works with ``--prune magnitude`` and ``none`` too; when it names the text of the Wanda/SparseGPT statistics
(``--calib``), it is that stream, and the pass that advances it past a compressed block gives the counts (one
forward of the block, not two). Activation sparsity is not applied to earlier layers while calibrating
(TEAL's procedure).

Per block (:meth:`ThresholdCalibrator.block`):

1. Forward the stream through the pruned block; a tap on every linear (``calibrate.statistics.InputTaps``)
   counts its inputs' float16 magnitudes into an exact histogram (on the calibration device, one counter per
   fp16 bit pattern).
2. Per-layer sparsities: ``uniform`` gives every layer the target; ``greedy`` runs
   :func:`~.thresholds.greedy_profile` with the block error = mean squared difference of the block's
   outputs with and without activation sparsity, on the first :data:`GREEDY_SEQUENCES` stream sequences.
3. tau_l = the layer's ``|x|`` quantile at its sparsity (:meth:`~.thresholds.ActivationHistogram.tau`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...formats.arithmetic.sparse_inputs import sparsify_input
from ..calibrate.blocks import LoadWeights, forward_block
from ..calibrate.layerwise import load_tokenizer
from ..calibrate.statistics import InputTaps
from ..calibrate.stream import BlockStream
from ..errors import UserError
from ..model.loading import block_linears
from .thresholds import _N_FINITE_F16, ActivationHistogram, greedy_profile

GREEDY_SEQUENCES = 16  # stream sequences on which the greedy search scores the block output error
_N_BINS = 0x8000  # every fp16 magnitude bit pattern: finite 0..0x7BFF, inf 0x7C00, NaN above


def _bin_counts(x: torch.Tensor) -> torch.Tensor:
    """Counts of each float16 magnitude bit pattern of ``x`` (int64 [0x8000], on x's device)."""
    bits = x.detach().reshape(-1).to(torch.float16).view(torch.int16).to(torch.int32) & 0x7FFF
    return torch.bincount(bits, minlength=_N_BINS)


class MagnitudeCounts:
    """Counts of each float16 magnitude bit pattern of a layer's inputs (a ``statistics.InputTaps`` collector)."""

    def __init__(self, device: torch.device) -> None:
        self.counts = torch.zeros(_N_BINS, dtype=torch.int64, device=device)

    def add_batch(self, x: torch.Tensor) -> None:
        self.counts.add_(_bin_counts(x))


class ThresholdCalibrator:
    """The activation-sparsity calibration of one ``compress`` run (see the module docstring) on ``stream``.

    ``shared``: the stream is the pruning statistics' own (the same windows), which runs and advances past each
    block itself; the thresholds then take their counts from the pass that advances it. Otherwise the
    calibrator owns its stream (:meth:`from_text`) and advances it.
    """

    def __init__(self, stream: BlockStream, info: dict, target: float, profile: str = "uniform",
                 shared: bool = False) -> None:
        if profile not in ("uniform", "greedy"):
            raise UserError(f"--act-sparsity-profile: unknown value {profile!r} (choose from uniform, greedy)")
        self.stream, self.shared = stream, shared
        self.target, self.profile = float(target), profile
        self.device = stream.inps.device
        n = stream.inps.shape[0]
        self.info = {**dict(info), "dp_sparsity": self.target, "dp_profile": profile,
                     "greedy_sequences": min(GREEDY_SEQUENCES, n) if profile == "greedy" else None}

    @classmethod
    def from_text(cls, model: nn.Module, source: str, model_source: str, nsamples: int, seqlen: int, seed: int,
                  target: float, profile: str = "uniform", device: str | torch.device = "cpu",
                  note: Callable[[str], None] | None = None, tokenizer=None,
                  load: LoadWeights | None = None) -> ThresholdCalibrator:
        """A calibrator on its own stream of ``source`` text (``--act-sparsity-calib``)."""
        from ..calibrate.samples import load_calibration

        if profile not in ("uniform", "greedy"):
            raise UserError(f"--act-sparsity-profile: unknown value {profile!r} (choose from uniform, greedy)")
        tok = tokenizer if tokenizer is not None else load_tokenizer(model_source)
        try:
            samples, info = load_calibration(source, tok, nsamples, seqlen, seed, return_info=True)
        except UserError as e:  # the loader names --calib; this stream is --act-sparsity-calib
            raise UserError(str(e).replace("--calib ", "--act-sparsity-calib ")) from None
        announce(note, source, nsamples, seqlen, seed, profile)
        return cls(BlockStream(model, samples, device, load), info, target, profile)

    @torch.no_grad()
    def block(self, block: nn.Module, names: dict[str, str]) -> dict[str, dict]:
        """Calibrate one pruned block (on the calibration device); the stream, its own, moves past it.

        ``names`` maps the block's linear names (relative) to their full module paths; returns the extra
        layer attrs ``{full path: {dp_threshold, dp_sparsity, dp_calib_sparsity, dp_profile}}``.
        """
        linears = [(n, m) for n, m in block_linears(block) if n in names]
        with InputTaps() as taps:
            counts = {n: taps.add(n, m, MagnitudeCounts(self.device)).counts for n, m in linears}
            self.stream.run(block)
        hists = {}
        for n, mod in linears:
            c = counts[n].cpu().numpy()
            if c[_N_FINITE_F16 + 1:].any():
                raise UserError(f"MODEL: layer {names[n]} has NaN inputs on the --act-sparsity-calib text")
            h = ActivationHistogram(mod.in_features, reservoir=0)
            h.add_counts(c[: _N_FINITE_F16 + 1])  # inf (0x7C00) is the histogram's overflow bin
            hists[n] = h
        if self.profile == "greedy":
            sizes = {n: float(m.in_features * m.out_features) for n, m in linears}
            prof = greedy_profile(sizes, lambda s: self._block_error(block, linears, hists, s), self.target)
        else:
            prof = {n: self.target for n, _ in linears}
        out = {}
        for n, _ in linears:
            tau = hists[n].tau(prof[n])
            out[names[n]] = {"dp_threshold": tau, "dp_sparsity": prof[n], "dp_profile": self.profile,
                             "dp_calib_sparsity": hists[n].sparsity_at(tau)}
        if not self.shared:
            self.stream.advance()
        return out

    def _block_error(self, block: nn.Module, linears, hists: dict[str, ActivationHistogram],
                     s: dict[str, float]) -> float:
        """Mean squared difference of the block's outputs with dynamic pruning at ``s`` and without."""
        inps, outs = self.stream.inps, self.stream.outs
        g = min(GREEDY_SEQUENCES, inps.shape[0])
        taus = {n: torch.tensor(hists[n].tau(s[n]), dtype=torch.float32, device=self.device) for n, _ in linears}
        handles = [m.register_forward_pre_hook(lambda _m, a, n=n: (sparsify_input(a[0], taus[n]).to(a[0].dtype),))
                   for n, m in linears]
        try:
            got = forward_block(block, inps[:g], self.stream.kwargs)
        finally:
            for h in handles:
                h.remove()
        return float(((got.float() - outs[:g].float()) ** 2).mean())

    def close(self) -> None:
        if not self.shared:
            self.stream.close()


def announce(note: Callable[[str], None] | None, source: str, nsamples: int, seqlen: int, seed: int,
             profile: str) -> None:
    """The note that says where the thresholds' calibration text comes from."""
    if note is not None:
        note(f"dynamic pruning: {nsamples} x {seqlen} tokens from {source} (seed {seed}), {profile} profile")
