"""Bitmap-aware row reordering: per-tile and whole-matrix entry points (docs/format.md, "IE-BME"; README, "Python API").

``reorder_tile`` solves one local tile; ``reorder_matrix`` solves every LT of a mask exactly as
``iebme.encode`` tiles it and returns the ``perm`` array ``encode`` takes, plus a ``ReorderReport``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import current_process, get_context

import numpy as np

from ..formats import iebme
from . import cpsat, subset_dp
from .bits import canonical_perm, check_perm_1d, check_tile_areas
from .errors import SolverError

METHODS = ("auto", "dp", "cpsat", "none")

#: ``auto`` uses the DP when the (H_L, R_A) state table has at most this many transitions: a DP tile
#: then takes <= ~40 ms on one core and the table <= ~40 MB (docs/solvers.md has the figures).
DP_AUTO_MAX_TRANSITIONS = 5_000_000
#: ``dp`` refuses larger tables (memory: 8 bytes per transition).
DP_MAX_TRANSITIONS = 40_000_000
#: Tiles handed to one numba call between two progress callbacks.
DP_BLOCK = 16384


@dataclass
class ReorderReport:
    """What ``reorder_matrix`` did. Positions are active union-mask entries summed over all LTs."""

    method: str  # requested method
    tile: tuple[int, int]
    areas: tuple[int, int]
    n_tiles: int
    methods: dict[str, int]  # tiles per method actually used: "dp", "cpsat", "trivial", "none"
    positions_before: int  # identity permutation
    positions_after: int
    positions_bound: int  # proven lower bound on the optimum (== positions_after when all proven)
    capacity: int  # n_tiles * h * w, the union mask size
    tiles_optimal: int  # proven optimal
    tiles_not_proven: int  # no proof: CP-SAT stopped by its time limit (best found, never worse than
    #                        identity), or method "none" (nothing searched)
    wall_s: float
    cost_before: np.ndarray = field(repr=False)  # int64 [T]
    cost_after: np.ndarray = field(repr=False)  # int64 [T]

    @property
    def density_before(self) -> float:
        return self.positions_before / self.capacity if self.capacity else 0.0

    @property
    def density_after(self) -> float:
        return self.positions_after / self.capacity if self.capacity else 0.0

    @property
    def reduction(self) -> float:
        """Fraction of union positions removed by reordering."""
        return 1.0 - self.positions_after / self.positions_before if self.positions_before else 0.0

    def to_dict(self) -> dict:
        """JSON-ready summary (no per-tile arrays)."""
        d = asdict(self)
        d.pop("cost_before")
        d.pop("cost_after")
        d["tile"], d["areas"] = list(self.tile), list(self.areas)
        d.update(density_before=self.density_before, density_after=self.density_after,
                 reduction=self.reduction)
        return d


def _check_method(method: str, allowed=METHODS) -> str:
    if method not in allowed:
        raise SolverError(f"reorder method must be one of {', '.join(allowed)}, got {method!r}")
    return method


def _as_mask(mask) -> np.ndarray:
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise SolverError(f"mask must be 2-D, got shape {mask.shape}")
    return mask if mask.dtype == np.bool_ else mask != 0


def dp_table(h_l: int, r_a: int, cap: int = DP_AUTO_MAX_TRANSITIONS) -> subset_dp.StateTable | None:
    """The DP state table when the DP fits under ``cap`` transitions, else None."""
    if h_l > subset_dp.DP_MAX_ROWS:
        return None
    return subset_dp.state_table(h_l, r_a, cap)


def _resolve(method: str, h_l: int, r_a: int) -> tuple[str, subset_dp.StateTable | None]:
    if method in ("dp", "auto"):
        table = dp_table(h_l, r_a, DP_AUTO_MAX_TRANSITIONS if method == "auto" else DP_MAX_TRANSITIONS)
        if table is not None:
            return "dp", table
        if method == "dp":
            raise SolverError(
                f"tile height {h_l} with R_A={r_a} is too large for the exact DP "
                f"(more than {DP_MAX_TRANSITIONS:,} transitions or H_L > {subset_dp.DP_MAX_ROWS}); "
                "use --reorder cpsat or auto"
            )
        return "cpsat", None
    return method, None


def union_cost(mask, perm, areas: tuple[int, int] = (2, 2)) -> int:
    """Popcount of the union mask of one bool tile [H_L, K_L] after W'[r] = W[perm[r]]."""
    mask = _as_mask(mask)
    h_l, k_l, r_a, c_a = check_tile_areas(mask.shape, areas)
    perm = check_perm_1d(perm, h_l)
    w2 = mask[perm].reshape(r_a, h_l // r_a, c_a, k_l // c_a)
    return int(w2.any(axis=(0, 2)).sum())


def _folded_ints(tile: np.ndarray, c_a: int) -> list[int]:
    """Folded rows of one bool tile as Python ints (bit j = union column j)."""
    h_l, k_l = tile.shape
    folded = tile.reshape(h_l, c_a, k_l // c_a).any(axis=1)
    packed = np.packbits(folded, axis=1, bitorder="little")
    return [int.from_bytes(row.tobytes(), "little") for row in packed]


def reorder_tile(mask, areas: tuple[int, int] = (2, 2), method: str = "auto", time_limit: float = 10.0,
                 workers: int = 1) -> tuple[np.ndarray, int]:
    """Best canonical row permutation of one bool tile [H_L, K_L] and its union cost.

    ``dp`` is exact; ``cpsat`` is exact when it finishes within ``time_limit`` seconds (``workers``
    CP-SAT threads) and otherwise returns its best permutation, never worse than the identity.
    """
    mask = _as_mask(mask)
    h_l, k_l, r_a, c_a = check_tile_areas(mask.shape, areas)
    used, table = _resolve(_check_method(method), h_l, r_a)
    if used == "none":
        perm = np.arange(h_l, dtype=np.int64)
        return perm, union_cost(mask, perm, areas)
    if used == "dp":
        return subset_dp.solve_one(mask, (r_a, c_a), table)
    res = cpsat.solve_rows(_folded_ints(mask, c_a), r_a, time_limit=time_limit, workers=workers)
    return canonical_perm(res.groups, h_l), res.cost


def _cpsat_chunk(items, r_a, time_limit, workers):
    out = []
    for t, rows in items:
        res = cpsat.solve_rows(rows, r_a, time_limit=time_limit, workers=workers)
        out.append((t, res.groups, res.cost, res.bound, res.optimal, res.source))
    return out


def reorder_matrix(
    mask,
    tile: tuple[int, int] = (16, 64),
    areas: tuple[int, int] = (2, 2),
    method: str = "auto",
    time_limit: float = 1.0,
    progress: Callable[[int, int], None] | None = None,
    jobs: int | None = None,
    cpsat_workers: int = 1,
) -> tuple[np.ndarray, ReorderReport]:
    """Reorder every LT of a bool mask [M, K] (tiles as ``iebme.tile_view`` cuts them, zero padding).

    Returns ``(perm uint8 [T, H_L], report)``; pass ``perm`` to ``iebme.encode``. ``time_limit`` is per
    CP-SAT tile (seconds); ``jobs`` processes solve CP-SAT tiles (default: all cores), each with
    ``cpsat_workers`` CP-SAT threads. The DP runs on numba threads (``numba.set_num_threads``).
    ``progress(n_done, n_total)`` is called as tiles complete.
    """
    t_start = time.perf_counter()
    mask = _as_mask(mask)
    h_l, k_l, r_a, c_a = check_tile_areas(tile, areas)
    _check_method(method)
    if time_limit <= 0:
        raise SolverError(f"time_limit must be positive, got {time_limit}")
    g = iebme.Geometry((int(mask.shape[0]), int(mask.shape[1])), (h_l, k_l), (r_a, c_a), 4)
    n_t = g.n_tiles
    mp = np.ascontiguousarray(iebme.pad_to(mask, g.padded))
    perms = np.empty((n_t, h_l), dtype=np.uint8)
    before = np.zeros(n_t, dtype=np.int64)
    after = np.zeros(n_t, dtype=np.int64)
    bound = np.zeros(n_t, dtype=np.int64)
    proven = np.ones(n_t, dtype=bool)
    methods: dict[str, int] = {}
    used, table = _resolve(method, h_l, r_a)
    tiles = iebme.tile_view(mp, g) if used != "dp" else None

    if used == "none":
        perms[:] = np.arange(h_l, dtype=np.uint8)
        before[:] = iebme.area_view(tiles, g).any(axis=1).sum(axis=1)
        after[:] = before
        proven[:] = False  # nothing was searched; bound stays 0 (the only bound known without a search)
        methods["none"] = n_t
        if progress:
            progress(n_t, n_t)
    elif used == "dp":
        for t0 in range(0, n_t, DP_BLOCK):
            t1 = min(n_t, t0 + DP_BLOCK)
            subset_dp.solve_tiles(mp, g.grid, (h_l, k_l), (r_a, c_a), table, perms, before, after, t0, t1)
            if progress:
                progress(t1, n_t)
        bound[:] = after
        methods["dp"] = n_t
    else:
        _reorder_cpsat(tiles, g, time_limit, jobs, cpsat_workers, progress, perms, before, after, bound,
                       proven, methods)
    report = ReorderReport(
        method=method, tile=(h_l, k_l), areas=(r_a, c_a), n_tiles=n_t, methods=methods,
        positions_before=int(before.sum()), positions_after=int(after.sum()),
        positions_bound=int(bound.sum()), capacity=n_t * g.h * g.w,
        tiles_optimal=int(proven.sum()), tiles_not_proven=int((~proven).sum()),
        wall_s=time.perf_counter() - t_start, cost_before=before, cost_after=after,
    )
    return perms, report


def _reorder_cpsat(tiles, g, time_limit, jobs, cpsat_workers, progress, perms, before, after, bound,
                   proven, methods) -> None:
    cpsat.load_cp_model()  # fail in this process, with one line, before any worker starts
    h_l = g.tile[0]
    r_a, c_a = g.areas
    n_t = tiles.shape[0]
    ident = np.arange(h_l, dtype=np.uint8)
    todo = []
    n_trivial = 0
    for t in range(n_t):
        rows = _folded_ints(tiles[t], c_a)
        c0 = cpsat.total_cost(rows, cpsat.identity_groups(h_l, r_a))
        before[t] = c0
        if c0 <= cpsat.trivial_bound(rows, r_a):  # identity already optimal (e.g. empty padding tiles)
            perms[t], after[t], bound[t] = ident, c0, c0
            n_trivial += 1
        else:
            todo.append((t, rows))
    done = n_trivial
    if progress:
        progress(done, n_t)

    def take(results):
        for t, groups, cost, bnd, opt, source in results:
            perms[t] = canonical_perm(groups, h_l)
            after[t], bound[t], proven[t] = cost, bnd, opt
            key = "trivial" if source == "trivial" else "cpsat"
            methods[key] = methods.get(key, 0) + 1

    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    if current_process().daemon:  # e.g. inside a Dask worker: daemonic processes may not have children
        jobs = 1
    if jobs == 1 or len(todo) < 2:
        for item in todo:
            take(_cpsat_chunk([item], r_a, time_limit, cpsat_workers))
            done += 1
            if progress:
                progress(done, n_t)
    else:
        size = max(1, min(64, len(todo) // (4 * jobs)))
        chunks = [todo[i:i + size] for i in range(0, len(todo), size)]
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            futs = [pool.submit(_cpsat_chunk, c, r_a, time_limit, cpsat_workers) for c in chunks]
            for f in as_completed(futs):
                res = f.result()
                take(res)
                done += len(res)
                if progress:
                    progress(done, n_t)
    if n_trivial:
        methods["trivial"] = methods.get("trivial", 0) + n_trivial
