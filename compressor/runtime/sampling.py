"""Choosing the next token: greedy at temperature 0, otherwise temperature and nucleus (top-p) sampling from a
seeded generator, so that a seed reproduces the same tokens on the same device. :func:`choose` runs where
the logits are (on a GPU no token reaches the host to be chosen)."""

from __future__ import annotations

import math

import torch

from ..errors import UserError


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """``UserError`` naming the first argument out of range."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be a positive integer, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise UserError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise UserError(f"--top-p must lie in (0, 1], got {top_p!r}")


def choose(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator | None) -> torch.Tensor:
    """The next token of every row of ``logits`` [B, V], as a long tensor [B] on their device (no host copy):
    argmax (first of ties) at temperature 0; otherwise a draw from softmax(logits / T) restricted to the
    smallest set of most likely tokens whose probability reaches ``top_p`` (the most likely token always
    stays), from ``generator`` (on the logits' device)."""
    logits = logits.float()
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    p, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    if top_p < 1.0:
        p = torch.where((torch.cumsum(p, -1) - p) < top_p, p, torch.zeros((), dtype=p.dtype, device=p.device))
    return idx.gather(-1, torch.multinomial(p, 1, generator=generator))[:, 0]


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """:func:`choose` for the last position's logits ``[V]`` of one sequence, as a Python int."""
    return int(choose(logits.detach().reshape(1, -1), temperature, top_p, generator)[0])
