"""Stacking encoded matrices of one format by rows: the matrix of several linears that read the same input
(Q/K/V, gate/up) built from their separate encodings, for the runtime to run as one product.

Each member is padded with zero rows to whole tiles of rows (IE-BME: H_L, Tiled-CBC: TILE_M), so no tile
straddles two members and the stacked encoding is, byte for byte, what the format's encoder writes for the
stacked padded matrix (IE-BME with the members' per-tile row permutations concatenated). The arrays are
concatenated, not decoded and re-encoded; only the offsets into the values move.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import registry
from .errors import FormatError
from .registry import Matrix


def row_offsets(matrices: Sequence[Matrix]) -> list[int]:
    """First row of each member in the stacked matrix: every member before it padded to whole tiles of rows."""
    out, row = [], 0
    for m in matrices:
        out.append(row)
        row += int(m.geometry.padded[0])
    return out


def stack_rows(matrices: Sequence[Matrix]) -> tuple[Matrix, list[int]]:
    """(the members' rows in one matrix, the first row of each member in it).

    Rows between a member's last row and the next member's offset are all zero; the stacked shape is the last
    offset plus the last member's rows. The members must be of one format and share K, bits, tile, areas
    (IE-BME) and value kind (Tiled-CBC float16 or codes); otherwise ``FormatError`` says which differs."""
    if not matrices:
        raise FormatError("nothing to stack: no matrices given")
    fmt = registry.of(matrices[0])
    for i, m in enumerate(matrices[1:], 1):
        other = registry.of(m)
        if other is not fmt:
            raise FormatError(f"cannot stack rows: member {i} is {other.name}, member 0 {fmt.name}")
    if fmt.stacker is None:
        raise FormatError(f"{fmt.name} matrices cannot be stacked by rows")
    if len(matrices) == 1:
        return matrices[0], [0]
    return fmt.stacker(list(matrices)), row_offsets(matrices)
