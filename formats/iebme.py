"""IE-BME: Index-Efficient Bitmap Encoding (UnionSparse), byte layout of docs/format.md, "IE-BME".

A matrix of b-bit codes is cut into local tiles (LT) of H_L x K_L, row-major over the tile grid.
Each LT's rows may be permuted; the permuted tile is split into R_A x C_A areas of h x w, and one
union mask of h x w bits says where any area holds a nonzero. Every active position emits the
codes of all Q = R_A * C_A areas (zeros included) into Q aligned streams, so one rank indexes all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from . import registry
from .bitpack import (
    check_bits,
    code_range,
    pack_bits_u64,
    pack_codes,
    popcount_u64,
    round_up,
    unpack_bits_u64,
    unpack_codes,
)
from .errors import FormatError
from .runs import run_positions
from .storage_stats import figures, scale_bytes

NAME = "ie-bme"
DEFAULT_TILE = (16, 64)
DEFAULT_AREAS = (2, 2)


@dataclass(frozen=True)
class Geometry:
    """Tile geometry of an IE-BME matrix, derived from its shape, tile and area grid."""

    shape: tuple[int, int]
    tile: tuple[int, int]
    areas: tuple[int, int]
    bits: int

    def __post_init__(self) -> None:
        check_bits(self.bits)
        (hl, kl), (ra, ca) = self.tile, self.areas
        if min(hl, kl, ra, ca) <= 0:
            raise FormatError(f"tile {hl}x{kl} and areas {ra}x{ca} must be positive")
        if hl % ra or kl % ca:
            raise FormatError(f"areas {ra}x{ca} do not divide the tile {hl}x{kl}")
        if hl > 256:
            raise FormatError(f"tile height {hl} exceeds 256 (row permutations are stored as uint8)")
        if self.shape[0] < 0 or self.shape[1] < 0:
            raise FormatError(f"bad shape {self.shape}")

    @property
    def h(self) -> int:
        return self.tile[0] // self.areas[0]

    @property
    def w(self) -> int:
        return self.tile[1] // self.areas[1]

    @property
    def q(self) -> int:
        return self.areas[0] * self.areas[1]

    @property
    def padded(self) -> tuple[int, int]:
        return int(round_up(self.shape[0], self.tile[0])), int(round_up(self.shape[1], self.tile[1]))

    @property
    def grid(self) -> tuple[int, int]:
        mp, kp = self.padded
        return mp // self.tile[0], kp // self.tile[1]

    @property
    def n_tiles(self) -> int:
        tr, tc = self.grid
        return tr * tc

    @property
    def words_per_tile(self) -> int:
        return -(-(self.h * self.w) // 64)

    @property
    def align(self) -> int:
        """Codes per 16 bytes: every LT's value segment starts on a 16-byte boundary."""
        return 128 // self.bits


@dataclass
class IEBMEMatrix:
    """An encoded matrix. Arrays are exactly those stored in the artifact."""

    geometry: Geometry
    bitmaps: np.ndarray  # uint64 [T * words_per_tile]
    offsets: np.ndarray  # uint32 [T + 1], in codes
    values: np.ndarray  # uint8, packed b-bit codes
    perm: np.ndarray | None  # uint8 [T, H_L] or None for identity

    @property
    def shape(self) -> tuple[int, int]:
        return self.geometry.shape

    @property
    def bits(self) -> int:
        return self.geometry.bits

    @property
    def tile(self) -> tuple[int, int]:
        return self.geometry.tile

    @property
    def areas(self) -> tuple[int, int]:
        return self.geometry.areas

    def union_popcounts(self) -> np.ndarray:
        """P_t for every LT (number of active union-mask positions)."""
        g = self.geometry
        return popcount_u64(self.bitmaps.reshape(g.n_tiles, g.words_per_tile)).sum(axis=1)

    def validate(self) -> None:
        """Check every structural invariant; raise FormatError naming the first broken one."""
        validate(self)

    def decode(self) -> np.ndarray:
        """int8 codes [M, K] in original row order."""
        return decode(self)


def tile_view(codes_padded: np.ndarray, g: Geometry) -> np.ndarray:
    """[Mp, Kp] -> [T, H_L, K_L] with LTs row-major over the grid."""
    tr, tc = g.grid
    hl, kl = g.tile
    return codes_padded.reshape(tr, hl, tc, kl).transpose(0, 2, 1, 3).reshape(tr * tc, hl, kl)


