"""formats.stacking: encodings stacked by rows are byte for byte the encoder's output for the stacked padded
matrix (IE-BME with the concatenated per-tile permutations), decode to each member at its offset, and members
that do not match are refused."""

from __future__ import annotations

import numpy as np
import pytest
from unionsparse.formats import FormatError, iebme, registry, tiled_cbc
from unionsparse.formats.stacking import row_offsets, stack_rows


def _codes(rng, m, k, bits=4, density=0.4):
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    return (rng.integers(lo, hi, (m, k)) * (rng.random((m, k)) < density)).astype(np.int8)


def _padded(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros((rows, a.shape[1]), a.dtype)
    out[: a.shape[0]] = a
    return out


def _vstack(members: list[np.ndarray], tile_rows: int) -> tuple[np.ndarray, list[int]]:
    """The members stacked, each but the last padded with zero rows to a multiple of ``tile_rows``."""
    parts, offs, row = [], [], 0
    for i, a in enumerate(members):
        offs.append(row)
        rows = a.shape[0] if i == len(members) - 1 else -(-a.shape[0] // tile_rows) * tile_rows
        parts.append(_padded(a, rows))
        row += rows
    return np.concatenate(parts), offs


def _same_bytes(a, b) -> None:
    fmt = registry.of(a)
    assert registry.of(b) is fmt and a.shape == b.shape
    assert fmt.geometry_attrs(a) == fmt.geometry_attrs(b)
    x, y = fmt.to_arrays(a), fmt.to_arrays(b)
    assert sorted(x) == sorted(y)
    for k in x:
        assert x[k].dtype == y[k].dtype and x[k].tobytes() == y[k].tobytes(), k


@pytest.mark.parametrize("rows", [(32, 16, 48), (40, 7, 23), (5,), (16, 0, 9), (64, 64)])
@pytest.mark.parametrize("bits", [4, 2])
def test_iebme_stack_is_the_encoding_of_the_stacked_codes(rows, bits):
    rng = np.random.default_rng(sum(rows) + bits)
    k, tile, areas = 200, (16, 64), (2, 2)
    codes = [_codes(rng, m, k, bits) for m in rows]
    perms = []
    members = []
    for i, c in enumerate(codes):
        g = iebme.Geometry(c.shape, tile, areas, bits)
        p = None if i % 2 else np.stack([rng.permutation(16) for _ in range(g.n_tiles)]).astype(np.uint8)
        perms.append(p if p is not None else np.tile(np.arange(16, dtype=np.uint8), (g.n_tiles, 1)))
        members.append(iebme.encode(c, bits, tile, areas, p))
    stacked, offs = stack_rows(members)
    big, want_offs = _vstack(codes, tile[0])
    assert offs == want_offs == row_offsets(members)
    _same_bytes(stacked, iebme.encode(big, bits, tile, areas, np.concatenate(perms)))
    dec = stacked.decode()
    assert np.array_equal(dec, big)
    for o, c in zip(offs, codes, strict=True):
        assert np.array_equal(dec[o : o + c.shape[0]], c)
    assert all(o % tile[0] == 0 for o in offs)


def test_iebme_stack_without_permutations_has_none():
    rng = np.random.default_rng(1)
    ms = [iebme.encode(_codes(rng, m, 128)) for m in (20, 33)]
    stacked, offs = stack_rows(ms)
    assert stacked.perm is None and offs == [0, 32]
    big, _ = _vstack([m.decode() for m in ms], 16)
    _same_bytes(stacked, iebme.encode(big))


@pytest.mark.parametrize("rows", [(256, 256), (100, 300, 37), (64,), (512, 1, 256)])
@pytest.mark.parametrize("kind", ["fp16", 4, 2])
def test_tiled_cbc_stack_is_the_encoding_of_the_stacked_matrix(rows, kind):
    rng = np.random.default_rng(sum(rows))
    k, tile = 72, tiled_cbc.DEFAULT_TILE  # (TILE_M, TILE_K): TILE_M rows per GTile
    if kind == "fp16":
        mats = [(rng.standard_normal((m, k)) * (rng.random((m, k)) < 0.4)).astype(np.float16) for m in rows]
        bits = None
    else:
        mats, bits = [_codes(rng, m, k, kind) for m in rows], kind
    members = [tiled_cbc.encode(a, tile, bits) for a in mats]
    stacked, offs = stack_rows(members)
    big, want_offs = _vstack(mats, tile[0])
    assert offs == want_offs and all(o % tile[0] == 0 for o in offs)
    _same_bytes(stacked, tiled_cbc.encode(big, tile, bits))
    dec = stacked.decode()
    for o, a in zip(offs, mats, strict=True):
        assert np.array_equal(dec[o : o + a.shape[0]], a)
        assert not dec[o + a.shape[0] : o + -(-a.shape[0] // tile[0]) * tile[0]].any()  # padding rows are zero


def test_tiled_cbc_stack_with_another_tile():
    rng = np.random.default_rng(3)
    mats = [_codes(rng, m, 40) for m in (70, 64, 3)]
    ms = [tiled_cbc.encode(a, (64, 8), 4) for a in mats]
    stacked, offs = stack_rows(ms)
    assert offs == [0, 128, 192]
    _same_bytes(stacked, tiled_cbc.encode(_vstack(mats, 64)[0], (64, 8), 4))


def test_single_member_is_returned_as_is():
    m = iebme.encode(_codes(np.random.default_rng(0), 20, 64))
    stacked, offs = stack_rows([m])
    assert stacked is m and offs == [0]


def test_incompatible_members_are_refused_in_one_line():
    rng = np.random.default_rng(2)
    c = _codes(rng, 32, 128)
    base = iebme.encode(c)
    refused = [
        ([base, iebme.encode(_codes(rng, 32, 64))], "K 64"),
        ([base, iebme.encode(_codes(rng, 32, 128, 2), 2)], "bits 2"),
        ([base, iebme.encode(c, 4, (32, 64))], "tile (32, 64)"),
        ([base, iebme.encode(c, 4, (16, 64), (4, 1))], "areas (4, 1)"),
        ([base, tiled_cbc.encode(c)], "member 1 is tiled-cbc"),
        ([tiled_cbc.encode(c), tiled_cbc.encode(c.astype(np.float16))], "values float16"),
        ([tiled_cbc.encode(c), tiled_cbc.encode(c, bits=8)], "values 8-bit codes"),
        ([tiled_cbc.encode(c), tiled_cbc.encode(c, (64, 16))], "tile (64, 16)"),
        ([tiled_cbc.encode(c), tiled_cbc.encode(c[:, :96])], "K 96"),
        ([], "no matrices"),
    ]
    for ms, msg in refused:
        with pytest.raises(FormatError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
            stack_rows(ms)
        assert "\n" not in str(e.value)
