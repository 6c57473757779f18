"""Bitmap-aware row reordering: exactness, canonical permutations, agreement with IE-BME."""

from __future__ import annotations

import numpy as np
import pytest
from unionsparse.formats import iebme
from unionsparse.solvers import SolverError, reorder_matrix, reorder_tile, union_cost
from unionsparse.solvers.bits import canonical_perm, groups_from_perm


def _direct_cost(mask: np.ndarray, groups, c_a: int) -> int:
    """Union positions of a grouping, computed straight from the mask (no solver code)."""
    h_l, k_l = mask.shape
    folded = mask.reshape(h_l, c_a, k_l // c_a).any(axis=1)
    return int(sum(folded[list(g)].any(axis=0).sum() for g in groups))


def _all_partitions(rows: list[int], r_a: int):
    if not rows:
        yield []
        return
    from itertools import combinations

    first, rest = rows[0], rows[1:]
    for others in combinations(rest, r_a - 1):
        left = [r for r in rest if r not in others]
        for tail in _all_partitions(left, r_a):
            yield [(first, *others), *tail]


def _brute_force(mask: np.ndarray, r_a: int, c_a: int) -> int:
    return min(_direct_cost(mask, p, c_a) for p in _all_partitions(list(range(mask.shape[0])), r_a))


def _is_canonical(perm: np.ndarray, r_a: int) -> bool:
    groups = groups_from_perm(perm, r_a)
    return all(list(g) == sorted(g) for g in groups) and groups == sorted(groups)


@pytest.mark.parametrize(
    ("h_l", "k_l", "areas"),
    [(8, 16, (2, 2)), (8, 16, (4, 1)), (8, 24, (2, 3)), (6, 16, (3, 2)), (8, 8, (8, 1)), (4, 8, (1, 2))],
)
def test_dp_matches_brute_force(h_l, k_l, areas):
    rng = np.random.default_rng(h_l * 100 + areas[0] * 10 + areas[1])
    for trial in range(25):
        density = (0.1, 0.3, 0.5, 0.7)[trial % 4]
        mask = rng.random((h_l, k_l)) < density
        perm, cost = reorder_tile(mask, areas=areas, method="dp")
        assert cost == _brute_force(mask, areas[0], areas[1])
        assert cost == union_cost(mask, perm, areas)
        assert cost == _direct_cost(mask, groups_from_perm(perm, areas[0]), areas[1])


def test_dp_beats_or_ties_every_random_perm_on_16x64():
    rng = np.random.default_rng(7)
    mask = rng.random((16, 64)) < 0.5
    perm, cost = reorder_tile(mask, method="dp")
    samples = [union_cost(mask, rng.permutation(16)) for _ in range(300)]
    assert cost <= min(samples)
    assert cost < union_cost(mask, np.arange(16))  # random 50% tiles always leave something to gain


@pytest.mark.parametrize("areas", [(2, 2), (4, 2), (2, 1), (8, 4)])
def test_union_cost_equals_iebme_popcount(areas):
    rng = np.random.default_rng(sum(areas))
    codes = rng.integers(-8, 8, size=(16, 64)).astype(np.int8)
    codes[rng.random(codes.shape) < 0.55] = 0
    mask = codes != 0
    for perm in [np.arange(16), rng.permutation(16), reorder_tile(mask, areas=areas, method="dp")[0]]:
        m = iebme.encode(codes, bits=4, tile=(16, 64), areas=areas, perm=perm[None, :].astype(np.uint8))
        assert int(m.union_popcounts()[0]) == union_cost(mask, perm, areas)
        np.testing.assert_array_equal(m.decode(), codes)


def test_perm_is_canonical_and_deterministic():
    rng = np.random.default_rng(3)
    for _ in range(20):
        mask = rng.random((16, 64)) < 0.6
        perm, cost = reorder_tile(mask, method="dp")
        assert sorted(perm.tolist()) == list(range(16))
        assert _is_canonical(perm, 2)
        perm2, cost2 = reorder_tile(mask.copy(), method="dp")
        np.testing.assert_array_equal(perm, perm2)
        assert cost == cost2


def test_canonical_perm_layout():
    groups = [(9, 3), (0, 15), (4, 2), (1, 14), (6, 5), (8, 7), (10, 13), (12, 11)]
    perm = canonical_perm(groups, 16)
    # first rows of the sorted groups, then second rows
    assert perm.tolist() == [0, 1, 2, 3, 5, 7, 10, 11, 15, 14, 4, 9, 6, 8, 13, 12]
    np.random.default_rng(0).shuffle(groups)
    assert canonical_perm(groups, 16).tolist() == perm.tolist()
    with pytest.raises(ValueError):
        canonical_perm([(0, 1), (1, 2)], 4)


def test_union_cost_rejects_bad_perm():
    mask = np.ones((16, 64), dtype=bool)
    with pytest.raises(SolverError):
        union_cost(mask, np.zeros(16, dtype=int))
    with pytest.raises(SolverError):
        union_cost(mask, np.arange(16), areas=(3, 2))


@pytest.mark.parametrize(("shape", "areas"), [((16, 64), (2, 2)), ((12, 32), (3, 2)), ((16, 64), (4, 2))])
def test_cpsat_equals_dp_and_is_proven(shape, areas):
    from unionsparse.solvers import cpsat
    from unionsparse.solvers.reorder import _folded_ints

    rng = np.random.default_rng(shape[0] + areas[0])
    for density in (0.3, 0.5, 0.7):
        mask = rng.random(shape) < density
        _, dp_cost = reorder_tile(mask, areas=areas, method="dp")
        perm, cost = reorder_tile(mask, areas=areas, method="cpsat", time_limit=20)
        assert cost == dp_cost == union_cost(mask, perm, areas)
        assert _is_canonical(perm, areas[0])
        res = cpsat.solve_rows(_folded_ints(mask, areas[1]), areas[0], time_limit=20)
        assert res.optimal and res.bound == res.cost == dp_cost


@pytest.mark.parametrize("areas", [(2, 2), (4, 2)])
def test_cpsat_never_worse_than_identity_under_tiny_limit(areas):
    rng = np.random.default_rng(11)
    mask = rng.random((64, 64)) < 0.5
    perm, cost = reorder_tile(mask, areas=areas, method="cpsat", time_limit=0.01)
    assert sorted(perm.tolist()) == list(range(64))
    assert cost == union_cost(mask, perm, areas) <= union_cost(mask, np.arange(64), areas)


def test_auto_picks_dp_for_16_rows_and_cpsat_for_64():
    rng = np.random.default_rng(5)
    m16 = rng.random((37, 150)) < 0.5
    _, rep = reorder_matrix(m16, method="auto")
    assert rep.methods == {"dp": rep.n_tiles}
    m64 = rng.random((64, 64)) < 0.5
    _, rep = reorder_matrix(m64, tile=(64, 64), method="auto", time_limit=2.0, jobs=1)
    assert set(rep.methods) <= {"cpsat", "trivial"} and rep.n_tiles == 1


def test_dp_needs_no_ortools_and_cpsat_says_what_is_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)  # any import of it now fails
    rng = np.random.default_rng(2)
    mask = rng.random((32, 128)) < 0.5
    perm, rep = reorder_matrix(mask, method="dp")
    assert rep.methods == {"dp": rep.n_tiles} and rep.positions_after < rep.positions_before
    with pytest.raises(SolverError, match="needs OR-Tools"):
        reorder_tile(rng.random((64, 64)) < 0.5, method="cpsat", time_limit=0.1)
    with pytest.raises(SolverError, match="needs OR-Tools"):  # before any worker process starts
        reorder_matrix(rng.random((128, 64)) < 0.5, tile=(64, 64), method="cpsat", jobs=2, time_limit=0.1)