def untile(tiles: np.ndarray, g: Geometry) -> np.ndarray:
    """Inverse of :func:`tile_view`: [T, H_L, K_L] -> [Mp, Kp]."""
    tr, tc = g.grid
    hl, kl = g.tile
    return tiles.reshape(tr, tc, hl, kl).transpose(0, 2, 1, 3).reshape(tr * hl, tc * kl)


def area_view(tiles: np.ndarray, g: Geometry) -> np.ndarray:
    """[T, H_L, K_L] -> [T, Q, h*w]; area q = a*C_A + c holds rows a*h.., columns c*w.."""
    ra, ca = g.areas
    t = tiles.shape[0]
    return tiles.reshape(t, ra, g.h, ca, g.w).transpose(0, 1, 3, 2, 4).reshape(t, g.q, g.h * g.w)


def area_unview(areas: np.ndarray, g: Geometry) -> np.ndarray:
    """Inverse of :func:`area_view`."""
    ra, ca = g.areas
    t = areas.shape[0]
    return areas.reshape(t, ra, ca, g.h, g.w).transpose(0, 1, 3, 2, 4).reshape(t, *g.tile)


def pad_to(codes: np.ndarray, padded: tuple[int, int]) -> np.ndarray:
    m, k = codes.shape
    if (m, k) == padded:
        return codes
    out = np.zeros(padded, dtype=codes.dtype)
    out[:m, :k] = codes
    return out


def check_perm(perm: np.ndarray, g: Geometry) -> np.ndarray:
    """Validate per-LT permutations: shape [T, H_L], each row a permutation of 0..H_L-1."""
    perm = np.asarray(perm)
    hl = g.tile[0]
    if perm.shape != (g.n_tiles, hl):
        raise FormatError(f"perm has shape {perm.shape}, expected ({g.n_tiles}, {hl})")
    if perm.size and (perm.min() < 0 or perm.max() >= hl):
        raise FormatError(f"perm entries must lie in 0..{hl - 1}")
    if not np.array_equal(np.sort(perm, axis=1), np.broadcast_to(np.arange(hl), perm.shape)):
        bad = int(np.nonzero((np.sort(perm, axis=1) != np.arange(hl)).any(axis=1))[0][0])
        raise FormatError(f"perm of tile {bad} is not a permutation of 0..{hl - 1}")
    return perm.astype(np.uint8)


def encode(
    codes: np.ndarray,
    bits: int = 4,
    tile: tuple[int, int] = DEFAULT_TILE,
    areas: tuple[int, int] = DEFAULT_AREAS,
    perm: np.ndarray | None = None,
) -> IEBMEMatrix:
    """Encode int8 codes [M, K] of a signed b-bit quantizer as IE-BME (docs/format.md, "IE-BME")."""
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise FormatError(f"codes must be 2-D, got shape {codes.shape}")
    if not np.issubdtype(codes.dtype, np.integer):
        raise FormatError(f"codes must be integers, got {codes.dtype}")
    g = Geometry((int(codes.shape[0]), int(codes.shape[1])), tuple(tile), tuple(areas), int(bits))
    lo, hi = code_range(bits)
    if codes.size and (codes.min() < lo or codes.max() > hi):
        raise FormatError(f"codes out of the {bits}-bit range {lo}..{hi}")
    tiles = tile_view(pad_to(codes.astype(np.int8, copy=False), g.padded), g)
    if perm is not None:
        perm = check_perm(perm, g)
        tiles = np.take_along_axis(tiles, perm[:, :, None].astype(np.intp), axis=1)
    areas_v = area_view(tiles, g)  # [T, Q, hw]
    active = (areas_v != 0).any(axis=1)  # [T, hw]
    bitmaps = pack_bits_u64(active, g.words_per_tile).ravel()
    p_t = active.sum(axis=1, dtype=np.int64)
    seg = round_up(g.q * p_t, g.align)
    offsets = np.zeros(g.n_tiles + 1, dtype=np.int64)
    np.cumsum(seg, out=offsets[1:])
    if offsets[-1] >= 2**32:
        raise FormatError("layer too large: more than 2^32 codes in one matrix")
    flat = np.zeros(int(offsets[-1]), dtype=np.int8)
    base = run_positions(offsets[:-1], p_t)  # stream-0 index of every active position, row-major
    step = np.repeat(p_t, p_t)
    for q in range(g.q):
        flat[base + q * step] = areas_v[:, q, :][active]
    return IEBMEMatrix(g, bitmaps, offsets.astype(np.uint32), pack_codes(flat, bits), perm)


