"""Calibration statistics of linear layers' inputs, and the one hook system that gathers them.

:class:`InputTaps` hands each tapped layer's input to its collectors (anything with ``add_batch(x)``) during a
forward pass: pruning's ``x_sq_norm`` (:class:`SqNormAccumulator`) and ``H`` (:class:`HessianAccumulator`,
also GPTQ's and clip search's), quantization's token sample (:class:`TokenSampler`, the activation clip) and
activation sparsity's float16 magnitude counts (``activation_sparsity.calibrate``) all come through it, so what
needs statistics of one forward pass gets them from one forward pass (:func:`collect_block_stats`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..errors import UserError
from ..model.loading import block_linears
from .blocks import run_block

KINDS = ("wanda", "sparsegpt", "both")  # x_sq_norm, H, both
TOKENS_PER_BATCH = 16  # token rows a TokenSampler keeps of each window (the activation clip's sample)


class Collector(Protocol):
    """What a tap feeds: one batch of a layer's inputs at a time."""

    def add_batch(self, x: torch.Tensor) -> None: ...


class InputTaps:
    """Forward hooks handing each tapped module's input (its first argument, detached) to its collectors.

    A context manager: every hook is removed on exit; :meth:`remove` stops tapping one module early.
    """

    def __init__(self) -> None:
        self._handles: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self.collectors: dict[str, list[Collector]] = {}

    def add(self, name: str, module: nn.Module, collector: Collector) -> Collector:
        """Feed ``module``'s inputs to ``collector`` too (one hook per module, whatever the collectors)."""
        if name not in self._handles:
            feed = self.collectors.setdefault(name, [])

            def hook(_m, args, _o) -> None:  # returns None: the module's output is untouched
                x = args[0].detach()
                for c in feed:
                    c.add_batch(x)

            self._handles[name] = module.register_forward_hook(hook)
        self.collectors[name].append(collector)
        return collector

    def remove(self, name: str) -> list[Collector]:
        """Stop tapping ``name``; returns its collectors."""
        h = self._handles.pop(name, None)
        if h is not None:
            h.remove()
        return self.collectors.pop(name, [])

    def close(self) -> None:
        for h in self._handles.values():
            h.remove()
        self._handles.clear()
        self.collectors.clear()

    def __enter__(self) -> InputTaps:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _as_tokens(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[B, T, K]`` or ``[T, K]`` (one sample) -> (``[B*T, K]`` float32, number of samples B)."""
    if x.dim() == 2:
        x = x.unsqueeze(0)
    b = x.shape[0]
    return x.reshape(-1, x.shape[-1]).float(), b


class SqNormAccumulator:
    """Running ``x_sq_norm``: mean over samples of each input channel's squared L2 norm over tokens.

    Same update as the Wanda reference's ``WrappedGPT.add_batch`` (running average over samples).
    """

    def __init__(self, columns: int, device: torch.device | str = "cpu"):
        self.x_sq_norm = torch.zeros(columns, dtype=torch.float32, device=device)
        self.nsamples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        tokens, b = _as_tokens(x)
        self.x_sq_norm *= self.nsamples / (self.nsamples + b)
        self.nsamples += b
        self.x_sq_norm += (
            torch.linalg.vector_norm(tokens.to(self.x_sq_norm.device), dim=0) ** 2 / self.nsamples
        )


class HessianAccumulator:
    """Running ``H = 2/n · Σ x·xᵀ`` over n samples (tokens of all samples summed), float32.

    Same update as the SparseGPT reference's ``add_batch``: ``H *= n/(n+b)``, then add
    ``(sqrt(2/(n+b))·X)ᵀ (sqrt(2/(n+b))·X)``.
    """

    def __init__(self, columns: int, device: torch.device | str = "cpu"):
        self.H = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.nsamples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        tokens, b = _as_tokens(x)
        self.H *= self.nsamples / (self.nsamples + b)
        self.nsamples += b
        tokens = math.sqrt(2 / self.nsamples) * tokens.to(self.H.device)
        self.H += tokens.t() @ tokens


class TokenSampler:
    """Keeps ``per_batch`` random token rows of every batch a layer sees (for activation calibration)."""

    def __init__(self, per_batch: int = 128, seed: int = 0):
        self.per_batch = per_batch
        self.gen = torch.Generator().manual_seed(seed)
        self.rows: list[torch.Tensor] = []

    def add_batch(self, x: torch.Tensor) -> None:
        t = x.detach().reshape(-1, x.shape[-1]).float().cpu()
        idx = torch.randperm(t.shape[0], generator=self.gen)[: self.per_batch]
        self.rows.append(t[idx])

    def tokens(self) -> torch.Tensor | None:
        return torch.cat(self.rows) if self.rows else None


@dataclass
class LayerStats:
    """Calibration statistics of one linear layer's input."""

    x_sq_norm: torch.Tensor | None = None  # [K], Wanda
    H: torch.Tensor | None = None  # [K, K], SparseGPT, GPTQ, clip search
    nsamples: int = 0
    tokens: torch.Tensor | None = None  # [N, K] token sample, the activation clip's

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
    tokens: bool = False,
) -> dict[str, LayerStats]:
    """Per-linear input statistics of ``block`` over ``inps``, from one forward pass (one window at a time).

    ``kind`` is ``"wanda"`` (x_sq_norm), ``"sparsegpt"`` (H) or ``"both"``; ``tokens`` adds a token sample
    (:data:`TOKENS_PER_BATCH` rows of every window). ``linear_names`` are names relative to the block (None =
    every nn.Linear). If ``outs`` is given it receives the block's outputs.
    """
    if kind not in KINDS:
        raise UserError(f"statistics kind must be one of {', '.join(KINDS)}, got {kind!r}")
    modules = dict(block_linears(block))
    names = list(modules) if linear_names is None else list(linear_names)
    missing = [n for n in names if n not in modules]
    if missing:
        raise UserError(f"not linear layers of the block: {missing}")
    with InputTaps() as taps:
        for n in names:
            mod = modules[n]
            if kind in ("wanda", "both"):
                taps.add(n, mod, SqNormAccumulator(mod.in_features, mod.weight.device))
            if kind in ("sparsegpt", "both"):
                taps.add(n, mod, HessianAccumulator(mod.in_features, mod.weight.device))
            if tokens:
                taps.add(n, mod, TokenSampler(TOKENS_PER_BATCH, seed=0))
        run_block(block, inps, kwargs, outs)
        fed = dict(taps.collectors)
    return {n: _layer_stats(fed[n], inps.shape[0]) for n in names}


def _layer_stats(collectors: list[Collector], nsamples: int) -> LayerStats:
    out = LayerStats(nsamples=nsamples)
    for c in collectors:
        if isinstance(c, SqNormAccumulator):
            out.x_sq_norm = c.x_sq_norm
        elif isinstance(c, HessianAccumulator):
            out.H = c.H
        elif isinstance(c, TokenSampler):
            out.tokens = c.tokens()
    return out
