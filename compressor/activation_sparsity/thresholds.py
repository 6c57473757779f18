"""Activation-sparsity thresholds (TEAL) for Tiled-CBC decode.

At decode the spMspV kernel treats input k as active iff ``|x_k| > tau`` (docs/format.md, "Tiled-CBC"). TEAL picks
``tau`` per layer as the quantile of ``|x|`` at the target dynamic sparsity, read off the empirical
distribution (ECDF) of the layer's input activations on calibration text.

* :func:`tau_from_samples` - the quantile of a sample, exact: the returned tau leaves exactly
  ``ceil(p * n)`` of the n samples at ``|x| <= tau`` (fewer only where ties straddle the cut).
* :class:`ActivationHistogram` - a streaming accumulator, one per linear layer. The kernel reads x as
  float16, so the ECDF is kept exactly over the 31,745 finite non-negative float16 magnitudes (one
  int64 counter per bit pattern, 248 KiB a layer, independent of the number of tokens seen). It also
  keeps a bounded uniform reservoir of whole input rows for :func:`greedy_profile`.
* :func:`greedy_profile` - TEAL's block-wise greedy allocation of sparsity between the linear layers of
  one block (``--dp-profile greedy``); the exact procedure is in its docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import UserError

# float16 bit patterns 0x0000..0x7BFF are the finite non-negative values, in increasing order
_N_FINITE_F16 = 0x7C00
_F16_MAGNITUDES = np.arange(_N_FINITE_F16, dtype=np.uint16).view(np.float16).astype(np.float32)


def _check_sparsity(p: float, name: str = "dp_sparsity") -> float:
    p = float(p)
    if not 0.0 <= p < 1.0 or math.isnan(p):
        raise UserError(f"{name} must be in [0, 1), got {p}")
    return p


def tau_from_samples(abs_x_samples: np.ndarray, dp_sparsity: float) -> float:
    """Threshold tau such that a fraction ``dp_sparsity`` of the samples has ``|x| <= tau``.

    tau is the order statistic ``sorted(|x|)[ceil(p*n) - 1]`` as float32, so exactly ``ceil(p*n)``
    samples (more only with ties at tau) are pruned by the kernel's test ``|x| > tau``. ``p = 0`` gives
    tau = 0.0, which prunes only inputs that are exactly zero and so leaves every output unchanged.
    """
    p = _check_sparsity(dp_sparsity)
    a = np.abs(np.asarray(abs_x_samples, dtype=np.float32).ravel())
    if a.size == 0:
        raise UserError("tau_from_samples needs at least one sample")
    if np.isnan(a).any():
        raise UserError("activation samples contain NaN")
    k = math.ceil(p * a.size)
    if k == 0:
        return 0.0
    return float(np.partition(a, k - 1)[k - 1])


class ActivationHistogram:
    """Streaming ECDF of ``|x|`` (exact over float16 magnitudes) and a reservoir of input rows.

    ``update(x)`` takes any array whose last axis is the layer's input dimension (a torch tensor or
    numpy array: [tokens, K] or [batch, seq, K]); values are rounded to float16 as the kernel sees them,
    and magnitudes beyond the float16 range count in the top (overflow) bin. Memory per layer: 248 KiB of
    counters plus ``reservoir`` rows of K float16 values.
    """

    def __init__(self, in_features: int | None = None, reservoir: int = 256, seed: int = 0) -> None:
        self.counts = np.zeros(_N_FINITE_F16 + 1, dtype=np.int64)  # last bin: |x| >= 65520 or inf
        self.in_features = in_features
        self.capacity = int(reservoir)
        self.rows: np.ndarray | None = None
        self._seen_rows = 0
        self._rng = np.random.default_rng(seed)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def update(self, x) -> None:
        if hasattr(x, "detach"):  # torch tensor, without importing torch here
            x = x.detach().to("cpu").float().numpy()
        a = np.asarray(x)
        if a.ndim == 0:
            raise UserError("ActivationHistogram.update needs an array of activations")
        k = a.shape[-1]
        if self.in_features is None:
            self.in_features = k
        elif k != self.in_features:
            raise UserError(f"activation width {k} does not match the layer's {self.in_features}")
        rows = a.reshape(-1, k).astype(np.float16)
        if np.isnan(rows).any():
            raise UserError("activations contain NaN")
        bits = (rows.view(np.uint16) & np.uint16(0x7FFF)).ravel()
        self.counts += np.bincount(np.minimum(bits, _N_FINITE_F16), minlength=_N_FINITE_F16 + 1)
        self._reservoir_add(rows)

    def _reservoir_add(self, rows: np.ndarray) -> None:
        if self.capacity <= 0:
            return
        if self.rows is None:
            self.rows = np.zeros((0, rows.shape[1]), dtype=np.float16)
        take = min(self.capacity - self.rows.shape[0], rows.shape[0])
        if take > 0:
            self.rows = np.concatenate([self.rows, rows[:take]])
        # Algorithm R for the rest: row number t (0-based) replaces a slot with probability cap/(t+1)
        t = self._seen_rows + take + np.arange(rows.shape[0] - take)
        slot = np.floor(self._rng.random(t.size) * (t + 1)).astype(np.int64)
        hit = slot < self.capacity
        for s, r in zip(slot[hit], np.nonzero(hit)[0] + take, strict=True):
            self.rows[s] = rows[r]
        self._seen_rows += rows.shape[0]

    def add_counts(self, counts: np.ndarray) -> None:
        """Add per-bin counts computed elsewhere (e.g. on the GPU): one count per float16 magnitude bit
        pattern 0x0000..0x7BFF, then the overflow bin (as :attr:`counts`)."""
        c = np.asarray(counts, dtype=np.int64)
        if c.shape != self.counts.shape or (c < 0).any():
            raise UserError(f"counts must be {self.counts.shape[0]} non-negative integers, got shape {c.shape}")
        self.counts += c

    def merge(self, other: ActivationHistogram) -> None:
        """Add another accumulator's counts (e.g. from another worker); reservoirs are concatenated
        and cut to capacity, which keeps them uniform only when both saw equally many rows."""
        self.counts += other.counts
        if other.rows is not None:
            rows = other.rows if self.rows is None else np.concatenate([self.rows, other.rows])
            self.rows = rows[: self.capacity]
        self._seen_rows += other._seen_rows

    def tau(self, dp_sparsity: float) -> float:
        """Same rule as :func:`tau_from_samples` on every value seen (exact, not an estimate)."""
        p = _check_sparsity(dp_sparsity)
        n = self.total
        if n == 0:
            raise UserError("ActivationHistogram.tau called before any update")
        k = math.ceil(p * n)
        if k == 0:
            return 0.0
        idx = int(np.searchsorted(np.cumsum(self.counts), k))  # first bin whose cumulative count >= k
        return float(np.inf) if idx >= _N_FINITE_F16 else float(_F16_MAGNITUDES[idx])

    def sparsity_at(self, tau: float) -> float:
        """Fraction of the values seen with ``|x| <= tau`` (what the kernel would skip)."""
        n = self.total
        if n == 0:
            raise UserError("ActivationHistogram.sparsity_at called before any update")
        below = int(self.counts[:_N_FINITE_F16][_F16_MAGNITUDES <= np.float32(tau)].sum())
        if tau == float("inf"):
            below += int(self.counts[-1])
        return below / n


def greedy_profile(
    weights: Mapping[str, float],
    block_error: Callable[[dict[str, float]], float],
    target: float,
    step: float = 0.05,
    max_sparsity: float = 0.95,
) -> dict[str, float]:
    """TEAL's block-wise greedy search for per-layer dynamic sparsities inside one block.

    ``weights[name]`` is each linear layer's parameter count (M*K: the block's average sparsity is
    ``sum(w_l * s_l) / sum(w_l)``, the fraction of the block's weight reads skipped); ``block_error(s)``
    returns the block's output error (e.g. the MSE of the block output against the dense block) when
    layer l's inputs are pruned at sparsity ``s[l]`` (through ``ActivationHistogram.tau``).

    Procedure: start from s_l = 0 for every layer. While the average is below ``target``: for every
    layer that can still move, evaluate ``block_error`` with that layer raised by ``step`` (capped at
    ``max_sparsity``) and the others unchanged; take the move with the smallest error (ties: the first
    layer in ``weights`` order). The move that would carry the average past the target is shortened so
    that the average lands exactly on ``target``. Costs about ``target / step * L**2`` evaluations for
    L layers of equal size (each round moves one layer by ``step`` and scores all L moves).
    """
    t = _check_sparsity(target, "target")
    if not 0.0 < step <= 1.0:
        raise UserError(f"step must be in (0, 1], got {step}")
    if not 0.0 < max_sparsity < 1.0:
        raise UserError(f"max_sparsity must be in (0, 1), got {max_sparsity}")
    names = list(weights)
    if not names:
        raise UserError("greedy_profile needs at least one layer")
    w = np.array([float(weights[n]) for n in names])
    if (w <= 0).any():
        raise UserError("layer weights (parameter counts) must be positive")
    if t > max_sparsity:
        raise UserError(f"target {t} exceeds max_sparsity {max_sparsity}")
    wsum = w.sum()
    s = dict.fromkeys(names, 0.0)

    def average(prof: dict[str, float]) -> float:
        return float(sum(w[i] * prof[n] for i, n in enumerate(names)) / wsum)

    while average(s) < t - 1e-12:
        best: tuple[float, str, float] | None = None
        for i, n in enumerate(names):
            if s[n] >= max_sparsity:
                continue
            new = min(s[n] + step, max_sparsity)
            short = s[n] + (t - average(s)) * wsum / w[i]  # the value that lands exactly on target
            new = min(new, short)
            cand = dict(s)
            cand[n] = new
            err = float(block_error(cand))
            if best is None or err < best[0]:
                best = (err, n, new)
        if best is None:  # every layer at max_sparsity; cannot happen since target <= max_sparsity
            break
        s[best[1]] = best[2]
    return s


def taus_for_profile(
    hists: Mapping[str, ActivationHistogram], profile: Mapping[str, float]
) -> dict[str, float]:
    """Per-layer tau from each layer's histogram at its profiled sparsity."""
    return {n: hists[n].tau(profile[n]) for n in profile}