def _roundtrip(codes, tile, areas, method, **kw):
    mask = codes != 0
    seen = []
    perm, rep = reorder_matrix(mask, tile=tile, areas=areas, method=method,
                               progress=lambda d, n: seen.append((d, n)), **kw)
    g = iebme.Geometry(codes.shape, tile, areas, 4)
    assert perm.dtype == np.uint8 and perm.shape == (g.n_tiles, tile[0])
    m = iebme.encode(codes, bits=4, tile=tile, areas=areas, perm=perm)
    np.testing.assert_array_equal(m.decode(), codes)
    np.testing.assert_array_equal(m.union_popcounts(), rep.cost_after)
    ident = iebme.encode(codes, bits=4, tile=tile, areas=areas)
    np.testing.assert_array_equal(ident.union_popcounts(), rep.cost_before)
    assert rep.positions_after == int(m.union_popcounts().sum()) <= rep.positions_before
    assert rep.positions_bound <= rep.positions_after
    assert rep.capacity == g.n_tiles * g.h * g.w
    assert rep.density_after == rep.positions_after / rep.capacity
    assert seen and seen[-1] == (g.n_tiles, g.n_tiles)
    assert sum(rep.methods.values()) == rep.n_tiles
    assert rep.tiles_optimal + rep.tiles_not_proven == rep.n_tiles
    return rep


