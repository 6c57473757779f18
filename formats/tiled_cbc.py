"""Tiled-CBC: Tiled Column-wise Bitmap Compressed (SPDP), byte layout of docs/format.md, "Tiled-CBC".

GTiles of TILE_M x TILE_K (default 256 x 16), row-major; inside a GTile its TILE_K columns in order,
each a TILE_M x 1 column tile with TILE_M/64 bitmap words. Values hold each column's nonzeros in
increasing row order, each column's run padded with zeros to 16 bytes, so a decode kernel can skip
any column (dynamic pruning) from ColInfo alone.
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
from .storage_stats import figures, scale_bytes, tiled_cbc_formula

NAME = "tiled-cbc"
DEFAULT_TILE = (256, 16)


@dataclass(frozen=True)
class Geometry:
    shape: tuple[int, int]
    tile: tuple[int, int]
    bits: int | None  # None: float16 values

    def __post_init__(self) -> None:
        tm, tk = self.tile
        if tm <= 0 or tk <= 0 or tm % 64:
            raise FormatError(f"Tiled-CBC tile {tm}x{tk}: TILE_M must be a positive multiple of 64")
        if self.bits is not None:
            check_bits(self.bits)
        # ColInfo packs the in-GTile offset and the column count into 16 bits each
        if tk * round_up(tm, self.align) >= 1 << 16 or tm >= 1 << 16:
            raise FormatError(f"Tiled-CBC tile {tm}x{tk} is too large for 16-bit ColInfo fields")

    @property
    def value_bits(self) -> int:
        return 16 if self.bits is None else self.bits

    @property
    def align(self) -> int:
        """Values per 16 bytes: every column run is padded to this many values."""
        return 128 // self.value_bits

    @property
    def padded(self) -> tuple[int, int]:
        return int(round_up(self.shape[0], self.tile[0])), int(round_up(self.shape[1], self.tile[1]))

    @property
    def grid(self) -> tuple[int, int]:
        mp, kp = self.padded
        return mp // self.tile[0], kp // self.tile[1]

    @property
    def n_gtiles(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def words_per_column(self) -> int:
        return self.tile[0] // 64


@dataclass
class TiledCBCMatrix:
    geometry: Geometry
    bitmap: np.ndarray  # uint64 [NGT * TILE_K * TILE_M/64]
    colinfo: np.ndarray  # uint32 [NGT * TILE_K]
    tile_offset: np.ndarray  # uint32 [NGT + 1], in values
    values: np.ndarray  # float16 [n] or uint8 packed codes

    @property
    def shape(self) -> tuple[int, int]:
        return self.geometry.shape

    @property
    def bits(self) -> int | None:
        return self.geometry.bits

    @property
    def tile(self) -> tuple[int, int]:
        return self.geometry.tile

    def column_counts(self) -> np.ndarray:
        g = self.geometry
        return popcount_u64(self.bitmap.reshape(-1, g.words_per_column)).sum(axis=1)

    def validate(self) -> None:
        validate(self)

    def decode(self) -> np.ndarray:
        """float16 weights or int8 codes [M, K]."""
        return decode(self)


def column_view(w_padded: np.ndarray, g: Geometry) -> np.ndarray:
    """[Mp, Kp] -> [NGT * TILE_K, TILE_M]: column tiles in storage order."""
    gr, gc = g.grid
    tm, tk = g.tile
    return w_padded.reshape(gr, tm, gc, tk).transpose(0, 2, 3, 1).reshape(gr * gc * tk, tm)


def column_unview(cols: np.ndarray, g: Geometry) -> np.ndarray:
    gr, gc = g.grid
    tm, tk = g.tile
    return cols.reshape(gr, gc, tk, tm).transpose(0, 3, 1, 2).reshape(gr * tm, gc * tk)


def encode(weights: np.ndarray, tile: tuple[int, int] = DEFAULT_TILE, bits: int | None = None) -> TiledCBCMatrix:
    """Encode float16 weights, or int8 codes of a signed b-bit quantizer (``bits`` 4 unless given)."""
    w = np.asarray(weights)
    if w.ndim != 2:
        raise FormatError(f"weights must be 2-D, got shape {w.shape}")
    if np.issubdtype(w.dtype, np.integer):
        bits = 4 if bits is None else bits
        lo, hi = code_range(bits)
        if w.size and (w.min() < lo or w.max() > hi):
            raise FormatError(f"codes out of the {bits}-bit range {lo}..{hi}")
        w = w.astype(np.int8, copy=False)
    elif w.dtype == np.float16:
        if bits is not None:
            raise FormatError("bits applies to integer codes only; float16 values are stored as is")
    else:
        raise FormatError(f"weights must be float16 or integer codes, got {w.dtype}")
    g = Geometry((int(w.shape[0]), int(w.shape[1])), (int(tile[0]), int(tile[1])), bits)
    mp, kp = g.padded
    if (mp, kp) != w.shape:
        padded = np.zeros((mp, kp), dtype=w.dtype)
        padded[: w.shape[0], : w.shape[1]] = w
        w = padded
    cols = column_view(w, g)
    nz = cols != 0
    bitmap = pack_bits_u64(nz, g.words_per_column).ravel()
    counts = nz.sum(axis=1, dtype=np.int64)
    starts = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(round_up(counts, g.align), out=starts[1:])
    tk = g.tile[1]
    tile_offset = starts[::tk]  # NGT + 1 entries: every GTile start, then the total
    in_tile = starts[:-1] - np.repeat(tile_offset[:-1], tk)
    colinfo = (in_tile << 16) | counts
    if starts[-1] >= 2**32:
        raise FormatError("layer too large: more than 2^32 values in one matrix")
    flat = np.zeros(int(starts[-1]), dtype=w.dtype)
    flat[run_positions(starts[:-1], counts)] = cols[nz]
    values = flat if bits is None else pack_codes(flat, bits)
    return TiledCBCMatrix(g, bitmap, colinfo.astype(np.uint32), tile_offset.astype(np.uint32), values)


def column_starts(m: TiledCBCMatrix) -> np.ndarray:
    """Absolute start (in values) of every column run, from TileOffset and ColInfo."""
    tk = m.geometry.tile[1]
    return np.repeat(m.tile_offset[:-1].astype(np.int64), tk) + (m.colinfo.astype(np.int64) >> 16)


def validate(m: TiledCBCMatrix) -> None:
    g = m.geometry
    ncol = g.n_gtiles * g.tile[1]
    if m.bitmap.dtype != np.uint64 or m.bitmap.shape != (ncol * g.words_per_column,):
        raise FormatError(f"bitmap must be uint64 [{ncol * g.words_per_column}], got {m.bitmap.shape}")
    if m.colinfo.dtype != np.uint32 or m.colinfo.shape != (ncol,):
        raise FormatError(f"colinfo must be uint32 [{ncol}], got {m.colinfo.dtype} {m.colinfo.shape}")
    if m.tile_offset.dtype != np.uint32 or m.tile_offset.shape != (g.n_gtiles + 1,):
        raise FormatError(f"tile_offset must be uint32 [{g.n_gtiles + 1}], got {m.tile_offset.shape}")
    counts = m.column_counts()
    if not np.array_equal(m.colinfo.astype(np.int64) & 0xFFFF, counts):
        bad = int(np.nonzero((m.colinfo.astype(np.int64) & 0xFFFF) != counts)[0][0])
        raise FormatError(f"colinfo count of column tile {bad} disagrees with its bitmap popcount")
    starts = np.zeros(ncol + 1, dtype=np.int64)
    np.cumsum(round_up(counts, g.align), out=starts[1:])
    if not np.array_equal(m.tile_offset.astype(np.int64), starts[:: g.tile[1]]):
        raise FormatError("tile_offset disagrees with the column counts")
    if not np.array_equal(column_starts(m), starts[:-1]):
        bad = int(np.nonzero(column_starts(m) != starts[:-1])[0][0])
        raise FormatError(f"colinfo offset of column tile {bad} disagrees with the column counts")
    total = int(starts[-1])
    if g.bits is None:
        if m.values.dtype != np.float16 or m.values.shape != (total,):
            raise FormatError(f"values must be float16 [{total}], got {m.values.dtype} {m.values.shape}")
    elif m.values.dtype != np.uint8 or m.values.shape != (total * g.bits // 8,):
        raise FormatError(f"values must be uint8 [{total * g.bits // 8}], got {m.values.dtype} {m.values.shape}")


def decode(m: TiledCBCMatrix) -> np.ndarray:
    validate(m)
    g = m.geometry
    flat = m.values if g.bits is None else unpack_codes(m.values, g.bits)
    nz = unpack_bits_u64(m.bitmap.reshape(-1, g.words_per_column), g.tile[0])
    cols = np.zeros(nz.shape, dtype=flat.dtype)
    cols[nz] = flat[run_positions(column_starts(m), nz.sum(axis=1, dtype=np.int64))]
    full = column_unview(cols, g)
    return np.ascontiguousarray(full[: g.shape[0], : g.shape[1]])


def from_arrays(shape, tile, bits, bitmap, colinfo, tile_offset, values) -> TiledCBCMatrix:
    """Rebuild from stored arrays and validate."""
    g = Geometry((int(shape[0]), int(shape[1])), (int(tile[0]), int(tile[1])), None if bits is None else int(bits))
    m = TiledCBCMatrix(g, np.asarray(bitmap), np.asarray(colinfo), np.asarray(tile_offset), np.asarray(values))
    validate(m)
    return m


def stack_rows(ms: Sequence[TiledCBCMatrix]) -> TiledCBCMatrix:
    """The rows of ``ms`` in one matrix, each member but the last padded with zero rows to whole GTiles (TILE_M
    rows, the first tile dimension).

    Byte for byte what :func:`encode` gives for the stacked padded matrix: GTiles are row-major over the grid and
    a member fills whole GTile rows, so its bitmap words, ColInfo (offsets inside a GTile) and 16-byte aligned
    column runs follow the previous member's unchanged; only TileOffset moves. Members must share K, tile and
    value kind (float16 values, or codes of the same bits) (FormatError)."""
    if not ms:
        raise FormatError("nothing to stack: no matrices given")
    g0 = ms[0].geometry
    for i, m in enumerate(ms[1:], 1):
        g = m.geometry
        for what, a, b in (("K", g.shape[1], g0.shape[1]), ("tile", g.tile, g0.tile),
                           ("values", _kind(g.bits), _kind(g0.bits))):
            if a != b:
                raise FormatError(f"cannot stack Tiled-CBC rows: member {i} has {what} {a}, member 0 {b}")
    rows = sum(m.geometry.padded[0] for m in ms[:-1]) + ms[-1].shape[0]
    g = Geometry((rows, g0.shape[1]), g0.tile, g0.bits)
    base = np.cumsum([0] + [int(m.tile_offset[-1]) for m in ms], dtype=np.int64)
    if base[-1] >= 2**32:
        raise FormatError("stacked layer too large: more than 2^32 values in one matrix")
    tile_offset = np.concatenate([m.tile_offset[:-1].astype(np.int64) + b for m, b in zip(ms, base[:-1], strict=True)]
                                 + [base[-1:]])
    out = TiledCBCMatrix(g, np.concatenate([m.bitmap for m in ms]), np.concatenate([m.colinfo for m in ms]),
                         tile_offset.astype(np.uint32), np.concatenate([m.values for m in ms]))
    validate(out)
    return out


def _kind(bits: int | None) -> str:
    return "float16" if bits is None else f"{bits}-bit codes"


def statistics(enc: TiledCBCMatrix, group_size: int | None = None) -> dict:
    """docs/format.md, "Statistics": the figures, plus SPDP's seed formula on the same nonzeros."""
    m, k = enc.shape
    g = enc.geometry
    nnz = int(enc.column_counts().sum())
    meta = enc.bitmap.nbytes + enc.colinfo.nbytes + enc.tile_offset.nbytes
    gs = None if g.bits is None else (128 if group_size is None else group_size)
    out = figures(m, k, nnz, g.value_bits, enc.values.nbytes, meta, scale_bytes(m, k, gs))
    out["formula_bytes"] = tiled_cbc_formula(m, k, nnz, g.tile, g.value_bits / 8)
    return out


FORMAT = registry.register(registry.Format(
    NAME, TiledCBCMatrix, DEFAULT_TILE, ("bitmap", "colinfo", "tile_offset", "values"),
    holds_fp16=True, reorders_rows=False, activation_sparsity=True, outlier_side=False, extra_geometry=(),
    encoder=lambda v, bits, tile, extra, perm: encode(v, tile=tile, bits=bits),
    rebuilder=lambda shape, bits, tile, extra, arr: from_arrays(
        shape, tile, bits, arr("bitmap", True), arr("colinfo", True), arr("tile_offset", True), arr("values", True)),
    geometry_check=lambda tile, extra, bits, group_size: Geometry((0, 0), tuple(tile), bits),
    statistics=statistics,
    kernel_ops=("spmspv", "tcbc_spmm"),
    stacker=stack_rows,
))
