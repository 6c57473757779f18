"""Bit-level helpers shared by the reordering solvers: row folding, popcount, canonical permutations.

A local tile's row ``r`` is *folded* over the C_A column partitions with OR: bit ``j`` of the folded row
is set iff any of ``mask[r, c*w + j]`` (c < C_A) is set. Folded rows are stored as ``ceil(w / 64)``
uint64 words, bit ``j`` in word ``j // 64`` at position ``j % 64``. The union-mask cost of a row group
is the popcount of the OR of its folded rows.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .errors import SolverError


@intrinsic
def popcount64(typingctx, x):
    """LLVM ``ctpop`` on a uint64 (one POPCNT instruction on x86-64)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic("llvm.ctpop", [ir.IntType(64)])
        return builder.call(fn, args)

    return sig, codegen


def check_tile_areas(shape: tuple[int, int], areas: tuple[int, int]) -> tuple[int, int, int, int]:
    """Validate a tile shape against its area grid; return (H_L, K_L, R_A, C_A)."""
    if len(areas) != 2:
        raise SolverError(f"areas must be two integers R_A x C_A, got {areas!r}")
    hl, kl = int(shape[0]), int(shape[1])
    ra, ca = int(areas[0]), int(areas[1])
    if min(hl, kl, ra, ca) <= 0:
        raise SolverError(f"tile {hl}x{kl} and areas {ra}x{ca} must be positive")
    if hl % ra or kl % ca:
        raise SolverError(f"areas {ra}x{ca} do not divide the tile {hl}x{kl}")
    if hl > 256:
        raise SolverError(f"tile height {hl} exceeds 256 (row permutations are stored as uint8)")
    return hl, kl, ra, ca


def n_words(w: int) -> int:
    return -(-w // 64)


def popcount_words(words: np.ndarray) -> np.ndarray:
    """Popcount of each uint64 along the last axis, summed: [..., nw] -> [...] int64."""
    return np.bitwise_count(np.asarray(words, dtype=np.uint64)).sum(axis=-1, dtype=np.int64)


def groups_from_perm(perm: np.ndarray, r_a: int) -> list[tuple[int, ...]]:
    """Row groups realised by a permutation: group i = (perm[i], perm[h+i], ..., perm[(R_A-1)h+i])."""
    perm = np.asarray(perm)
    h = perm.size // r_a
    return [tuple(int(x) for x in perm[i::h]) for i in range(h)]


def canonical_perm(groups, h_l: int) -> np.ndarray:
    """docs/format.md, "IE-BME": sort rows inside each group, sort groups, then list first rows, second rows, ..."""
    gs = sorted(tuple(sorted(int(x) for x in g)) for g in groups)
    if not gs:
        return np.zeros(0, dtype=np.int64)
    r_a = len(gs[0])
    if any(len(g) != r_a for g in gs) or len(gs) * r_a != h_l:
        raise SolverError(f"groups {gs} do not partition {h_l} rows into groups of equal size")
    perm = np.array([g[a] for a in range(r_a) for g in gs], dtype=np.int64)
    if not np.array_equal(np.sort(perm), np.arange(h_l)):
        raise SolverError(f"groups {gs} are not a partition of 0..{h_l - 1}")
    return perm


def check_perm_1d(perm, h_l: int) -> np.ndarray:
    perm = np.asarray(perm)
    if perm.shape != (h_l,) or not np.issubdtype(perm.dtype, np.integer):
        raise SolverError(f"perm must be an integer array of shape ({h_l},), got {perm.dtype} {perm.shape}")
    if not np.array_equal(np.sort(perm), np.arange(h_l)):
        raise SolverError(f"perm is not a permutation of 0..{h_l - 1}")
    return perm.astype(np.int64)


@njit(cache=True)
def fold_tile_into(mp, r0: int, k0: int, h_l: int, c_a: int, w: int, out) -> None:
    """Fold rows r0..r0+h_l-1, columns k0..k0+c_a*w-1 of a padded bool matrix into ``out`` [h_l, nw]."""
    nw = out.shape[1]
    for r in range(h_l):
        for q in range(nw):
            out[r, q] = 0
        row = mp[r0 + r]
        for c in range(c_a):
            base = k0 + c * w
            for j in range(w):
                if row[base + j]:
                    out[r, j >> 6] |= np.uint64(1) << np.uint64(j & 63)