@pytest.mark.parametrize(
    ("method", "tile", "areas", "kw"),
    [("dp", (16, 64), (2, 2), {}), ("auto", (8, 32), (4, 1), {}), ("none", (16, 64), (2, 2), {}),
     ("cpsat", (32, 64), (2, 2), {"jobs": 1}), ("cpsat", (32, 32), (2, 2), {"jobs": 2})],
)
def test_reorder_matrix_ragged_roundtrip(method, tile, areas, kw):
    rng = np.random.default_rng(17)
    codes = rng.integers(-8, 8, size=(45, 150)).astype(np.int8)
    codes[rng.random(codes.shape) < 0.5] = 0
    rep = _roundtrip(codes, tile, areas, method, **kw)
    if method == "none":
        assert rep.positions_after == rep.positions_before
        assert rep.tiles_not_proven == rep.n_tiles and rep.positions_bound == 0
    else:
        assert rep.positions_after < rep.positions_before
        assert rep.tiles_optimal == rep.n_tiles  # small tiles: every one proven
        assert rep.positions_bound == rep.positions_after


def test_reorder_matrix_padding_tiles_are_trivial():
    codes = np.zeros((40, 70), dtype=np.int8)
    codes[:5, :5] = 1
    rep = _roundtrip(codes, (32, 64), (2, 2), "cpsat", jobs=1)
    assert rep.methods.get("trivial", 0) >= 3


def test_reorder_matrix_bad_input():
    mask = np.ones((16, 64), dtype=bool)
    with pytest.raises(SolverError, match="reorder method"):
        reorder_matrix(mask, method="greedy")
    with pytest.raises(SolverError, match="too large for the exact DP"):
        reorder_matrix(np.ones((64, 64), dtype=bool), tile=(64, 64), method="dp")
    with pytest.raises(SolverError, match="do not divide"):
        reorder_matrix(mask, tile=(16, 64), areas=(3, 2))


def _interleaved_mask(m: int = 64, k: int = 256) -> np.ndarray:
    """Rows active at even or at odd columns (pattern (r % 2) ^ (r // 8 % 2)): in the identity order row i and row
    i + 8 of a tile (the same positions of the two row areas) have opposite patterns, so the union mask is full;
    the DP pairs like rows (half of it)."""
    r = np.arange(m)[:, None]
    c = np.arange(k)[None, :]
    return (c % 2) == ((r % 2) ^ (r // 8 % 2))


def test_auto_keeps_row_permutations_only_where_they_pay_for_their_cost():
    """``--reorder auto`` stores a layer's DP permutations only when they cut its union positions by at least
    AUTO_MIN_GAIN (what applying them costs the GPU kernel); ``dp`` keeps what it finds; the report says both."""
    from types import SimpleNamespace

    from unionsparse.compressor.pipeline.encode import AUTO_MIN_GAIN, reorder_perms

    def cfg(method):
        return SimpleNamespace(reorder=method, tile_shape=(16, 64), area_grid=(2, 2))

    rng = np.random.default_rng(0)
    random50 = (rng.random((64, 256)) < 0.5).astype(np.int8)  # the DP saves a few percent here
    perm, rep = reorder_perms(random50, cfg("auto"))
    gain = 1 - rep["found_positions"] / rep["union_positions_before"]
    assert 0 < gain < AUTO_MIN_GAIN and perm is None and not rep["kept"]
    assert rep["union_positions_after"] == rep["union_positions_before"]  # the stored (identity) order's figure
    perm, rep = reorder_perms(random50, cfg("dp"))
    assert perm is not None and rep["kept"] and rep["union_positions_after"] == rep["found_positions"]
    structured = _interleaved_mask().astype(np.int8)  # the DP halves the union here
    perm, rep = reorder_perms(structured, cfg("auto"))
    assert perm is not None and rep["kept"] and rep["union_positions_after"] <= rep["union_positions_before"] // 2 + 1
