"""Exact grouped subset DP for bitmap-aware row reordering, compiled with numba.

F(S) = min over groups g of size R_A with min(S) in g and g within S of cost(g) + F(S minus g), F(empty) = 0.

Fixing the lowest remaining row makes the set of *reachable* states tiny compared with 2^H_L (1,597
states and 10,226 transitions for H_L = 16, R_A = 2, instead of 2^16), and that set depends only on
(H_L, R_A), not on the tile. So it is built once per shape as a flat transition table (state -> list of
(group id, next state)) in BFS order; solving one tile is then a group-cost table (popcount of the OR
of each candidate group's folded rows) followed by one backward sweep over that table, with no hashing,
no recursion and no Python in the loop. Ties keep the first transition, so results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import get_num_threads, njit, prange

from .bits import fold_tile_into, popcount64

#: Largest H_L the DP will index (its builder needs a 2^H_L int32 index array).
DP_MAX_ROWS = 24


@dataclass(frozen=True)
class StateTable:
    """Reachable DP states of one (H_L, R_A) and their transitions, in BFS order (empty set last)."""

    h_l: int
    r_a: int
    groups: np.ndarray  # int32 [G, R_A], rows ascending
    tptr: np.ndarray  # int32 [S + 1], transitions of state s are tptr[s]..tptr[s+1]-1
    tgid: np.ndarray  # int32 [N], group id of each transition
    tnext: np.ndarray  # int32 [N], state index reached

    @property
    def n_states(self) -> int:
        return int(self.tptr.size - 1)

    @property
    def n_transitions(self) -> int:
        return int(self.tgid.size)

    @property
    def nbytes(self) -> int:
        return int(self.groups.nbytes + self.tptr.nbytes + self.tgid.nbytes + self.tnext.nbytes)


@njit(cache=True)
def _grow(a, need):
    if need <= a.size:
        return a
    b = np.empty(max(2 * a.size, need), dtype=a.dtype)
    b[: a.size] = a
    return b


@njit(cache=True)
def _build(n, r, cap):
    """BFS over reachable states. Returns (ok, groups, tptr, tgid, tnext); ok is False past ``cap``."""
    index = np.full(1 << n, -1, dtype=np.int32)
    gindex = np.full(1 << n, -1, dtype=np.int32)
    states = np.empty(1024, dtype=np.int64)
    tptr = np.empty(1025, dtype=np.int32)
    tgid = np.empty(4096, dtype=np.int32)
    tnext = np.empty(4096, dtype=np.int32)
    groups = np.empty((256, r), dtype=np.int32)
    full = (1 << n) - 1
    states[0] = full
    index[full] = 0
    ns, nt, ng, head = 1, 0, 0, 0
    pos = np.empty(n, dtype=np.int64)
    comb = np.empty(max(r - 1, 1), dtype=np.int64)
    k = r - 1
    while head < ns:
        s = states[head]
        tptr = _grow(tptr, head + 2)
        tptr[head] = nt
        head += 1
        if s == 0:
            continue
        low = 0
        while not (s >> low) & 1:
            low += 1
        m = 0
        for i in range(low + 1, n):
            if (s >> i) & 1:
                pos[m] = i
                m += 1
        for i in range(k):
            comb[i] = i
        while True:
            gm = 1 << low
            for i in range(k):
                gm |= 1 << pos[comb[i]]
            g = gindex[gm]
            if g < 0:
                g = ng
                gindex[gm] = g
                if ng >= groups.shape[0]:
                    bigger = np.empty((2 * groups.shape[0], r), dtype=np.int32)
                    bigger[:ng] = groups[:ng]
                    groups = bigger
                groups[ng, 0] = low
                for i in range(k):
                    groups[ng, i + 1] = pos[comb[i]]
                ng += 1
            t = s & ~gm
            if index[t] < 0:
                states = _grow(states, ns + 1)
                states[ns] = t
                index[t] = ns
                ns += 1
            tgid = _grow(tgid, nt + 1)
            tnext = _grow(tnext, nt + 1)
            tgid[nt] = g
            tnext[nt] = index[t]
            nt += 1
            if nt > cap:
                return False, groups[:0], tptr[:0], tgid[:0], tnext[:0]
            # next combination of k out of m (lexicographic)
            i = k - 1
            while i >= 0 and comb[i] == m - k + i:
                i -= 1
            if i < 0:
                break
            comb[i] += 1
            for j in range(i + 1, k):
                comb[j] = comb[j - 1] + 1
    tptr[ns] = nt
    return True, groups[:ng].copy(), tptr[: ns + 1].copy(), tgid[:nt].copy(), tnext[:nt].copy()


@lru_cache(maxsize=16)
def state_table(h_l: int, r_a: int, cap: int = 2**31 - 1) -> StateTable | None:
    """The reachable-state table of (H_L, R_A), or None when it has more than ``cap`` transitions."""
    if h_l % r_a or h_l > DP_MAX_ROWS:
        return None
    ok, groups, tptr, tgid, tnext = _build(h_l, r_a, cap)
    if not ok:
        return None
    return StateTable(h_l, r_a, groups, tptr, tgid, tnext)


@njit(cache=True)
def _solve_folded(folded, groups, tptr, tgid, tnext, cost, f, choice, perm_out):
    """Optimal grouping of one folded tile; writes the canonical permutation, returns the optimum."""
    ng, r = groups.shape
    nw = folded.shape[1]
    for g in range(ng):
        tot = 0
        for q in range(nw):
            acc = np.uint64(0)
            for a in range(r):
                acc |= folded[groups[g, a], q]
            tot += popcount64(acc)
        cost[g] = tot
    ns = tptr.size - 1
    f[ns - 1] = 0
    for s in range(ns - 2, -1, -1):
        best = np.int32(2**30)
        arg = -1
        for k in range(tptr[s], tptr[s + 1]):
            v = cost[tgid[k]] + f[tnext[k]]
            if v < best:
                best = v
                arg = k
        f[s] = best
        choice[s] = arg
    # Groups come out in increasing order of their lowest row, i.e. already sorted lexicographically.
    h = folded.shape[0] // r
    s, gi = 0, 0
    while s != ns - 1:
        k = choice[s]
        g = tgid[k]
        for a in range(r):
            perm_out[a * h + gi] = groups[g, a]
        gi += 1
        s = tnext[k]
    return f[0]


@njit(cache=True)
def identity_cost(folded, r_a):
    """Union positions of the identity permutation (group i = rows i, h+i, 2h+i, ...)."""
    h = folded.shape[0] // r_a
    nw = folded.shape[1]
    tot = 0
    for i in range(h):
        for q in range(nw):
            acc = np.uint64(0)
            for a in range(r_a):
                acc |= folded[a * h + i, q]
            tot += popcount64(acc)
    return tot


@njit(cache=True, parallel=True)
def _solve_range(mp, t0, t1, grid_cols, h_l, k_l, c_a, w, nw, groups, tptr, tgid, tnext,
                 perms, before, after, nchunks):
    n = t1 - t0
    ns = tptr.size - 1
    ng = groups.shape[0]
    r = groups.shape[1]
    for ch in prange(nchunks):
        lo = t0 + ch * n // nchunks
        hi = t0 + (ch + 1) * n // nchunks
        folded = np.empty((h_l, nw), dtype=np.uint64)
        cost = np.empty(ng, dtype=np.int32)
        f = np.empty(ns, dtype=np.int32)
        choice = np.empty(ns, dtype=np.int32)
        p = np.empty(h_l, dtype=np.int32)
        for t in range(lo, hi):
            tr = t // grid_cols
            tc = t - tr * grid_cols
            fold_tile_into(mp, tr * h_l, tc * k_l, h_l, c_a, w, folded)
            before[t] = identity_cost(folded, r)
            after[t] = _solve_folded(folded, groups, tptr, tgid, tnext, cost, f, choice, p)
            for i in range(h_l):
                perms[t, i] = p[i]


def solve_tiles(mp: np.ndarray, grid: tuple[int, int], tile: tuple[int, int], areas: tuple[int, int],
                table: StateTable, perms: np.ndarray, before: np.ndarray, after: np.ndarray,
                t0: int, t1: int) -> None:
    """Solve tiles t0..t1-1 of a padded bool matrix ``mp`` in parallel (numba threads), in place."""
    h_l, k_l = tile
    c_a = areas[1]
    w = k_l // c_a
    nw = -(-w // 64)
    nchunks = max(1, min(t1 - t0, 4 * get_num_threads()))
    _solve_range(mp, t0, t1, grid[1], h_l, k_l, c_a, w, nw, table.groups, table.tptr, table.tgid,
                 table.tnext, perms, before, after, nchunks)


def solve_one(mask: np.ndarray, areas: tuple[int, int], table: StateTable) -> tuple[np.ndarray, int]:
    """Optimal canonical permutation and cost of one bool tile [H_L, K_L]."""
    h_l, k_l = mask.shape
    perms = np.empty((1, h_l), dtype=np.uint8)
    before = np.empty(1, dtype=np.int64)
    after = np.empty(1, dtype=np.int64)
    mp = np.ascontiguousarray(mask, dtype=np.bool_)
    solve_tiles(mp, (1, 1), (h_l, k_l), areas, table, perms, before, after, 0, 1)
    return perms[0].astype(np.int64), int(after[0])
