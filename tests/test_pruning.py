"""Pruning masks: magnitude, Wanda, SparseGPT (against an independent float64 OBS loop), N:M, OWL."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from unionsparse.compressor.calibrate import statistics
from unionsparse.compressor.errors import UserError
from unionsparse.compressor.pruning import methods as pruning
from unionsparse.compressor.pruning.nm import parse_nm


def _correlated_inputs(n_tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """Activations with correlated channels and a few large-magnitude outlier channels (as in LLMs)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(n_tokens, k, generator=g) @ mix
    outliers = torch.randperm(k, generator=g)[: max(1, k // 16)]
    x[:, outliers] *= 20.0
    return x


# ------------------------------------------------------------------ magnitude / Wanda


def test_magnitude_hand_case():
    W = torch.tensor([[1.0, -3.0, 2.0, 0.5], [4.0, -1.0, -1.0, 2.0]])
    # row 0: |W| = 1, 3, 2, .5 -> prune the two smallest: cols 3, 0
    # row 1: |W| = 4, 1, 1, 2 -> prune cols 1 and 2 (tie between them, both pruned)
    expected = torch.tensor([[False, True, True, False], [True, False, False, True]])
    assert torch.equal(pruning.magnitude(W, 0.5), expected)


def test_wanda_hand_case_differs_from_magnitude():
    W = torch.tensor([[1.0, -3.0, 2.0, 0.5], [4.0, -1.0, -1.0, 2.0]])
    x_sq_norm = torch.tensor([1.0, 0.01, 4.0, 100.0])  # sqrt: 1, .1, 2, 10
    # row 0 metric: 1, .3, 4, 5 -> prune cols 1, 0 ; row 1 metric: 4, .1, 2, 20 -> prune cols 1, 2
    expected = torch.tensor([[False, False, True, True], [True, False, False, True]])
    mask = pruning.wanda(W, x_sq_norm, 0.5)
    assert torch.equal(mask, expected)
    assert not torch.equal(mask, pruning.magnitude(W, 0.5))


def test_wanda_stable_sort_ties_prune_lower_index_first():
    W = torch.ones(3, 8)
    mask = pruning.wanda(W, torch.ones(8), 0.25)  # int(8 * .25) = 2 pruned per row
    expected = torch.ones(3, 8, dtype=torch.bool)
    expected[:, :2] = False
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("sparsity", [0.0, 0.37, 0.5, 0.9])
def test_per_row_sparsity_exact(sparsity):
    g = torch.Generator().manual_seed(1)
    W = torch.randn(64, 200, generator=g)
    x = torch.rand(200, generator=g)
    k = int(200 * sparsity)
    for mask in (pruning.wanda(W, x, sparsity), pruning.magnitude(W, sparsity)):
        assert mask.dtype == torch.bool
        assert torch.equal((~mask).sum(1), torch.full((64,), k))
    # the pruned entries of each row are exactly its k lowest metrics
    metric = W.abs() * x.sqrt()
    mask = pruning.wanda(W, x, sparsity)
    if 0 < k < 200:
        pruned_max = metric.masked_fill(mask, -float("inf")).max(1).values
        kept_min = metric.masked_fill(~mask, float("inf")).min(1).values
        assert torch.all(pruned_max <= kept_min)


def test_accumulators_match_definitions():
    g = torch.Generator().manual_seed(2)
    batches = [torch.randn(b, 7, 5, generator=g) for b in (1, 3, 2)] + [torch.randn(7, 5, generator=g)]
    sq, hs = statistics.SqNormAccumulator(5), statistics.HessianAccumulator(5)
    for b in batches:
        sq.add_batch(b)
        hs.add_batch(b)
    samples = torch.cat([b.reshape(-1, 7, 5) for b in batches]).double()  # [7 samples, 7 tokens, 5]
    n = samples.shape[0]
    assert sq.nsamples == hs.nsamples == n
    want_sq = (samples**2).sum(1).mean(0)  # mean over samples of the squared norm over tokens
    want_h = 2.0 / n * sum(s.T @ s for s in samples)
    assert torch.allclose(sq.x_sq_norm.double(), want_sq, rtol=1e-5)
    assert torch.allclose(hs.H.double(), want_h, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ N:M


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)])
def test_nm_masks_valid(n, m):
    g = torch.Generator().manual_seed(3)
    W = torch.randn(24, 64, generator=g)
    x = _correlated_inputs(256, 64)
    xn = (x**2).sum(0)
    H = 2 * x.T @ x / 256
    masks = {
        "magnitude": pruning.magnitude(W, 0.5, nm=(n, m)),
        "wanda": pruning.wanda(W, xn, 0.5, nm=f"{n}:{m}"),
        "sparsegpt": pruning.sparsegpt(W, H, 0.5, nm=(n, m))[1],
    }
    for name, mask in masks.items():
        kept = mask.reshape(24, 64 // m, m).sum(2)
        assert torch.all(kept == n), name
    # magnitude / Wanda keep the N highest metrics of every group
    metric = (W.abs() * xn.sqrt()).reshape(24, -1, m)
    kept_min = metric.masked_fill(~masks["wanda"].reshape(24, -1, m), float("inf")).min(2).values
    pruned_max = metric.masked_fill(masks["wanda"].reshape(24, -1, m), -float("inf")).max(2).values
    assert torch.all(kept_min >= pruned_max)


def test_nm_errors():
    W = torch.randn(4, 10)
    with pytest.raises(UserError, match="multiple of 4"):
        pruning.magnitude(W, 0.5, nm=(2, 4))
    with pytest.raises(UserError, match="N:M"):
        parse_nm("4:2")
    with pytest.raises(UserError, match="N:M"):
        parse_nm("two:four")
    with pytest.raises(UserError, match="sparsity"):
        pruning.wanda(W, torch.ones(10), 1.0)


# ------------------------------------------------------------------ SparseGPT


def _reference_obs(W: np.ndarray, H: np.ndarray, sparsity: float, blocksize: int, percdamp: float):
    """Independent float64 OBS: eager updates of every later column (no lazy batching), numpy only."""
    W = W.astype(np.float64).copy()
    H = H.astype(np.float64).copy()
    rows, cols = W.shape
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += percdamp * np.mean(np.diag(H)) * np.eye(cols)
    U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper factor: U.T @ U = H^-1
    pruned = np.zeros_like(W, dtype=bool)
    for b0 in range(0, cols, blocksize):
        b1 = min(b0 + blocksize, cols)
        metric = (W[:, b0:b1] ** 2 / np.diag(U)[b0:b1] ** 2).ravel()
        k = int(metric.size * sparsity)
        blk = np.zeros(metric.size, dtype=bool)
        blk[np.argsort(metric, kind="stable")[:k]] = True
        pruned[:, b0:b1] = blk.reshape(rows, b1 - b0)
        for i in range(b0, b1):
            q = np.where(pruned[:, i], 0.0, W[:, i])
            err = (W[:, i] - q) / U[i, i]
            W[:, i:] -= np.outer(err, U[i, i:])
            W[:, i] = q
    return W, ~pruned


def test_sparsegpt_equals_independent_float64_obs():
    rng = np.random.default_rng(4)
    W = rng.standard_normal((5, 12))
    X = _correlated_inputs(64, 12, seed=5).double().numpy()
    X[:, 7] = 0  # a dead input
    H = 2 * X.T @ X / 64
    want_w, want_mask = _reference_obs(W, H, 0.5, blocksize=4, percdamp=0.01)
    got_w, got_mask = pruning.sparsegpt(
        torch.from_numpy(W), torch.from_numpy(H), 0.5, blocksize=4, dtype=torch.float64
    )
    assert np.array_equal(got_mask.numpy(), want_mask)
    np.testing.assert_allclose(got_w.numpy(), want_w, rtol=1e-10, atol=1e-12)
    assert np.all(got_w.numpy()[:, 7] == 0)


def test_sparsegpt_block_sparsity_exact_and_zeros():
    g = torch.Generator().manual_seed(6)
    rows, cols, s = 32, 300, 0.5  # blocks of 128, 128, 44 columns
    W = torch.randn(rows, cols, generator=g)
    x = _correlated_inputs(512, cols, seed=7)
    H = statistics.HessianAccumulator(cols)
    H.add_batch(x.reshape(4, 128, cols))
    Wp, mask = pruning.sparsegpt(W, H.H, s)
    want = sum(int(rows * (min(b + 128, cols) - b) * s) for b in range(0, cols, 128))
    assert int((~mask).sum()) == want
    for b in range(0, cols, 128):
        blk = ~mask[:, b : b + 128]
        assert int(blk.sum()) == int(blk.numel() * s)
    assert torch.all(Wp[~mask] == 0)
    assert Wp.dtype == W.dtype and W.abs().min() > 0  # input untouched


def test_sparsegpt_reconstruction_beats_magnitude_and_wanda():
    g = torch.Generator().manual_seed(8)
    rows, cols = 64, 256
    W = torch.randn(rows, cols, generator=g)
    X = _correlated_inputs(2048, cols, seed=9)
    sq, H = statistics.SqNormAccumulator(cols), statistics.HessianAccumulator(cols)
    for b in X.reshape(16, 128, cols):
        sq.add_batch(b)
        H.add_batch(b)
    ref = X @ W.T

    def err(Wp):
        return float(torch.linalg.norm(ref - X @ Wp.T))

    e_mag = err(W * pruning.magnitude(W, 0.5))
    e_wanda = err(W * pruning.wanda(W, sq.x_sq_norm, 0.5))
    Wp, mask = pruning.sparsegpt(W, H.H, 0.5)
    e_sgpt = err(Wp)
    assert e_sgpt < e_wanda < e_mag
    # the same mask without the weight update is worse: the update is doing the work
    assert e_sgpt < err(W * mask)


# ------------------------------------------------------------------ OWL


def test_outlier_ratio_hand_case():
    a = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 40.0])  # mean 4.9, 5*mean = 24.5
    b = torch.tensor([1.0, 1.0])
    # pooled mean = 51/12 = 4.25, threshold 21.25: one entry of 12 above it
    assert pruning.outlier_ratio([a, b], m=5) == pytest.approx(1 / 12)
    assert pruning.outlier_ratio([b], m=5) == 0.0