def validate(m: IEBMEMatrix) -> None:
    """Structural checks a decoder needs before it may index anything (never reads out of bounds)."""
    g = m.geometry
    t, wpt = g.n_tiles, g.words_per_tile
    if m.bitmaps.dtype != np.uint64 or m.bitmaps.shape != (t * wpt,):
        raise FormatError(f"bitmaps must be uint64 [{t * wpt}], got {m.bitmaps.dtype} {m.bitmaps.shape}")
    if m.offsets.dtype != np.uint32 or m.offsets.shape != (t + 1,):
        raise FormatError(f"offsets must be uint32 [{t + 1}], got {m.offsets.dtype} {m.offsets.shape}")
    if m.values.dtype != np.uint8 or m.values.ndim != 1:
        raise FormatError("values must be a 1-D uint8 array")
    hw = g.h * g.w
    if hw % 64:
        tail = np.uint64((1 << (hw % 64)) - 1)
        if np.any(m.bitmaps.reshape(t, wpt)[:, -1] & ~tail):
            raise FormatError("bitmaps have bits set beyond the union mask")
    offs = m.offsets.astype(np.int64)
    if offs[0] != 0:
        raise FormatError("offsets[0] must be 0")
    p_t = m.union_popcounts()
    expected = np.zeros(t + 1, dtype=np.int64)
    np.cumsum(round_up(g.q * p_t, g.align), out=expected[1:])
    if not np.array_equal(offs, expected):
        bad = int(np.nonzero(offs != expected)[0][0])
        raise FormatError(
            f"offsets disagree with bitmap popcounts at tile {max(bad - 1, 0)} "
            f"(offsets[{bad}]={offs[bad]}, popcounts give {expected[bad]})"
        )
    need = int(offs[-1]) * g.bits // 8
    if m.values.size != need:
        raise FormatError(f"values hold {m.values.size} bytes, offsets need {need}")
    if m.perm is not None:
        check_perm(m.perm, g)


def decode(m: IEBMEMatrix) -> np.ndarray:
    """Decode to int8 codes [M, K] in original row order (validates first)."""
    validate(m)
    g = m.geometry
    flat = unpack_codes(m.values, g.bits)
    active = unpack_bits_u64(m.bitmaps.reshape(g.n_tiles, g.words_per_tile), g.h * g.w)
    p_t = active.sum(axis=1, dtype=np.int64)
    base = run_positions(m.offsets[:-1].astype(np.int64), p_t)
    step = np.repeat(p_t, p_t)
    areas_v = np.zeros((g.n_tiles, g.q, g.h * g.w), dtype=np.int8)
    for q in range(g.q):
        areas_v[:, q, :][active] = flat[base + q * step]
    tiles = area_unview(areas_v, g)
    if m.perm is not None:
        inv = np.argsort(m.perm, axis=1).astype(np.intp)
        tiles = np.take_along_axis(tiles, inv[:, :, None], axis=1)
    full = untile(tiles, g)
    return np.ascontiguousarray(full[: g.shape[0], : g.shape[1]])


def from_arrays(
    shape: tuple[int, int],
    bits: int,
    tile: tuple[int, int],
    areas: tuple[int, int],
    bitmaps: np.ndarray,
    offsets: np.ndarray,
    values: np.ndarray,
    perm: np.ndarray | None,
) -> IEBMEMatrix:
    """Rebuild a matrix from stored arrays (as read from an artifact) and validate it."""
    g = Geometry((int(shape[0]), int(shape[1])), (int(tile[0]), int(tile[1])), (int(areas[0]), int(areas[1])),
                 int(bits))
    m = IEBMEMatrix(g, np.asarray(bitmaps), np.asarray(offsets), np.asarray(values),
                    None if perm is None else np.asarray(perm))
    validate(m)
    return m


