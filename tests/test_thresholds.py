"""TEAL thresholds: exact quantiles, the streaming histogram, and the block-wise greedy profile."""

from __future__ import annotations

import math

import numpy as np
import pytest
from unionsparse.compressor.activation_sparsity.thresholds import (
    ActivationHistogram,
    greedy_profile,
    tau_from_samples,
    taus_for_profile,
)


@pytest.mark.parametrize("p", [0.0, 0.1, 0.3, 0.5, 0.77, 0.99])
def test_tau_prunes_exactly_ceil_pn_distinct_samples(p):
    rng = np.random.default_rng(0)
    a = rng.permutation(np.arange(1, 1001, dtype=np.float32)) * (-1) ** rng.integers(0, 2, 1000)
    tau = tau_from_samples(a, p)
    assert int((np.abs(a) <= tau).sum()) == math.ceil(p * 1000)
    assert tau == (0.0 if p == 0 else float(math.ceil(p * 1000)))


def test_tau_matches_the_half_normal_quantile():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(400_000) * 2.0
    tau = tau_from_samples(np.abs(x), 0.4)
    # |N(0, 2^2)| quantile at 0.4 = 2 * Phi^-1(0.7) = 2 * 0.5244005
    assert abs(tau - 2 * 0.5244005127080407) < 0.01
    fresh = rng.standard_normal(400_000) * 2.0
    assert abs((np.abs(fresh) <= tau).mean() - 0.4) < 0.005


def test_tau_rejects_bad_input():
    with pytest.raises(ValueError):
        tau_from_samples(np.ones(3), 1.0)
    with pytest.raises(ValueError):
        tau_from_samples(np.array([]), 0.5)
    with pytest.raises(ValueError):
        tau_from_samples(np.array([1.0, np.nan]), 0.5)


def test_histogram_equals_exact_quantile_of_fp16_values_streamed_in_batches():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((3000, 64)) * np.exp(rng.standard_normal(64))).astype(np.float32)
    h = ActivationHistogram(64, reservoir=100)
    for part in np.array_split(x, 7):
        h.update(part.reshape(-1, 1, 64))  # any leading shape
    assert h.total == x.size
    x16 = x.astype(np.float16).astype(np.float32)
    for p in (0.0, 0.25, 0.5, 0.9):
        assert h.tau(p) == tau_from_samples(x16, p)
        if p > 0:
            assert h.sparsity_at(h.tau(p)) == (np.abs(x16) <= h.tau(p)).mean()
    assert h.rows.shape == (100, 64)
    assert h.counts.nbytes < 300_000  # bounded, independent of the tokens seen


def test_histogram_reservoir_is_uniform_and_width_checked():
    h = ActivationHistogram(reservoir=500, seed=3)
    rows = np.repeat(np.arange(10_000, dtype=np.float32)[:, None], 4, axis=1)
    for part in np.array_split(rows, 20):
        h.update(part)
    kept = h.rows[:, 0].astype(np.float32)
    assert h.rows.shape == (500, 4)
    assert 3500 < kept.mean() < 6500  # a prefix-only reservoir would average ~250
    with pytest.raises(ValueError):
        h.update(np.zeros((2, 5)))


def _quadratic_error(c):
    return lambda s: sum(c[n] * s[n] ** 2 for n in c)


def test_greedy_hits_target_and_favours_insensitive_layers():
    c = {"q": 1.0, "k": 4.0, "v": 0.25, "o": 2.0}
    w = {"q": 100.0, "k": 100.0, "v": 100.0, "o": 100.0}
    prof = greedy_profile(w, _quadratic_error(c), target=0.5, step=0.05)
    avg = sum(w[n] * prof[n] for n in w) / sum(w.values())
    assert avg == pytest.approx(0.5, abs=1e-12)
    assert prof["v"] > prof["q"] > prof["o"] > prof["k"]
    assert prof["v"] == pytest.approx(0.95)  # capped at max_sparsity
    # below the cap, the greedy equalises the marginal costs c * s to within one step
    for a, b in (("q", "o"), ("o", "k"), ("q", "k")):
        assert abs(c[a] * prof[a] - c[b] * prof[b]) <= 0.05 * max(c[a], c[b]) + 1e-9


def test_greedy_weighted_average_with_unequal_layer_sizes():
    w = {"up": 3.0, "gate": 3.0, "down": 1.0}
    prof = greedy_profile(w, lambda s: s["up"] + 2 * s["gate"] + 0.1 * s["down"], target=0.4, step=0.1,
                          max_sparsity=0.9)
    assert sum(w[n] * prof[n] for n in w) / 7.0 == pytest.approx(0.4, abs=1e-12)
    assert prof["down"] == pytest.approx(0.9)
    assert all(0 <= v <= 0.9 for v in prof.values())


def test_greedy_on_real_matmul_error_with_histogram_taus():
    rng = np.random.default_rng(4)
    layers = {"a": rng.standard_normal((32, 16)), "b": rng.standard_normal((32, 16)) * 5}
    hists = {n: ActivationHistogram(16) for n in layers}
    xs = rng.standard_normal((512, 16)).astype(np.float32)
    for h in hists.values():
        h.update(xs)

    def err(s):
        tot = 0.0
        for n, W in layers.items():
            t = hists[n].tau(s[n])
            xp = np.where(np.abs(xs) > t, xs, 0)
            tot += float(((xp - xs) @ W.T).var())
        return tot

    prof = greedy_profile({"a": 512, "b": 512}, err, target=0.3)
    assert (prof["a"] + prof["b"]) / 2 == pytest.approx(0.3, abs=1e-12)
    assert prof["a"] > prof["b"]  # layer b amplifies the pruning error 25x
    taus = taus_for_profile(hists, prof)
    assert abs(hists["a"].sparsity_at(taus["a"]) - prof["a"]) < 1e-3


def test_greedy_rejects_bad_arguments():
    with pytest.raises(ValueError):
        greedy_profile({}, lambda s: 0.0, 0.5)
    with pytest.raises(ValueError):
        greedy_profile({"a": 1.0}, lambda s: 0.0, 0.97)
    with pytest.raises(ValueError):
        greedy_profile({"a": 0.0}, lambda s: 0.0, 0.5)
