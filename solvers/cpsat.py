"""OR-Tools CP-SAT row grouping for tiles too tall for the subset DP (H_L = 32, 64, ...).

Two models of the same problem (rows -> groups of R_A, minimise the summed popcount of each group's OR):

* ``partition``: one Boolean per candidate group (all C(H_L, R_A) of them) with its cost as objective
  coefficient, every row covered exactly once. For R_A = 2 this is min-weight perfect matching.
* ``assignment``: x[r, g] (row r in group g) and y[g, j] (union bit j of group g is active), x -> y for
  every set bit, groups ordered by their lowest row (symmetry breaking).

Both are warm-started (AddHint) from a greedy grouping improved by swap local search, and the answer is
never worse than that grouping nor than the identity permutation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import combinations
from math import comb

from .errors import SolverError

#: Above this many candidate groups the partition model is not built; the assignment model is used.
PARTITION_MAX_GROUPS = 50_000


@dataclass
class GroupingResult:
    groups: list[tuple[int, ...]]
    cost: int
    bound: int  # proven lower bound on the optimum
    optimal: bool
    source: str  # "cpsat", "warm-start", "identity" or "trivial": where the returned grouping came from
    wall_s: float


def _cost(rows: list[int], group) -> int:
    acc = 0
    for r in group:
        acc |= rows[r]
    return acc.bit_count()


def total_cost(rows: list[int], groups) -> int:
    return sum(_cost(rows, g) for g in groups)


def identity_groups(h_l: int, r_a: int) -> list[tuple[int, ...]]:
    h = h_l // r_a
    return [tuple(i + a * h for a in range(r_a)) for i in range(h)]


def trivial_bound(rows: list[int], r_a: int) -> int:
    """A cheap lower bound: each group costs at least its densest row and at least 1/R_A of its rows."""
    pops = sorted((x.bit_count() for x in rows), reverse=True)
    by_share = -(-sum(pops) // r_a)
    by_max = sum(pops[i] for i in range(0, len(pops), r_a))  # R_A densest rows can share one group
    return max(by_share, by_max)


def greedy_groups(rows: list[int], r_a: int, passes: int = 4) -> list[tuple[int, ...]]:
    """Densest unassigned row first, grown by the row adding the fewest bits; then swap local search."""
    left = set(range(len(rows)))
    groups: list[list[int]] = []
    while left:
        seed = max(left, key=lambda r: (rows[r].bit_count(), -r))
        left.discard(seed)
        g, acc = [seed], rows[seed]
        for _ in range(r_a - 1):
            nxt = min(left, key=lambda r: ((acc | rows[r]).bit_count() - acc.bit_count(), r))
            left.discard(nxt)
            g.append(nxt)
            acc |= rows[nxt]
        groups.append(g)
    for _ in range(passes):
        improved = False
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                ga, gb = groups[a], groups[b]
                base = _cost(rows, ga) + _cost(rows, gb)
                for i in range(r_a):
                    for j in range(r_a):
                        na = ga[:i] + [gb[j]] + ga[i + 1:]
                        nb = gb[:j] + [ga[i]] + gb[j + 1:]
                        if _cost(rows, na) + _cost(rows, nb) < base:
                            ga, gb = na, nb
                            base = _cost(rows, ga) + _cost(rows, gb)
                            improved = True
                groups[a], groups[b] = ga, gb
        if not improved:
            break
    return [tuple(sorted(g)) for g in groups]


def _canonical(groups) -> list[tuple[int, ...]]:
    return sorted(tuple(sorted(g)) for g in groups)


def load_cp_model():
    """OR-Tools' CP-SAT module, imported only when a tile needs it (the DP and the bounds do not); a
    missing OR-Tools is a SolverError naming it."""
    try:
        from ortools.sat.python import cp_model
    except ImportError as e:
        raise SolverError("the CP-SAT row grouping needs OR-Tools, which is not installed here "
                        "(pip install ortools, or use --reorder dp|none)") from e
    return cp_model


def _solver(cp_model, time_limit: float, workers: int, seed: int = 0):
    s = cp_model.CpSolver()
    s.parameters.max_time_in_seconds = float(time_limit)
    s.parameters.num_workers = int(workers)
    s.parameters.random_seed = seed
    # Full LP relaxation with cuts: without it CP-SAT cannot prove even a 16-row matching optimal in 5 s
    # (bound 137 vs optimum 225); with it 16/32/64 rows, R_A=2 are proven in 6/30/270 ms.
    s.parameters.linearization_level = 2
    # Symmetry detection ignores the time limit on big partition models (32 rows, R_A = 4, 70% density:
    # 51 s with a 2 s limit, stopped in presolve); off, the limit holds and R_A = 2 costs ~10% more.
    s.parameters.symmetry_level = 0
    return s


def _solve_partition(rows, r_a, hint, time_limit, workers):
    cp_model = load_cp_model()
    h_l = len(rows)
    model = cp_model.CpModel()
    cand = list(combinations(range(h_l), r_a))
    x = [model.new_bool_var(f"g{i}") for i in range(len(cand))]
    cover: list[list] = [[] for _ in range(h_l)]
    for v, g in zip(x, cand, strict=True):
        for r in g:
            cover[r].append(v)
    for lits in cover:
        model.add_exactly_one(lits)
    model.minimize(sum(_cost(rows, g) * v for v, g in zip(x, cand, strict=True)))
    chosen = set(hint)
    for v, g in zip(x, cand, strict=True):
        model.add_hint(v, g in chosen)
    solver = _solver(cp_model, time_limit, workers)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, 0, False
    groups = [g for v, g in zip(x, cand, strict=True) if solver.boolean_value(v)]
    return groups, int(round(solver.best_objective_bound)), status == cp_model.OPTIMAL


def _solve_assignment(rows, r_a, hint, time_limit, workers):
    cp_model = load_cp_model()
    h_l = len(rows)
    n_g = h_l // r_a
    width = max(x.bit_length() for x in rows) if rows else 0
    model = cp_model.CpModel()
    # Groups ordered by lowest row: row r can only sit in groups 0..min(r, n_g - 1).
    x = {(r, g): model.new_bool_var(f"x{r}_{g}") for r in range(h_l) for g in range(min(r, n_g - 1) + 1)}
    for r in range(h_l):
        model.add_exactly_one([x[r, g] for g in range(min(r, n_g - 1) + 1)])
    for g in range(n_g):
        model.add(sum(x[r, g] for r in range(g, h_l)) == r_a)
        if g:
            for r in range(g, h_l):  # some row below r sits in group g - 1
                model.add(x[r, g] <= sum(x[q, g - 1] for q in range(g - 1, r)))
    const, obj = 0, []
    for j in range(width):
        holders = [r for r in range(h_l) if (rows[r] >> j) & 1]
        if len(holders) == 1:
            const += 1
            continue
        for g in range(n_g):
            inside = [r for r in holders if (r, g) in x]
            if not inside:
                continue
            y = model.new_bool_var(f"y{g}_{j}")
            for r in inside:
                model.add_implication(x[r, g], y)
            obj.append(y)
    model.minimize(sum(obj))
    for g, grp in enumerate(_canonical(hint)):
        for r in grp:
            for gg in range(min(r, n_g - 1) + 1):
                model.add_hint(x[r, gg], gg == g)
    solver = _solver(cp_model, time_limit, workers)
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, 0, False
    groups: list[list[int]] = [[] for _ in range(n_g)]
    for (r, g), v in x.items():
        if solver.boolean_value(v):
            groups[g].append(r)
    bound = int(round(solver.best_objective_bound)) + const
    return [tuple(g) for g in groups], bound, status == cp_model.OPTIMAL


def solve_rows(rows: list[int], r_a: int, time_limit: float = 1.0, workers: int = 1,
               model: str = "auto") -> GroupingResult:
    """Group folded rows (Python ints, bit j = union column j) into groups of ``r_a``."""
    t0 = time.perf_counter()
    h_l = len(rows)
    ident = identity_groups(h_l, r_a)
    best, best_cost, source = ident, total_cost(rows, ident), "identity"
    warm = greedy_groups(rows, r_a)
    wc = total_cost(rows, warm)
    if wc < best_cost:
        best, best_cost, source = warm, wc, "warm-start"
    lb = trivial_bound(rows, r_a)
    if best_cost <= lb or r_a == 1 or r_a == h_l:
        return GroupingResult(_canonical(best), best_cost, best_cost, True, "trivial",
                              time.perf_counter() - t0)
    hint = _canonical(best)
    if model == "auto":
        model = "partition" if comb(h_l, r_a) <= PARTITION_MAX_GROUPS else "assignment"
    run = _solve_partition if model == "partition" else _solve_assignment
    groups, bound, optimal = run(rows, r_a, hint, time_limit, workers)
    bound = max(bound, lb)
    if groups is not None:
        c = total_cost(rows, groups)
        if c < best_cost or (c == best_cost and optimal):
            best, best_cost, source = groups, c, "cpsat"
    optimal = optimal and source == "cpsat" or best_cost <= bound
    return GroupingResult(_canonical(best), best_cost, min(bound, best_cost), optimal, source,
                          time.perf_counter() - t0)