def test_owl_sparsities_mean_range_and_order():
    ratios = [0.01, 0.03, 0.02, 0.05, 0.04]  # evenly spread -> symmetric about the mean
    s = pruning.owl_sparsities(ratios, 0.5, lam=0.08)
    assert np.mean(s) == pytest.approx(0.5, abs=1e-12)
    assert max(s) - min(s) == pytest.approx(0.16)
    assert all(0.5 - 0.08 - 1e-12 <= v <= 0.5 + 0.08 + 1e-12 for v in s)
    assert np.argsort(s).tolist() == np.argsort(ratios)[::-1].tolist()  # more outliers, less pruning
    skew = pruning.owl_sparsities([0, 0, 0, 1.0], 0.6, lam=0.05)
    assert np.mean(skew) == pytest.approx(0.6) and max(skew) - min(skew) == pytest.approx(0.1)
    assert pruning.owl_sparsities([0.2, 0.2], 0.5) == [0.5, 0.5]
    with pytest.raises(UserError, match="lambda"):
        pruning.owl_sparsities([0.0, 1.0], 0.95, lam=0.2)


def test_prune_layer_dispatches_by_name():
    """``pruning.prune_layer``: each method's function by name, ``none`` and sparsity 0 untouched, and one line
    for an unknown method or missing statistics."""
    from types import SimpleNamespace

    from unionsparse.compressor.pruning import prune_layer

    g = torch.Generator().manual_seed(0)
    W, X = torch.randn(8, 16, generator=g), torch.randn(64, 16, generator=g)
    stats = SimpleNamespace(x_sq_norm=(X**2).sum(0) / 4, H=2 / 64 * X.t() @ X)
    w, m = prune_layer("magnitude", W, 0.5)
    assert torch.equal(m, pruning.magnitude(W, 0.5)) and torch.equal(w, W * m)
    w, m = prune_layer("wanda", W, 0.5, "2:4", stats)
    assert torch.equal(m, pruning.wanda(W, stats.x_sq_norm, 0.5, nm=(2, 4))) and torch.equal(w, W * m)
    w, m = prune_layer("sparsegpt", W, 0.5, None, stats, blocksize=8)
    w2, m2 = pruning.sparsegpt(W, stats.H, 0.5, blocksize=8)
    assert torch.equal(w, w2) and torch.equal(m, m2)
    for name, s in (("none", 0.5), ("wanda", 0.0)):
        w, m = prune_layer(name, W, s)
        assert w is W and torch.equal(m, W != 0)
    with pytest.raises(UserError, match="--prune must be one of"):
        prune_layer("gptq", W, 0.5)
    with pytest.raises(UserError, match="needs calibration statistics"):
        prune_layer("sparsegpt", W, 0.5, None, SimpleNamespace(x_sq_norm=None, H=None))
