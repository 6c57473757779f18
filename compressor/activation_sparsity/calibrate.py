"""Activation-sparsity (TEAL) threshold calibration inside ``compress``, for any static pruning method.

A second calibration stream (``--act-sparsity-calib``, Alpaca by default, ``--nsamples`` x ``--seqlen`` tokens)
runs through the model block by block *after* each block has been pruned (and quantized), so every
linear layer's input distribution is the one the compressed model produces at that layer. The stream is
independent of the Wanda/SparseGPT statistics pass, so it works with ``--prune magnitude`` and ``none``
too. Activation sparsity is not applied to earlier layers while calibrating (TEAL's procedure).

Per block (:meth:`ThresholdCalibrator.block`):

1. Forward the stream through the pruned block; a hook on every linear counts its inputs' float16
   magnitudes into an exact histogram (on the calibration device, one counter per fp16 bit pattern).
2. Per-layer sparsities: ``uniform`` gives every layer the target; ``greedy`` runs
   :func:`~.thresholds.greedy_profile` with the block error = mean squared difference of the block's
   outputs with and without activation sparsity, on the first :data:`GREEDY_SEQUENCES` stream sequences.
3. tau_l = the layer's ``|x|`` quantile at its sparsity (:meth:`~.thresholds.ActivationHistogram.tau`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..calibrate.layerwise import capture_block_inputs, forward_block, load_tokenizer
from ..errors import UserError
from ..model.loading import block_linears
from .thresholds import _N_FINITE_F16, ActivationHistogram, greedy_profile

GREEDY_SEQUENCES = 16  # stream sequences on which the greedy search scores the block output error
_N_BINS = 0x8000  # every fp16 magnitude bit pattern: finite 0..0x7BFF, inf 0x7C00, NaN above


def sparsify_input(x: torch.Tensor, tau: float | torch.Tensor | None) -> torch.Tensor:
    """The decode kernel's view of an input: rounded to float16, and (tau given) zero where
    ``|x| > tau`` fails, the test done in float32 (docs/format.md, "Tiled-CBC"). Returned as float32."""
    xh = x.to(torch.float16).float()
    if tau is None:
        return xh
    t = tau if isinstance(tau, torch.Tensor) else torch.tensor(float(tau), dtype=torch.float32, device=x.device)
    return torch.where(xh.abs() > t, xh, torch.zeros((), dtype=xh.dtype, device=xh.device))


def _bin_counts(x: torch.Tensor) -> torch.Tensor:
    """Counts of each float16 magnitude bit pattern of ``x`` (int64 [0x8000], on x's device)."""
    bits = x.detach().reshape(-1).to(torch.float16).view(torch.int16).to(torch.int32) & 0x7FFF
    return torch.bincount(bits, minlength=_N_BINS)


class ThresholdCalibrator:
    """The activation-sparsity calibration stream of one ``compress`` run (see the module docstring)."""

    def __init__(self, model: nn.Module, source: str, model_source: str, nsamples: int, seqlen: int, seed: int,
                 target: float, profile: str = "uniform", device: str | torch.device = "cpu",
                 note: Callable[[str], None] | None = None, tokenizer=None) -> None:
        from ..calibrate.samples import load_calibration

        if profile not in ("uniform", "greedy"):
            raise UserError(f"--act-sparsity-profile: unknown value {profile!r} (choose from uniform, greedy)")
        self.target, self.profile = float(target), profile
        self.device = torch.device(device)
        say = note or (lambda _m: None)
        tok = tokenizer if tokenizer is not None else load_tokenizer(model_source)
        try:
            samples, info = load_calibration(source, tok, nsamples, seqlen, seed, return_info=True)
        except UserError as e:  # the loader names --calib; this stream is --act-sparsity-calib
            raise UserError(str(e).replace("--calib ", "--act-sparsity-calib ")) from None
        say(f"dynamic pruning: {nsamples} x {seqlen} tokens from {source} (seed {seed}), {profile} profile")
        self.info = {**dict(info), "dp_sparsity": self.target, "dp_profile": profile,
                     "greedy_sequences": min(GREEDY_SEQUENCES, nsamples) if profile == "greedy" else None}
        self.inps, self.kwargs = capture_block_inputs(model, samples, self.device)
        self.outs = torch.empty_like(self.inps)

    @torch.no_grad()
    def block(self, block: nn.Module, names: dict[str, str]) -> dict[str, dict]:
        """Calibrate one pruned block (on the calibration device) and advance the stream past it.

        ``names`` maps the block's linear names (relative) to their full module paths; returns the extra
        layer attrs ``{full path: {dp_threshold, dp_sparsity, dp_calib_sparsity, dp_profile}}``.
        """
        linears = [(n, m) for n, m in block_linears(block) if n in names]
        counts = {n: torch.zeros(_N_BINS, dtype=torch.int64, device=self.device) for n, _ in linears}

        def count(n: str):
            def hook(_m, args, _o) -> None:  # returns None: the layer's output is untouched
                counts[n].add_(_bin_counts(args[0]))
            return hook

        handles = [m.register_forward_hook(count(n)) for n, m in linears]
        try:
            forward_block(block, self.inps, self.kwargs, self.outs)
        finally:
            for h in handles:
                h.remove()
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
        self.inps, self.outs = self.outs, self.inps
        return out

    def _block_error(self, block: nn.Module, linears, hists: dict[str, ActivationHistogram],
                     s: dict[str, float]) -> float:
        """Mean squared difference of the block's outputs with dynamic pruning at ``s`` and without."""
        g = min(GREEDY_SEQUENCES, self.inps.shape[0])
        taus = {n: torch.tensor(hists[n].tau(s[n]), dtype=torch.float32, device=self.device) for n, _ in linears}
        handles = [m.register_forward_pre_hook(lambda _m, a, n=n: (sparsify_input(a[0], taus[n]).to(a[0].dtype),))
                   for n, m in linears]
        try:
            got = forward_block(block, self.inps[:g], self.kwargs)
        finally:
            for h in handles:
                h.remove()
        return float(((got.float() - self.outs[:g].float()) ** 2).mean())

    def close(self) -> None:
        self.inps = self.outs = None