def stack_rows(ms: Sequence[IEBMEMatrix]) -> IEBMEMatrix:
    """The rows of ``ms`` in one matrix, each member but the last padded with zero rows to whole tiles.

    Byte for byte what :func:`encode` gives for the stacked padded codes with the members' permutations
    concatenated (identity for a member without any): LTs are row-major over the grid and a member fills whole
    grid rows, so its bitmaps, value segments (16-byte aligned) and per-LT permutations follow the previous
    member's unchanged; only the offsets move. Members must share K, bits, tile and areas (FormatError)."""
    if not ms:
        raise FormatError("nothing to stack: no matrices given")
    g0 = ms[0].geometry
    for i, m in enumerate(ms[1:], 1):
        g = m.geometry
        for what, a, b in (("K", g.shape[1], g0.shape[1]), ("bits", g.bits, g0.bits), ("tile", g.tile, g0.tile),
                           ("areas", g.areas, g0.areas)):
            if a != b:
                raise FormatError(f"cannot stack IE-BME rows: member {i} has {what} {a}, member 0 {b}")
    rows = sum(m.geometry.padded[0] for m in ms[:-1]) + ms[-1].shape[0]
    g = Geometry((rows, g0.shape[1]), g0.tile, g0.areas, g0.bits)
    base = np.cumsum([0] + [int(m.offsets[-1]) for m in ms], dtype=np.int64)
    if base[-1] >= 2**32:
        raise FormatError("stacked layer too large: more than 2^32 codes in one matrix")
    offsets = np.concatenate([m.offsets[:-1].astype(np.int64) + b for m, b in zip(ms, base[:-1], strict=True)]
                             + [base[-1:]])
    perm = None
    if any(m.perm is not None for m in ms):
        ident = np.arange(g0.tile[0], dtype=np.uint8)
        perm = np.concatenate([m.perm if m.perm is not None else np.tile(ident, (m.geometry.n_tiles, 1))
                               for m in ms]).astype(np.uint8)
    out = IEBMEMatrix(g, np.concatenate([m.bitmaps for m in ms]), offsets.astype(np.uint32),
                      np.concatenate([m.values for m in ms]), perm)
    validate(out)
    return out


def statistics(enc: IEBMEMatrix, group_size: int | None = None) -> dict:
    """docs/format.md, "Statistics": the figures, plus the union positions the row reordering minimises."""
    m, k = enc.shape
    g = enc.geometry
    nnz = int(np.count_nonzero(unpack_codes(enc.values, g.bits)))
    meta = enc.bitmaps.nbytes + enc.offsets.nbytes + (0 if enc.perm is None else enc.perm.nbytes)
    gs = 128 if group_size is None else group_size
    out = figures(m, k, nnz, g.bits, enc.values.nbytes, meta, scale_bytes(m, k, gs))
    positions = int(enc.union_popcounts().sum())
    out["union_positions"] = positions
    out["union_density"] = positions / (g.n_tiles * g.h * g.w) if g.n_tiles else 0.0
    return out


def _check_geometry(tile, extra, bits, group_size) -> None:
    Geometry((0, 0), tuple(tile), tuple(extra["areas"] or DEFAULT_AREAS), 4 if bits is None else bits)
    if group_size is not None and group_size % tile[1]:  # a tile must lie inside one scale group
        raise FormatError(f"group size {group_size} must be a multiple of the tile width {tile[1]}")


FORMAT = registry.register(registry.Format(
    NAME, IEBMEMatrix, DEFAULT_TILE, ("bitmaps", "offsets", "values", "perm"),
    holds_fp16=False, reorders_rows=True, activation_sparsity=False, outlier_side=True, extra_geometry=("areas",),
    encoder=lambda v, bits, tile, extra, perm: encode(v, bits, tile, extra["areas"] or DEFAULT_AREAS, perm),
    rebuilder=lambda shape, bits, tile, extra, arr: from_arrays(
        shape, bits, tile, extra["areas"], arr("bitmaps", True), arr("offsets", True), arr("values", True),
        arr("perm", False)),
    geometry_check=_check_geometry,
    statistics=statistics,
    kernel_ops=("iebme_spmm", "side_product"),
    stacker=stack_rows,
))
