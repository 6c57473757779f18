"""Choosing the next token: greedy at temperature 0, otherwise temperature and nucleus (top-p) sampling from a
seeded generator, so that a seed reproduces the same tokens."""

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


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next token id from the last position's logits ``[V]``: argmax (first of ties) at temperature 0;
    otherwise a draw from softmax(logits / T) restricted to the smallest set of most likely tokens whose
    probability reaches ``top_p`` (the most likely token always stays)."""
    logits = logits.detach().float().cpu()
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    p, idx = torch.sort(probs, descending=True, stable=True)
    if top_p < 1.0:
        keep = (torch.cumsum(p, 0) - p) < top_p
        p = torch.where(keep, p, torch.zeros((), dtype=p.dtype))
    return int(idx[torch.multinomial(p, 1, generator=generator)])
