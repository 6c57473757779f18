"""IE-BME and Tiled-CBC byte layouts against hand-built cases, the worked example of docs/format.md, and properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from unionsparse.formats import FormatError, baselines, iebme, stats, tca_bme_formula, tiled_cbc, tiled_cbc_formula
from unionsparse.formats.bitpack import code_range, pack_codes, unpack_codes


def random_codes(rng, m, k, bits, density=0.5):
    lo, hi = code_range(bits)
    c = rng.integers(lo, hi + 1, (m, k)).astype(np.int8)
    c[rng.random((m, k)) >= density] = 0
    return c


# ------------------------------------------------------------------------------------------ bit packing


def test_pack_codes_little_endian_nibbles():
    codes = np.array([1, -1, 7, -8, 0, 3, -2, 5] * 4, dtype=np.int8)
    packed = pack_codes(codes, 4)
    assert packed[0] == 0xF1  # code 0 in the low nibble, code 1 (-1 = 0xF) in the high nibble
    assert packed[1] == 0x87
    assert np.array_equal(unpack_codes(packed, 4), codes)


def test_pack_codes_two_bit_order():
    codes = np.array([1, -2, 0, -1] * 8, dtype=np.int8)
    packed = pack_codes(codes, 2)
    # 1 -> 01, -2 -> 10, 0 -> 00, -1 -> 11, LSB first: 0b11_00_10_01
    assert packed[0] == 0b11001001
    assert np.array_equal(unpack_codes(packed, 2), codes)


# ------------------------------------------------------------------------------------------- IE-BME


def test_spec_worked_example():
    """docs/format.md, "IE-BME" / paper Fig. 7: LT 8x32, areas 2x2."""
    rows = [0x36DB, 0x6DB6, 0x5B6D, 0xB6DA]
    mask = np.array([[(r >> j) & 1 for j in range(16)] for r in rows], dtype=bool)
    codes = np.zeros((8, 32), np.int8)
    # spread the active positions over different areas: the union is what counts
    rng = np.random.default_rng(1)
    which = rng.integers(0, 4, mask.shape)
    for q in range(4):
        a, c = divmod(q, 2)
        sel = mask & (which == q)
        codes[a * 4:(a + 1) * 4, c * 16:(c + 1) * 16][sel] = 3
    m = iebme.encode(codes, bits=4, tile=(8, 32), areas=(2, 2))
    assert m.bitmaps.tolist() == [0xB6DA5B6D6DB636DB]
    assert m.union_popcounts().tolist() == [40]
    assert m.offsets.tolist() == [0, 160]
    assert m.values.nbytes == 80
    assert np.array_equal(m.decode(), codes)


def test_aligned_streams_hand_built():
    """One LT 4x4, areas 2x2 of 2x2 each: one rank indexes all four streams, zeros emitted."""
    codes = np.zeros((4, 4), np.int8)
    codes[0, 1] = 1  # area 0 (rows 0-1, cols 0-1), position (0, 1)
    codes[2, 3] = -3  # area 3 (rows 2-3, cols 2-3), position (0, 1)
    codes[3, 0] = 5  # area 2 (rows 2-3, cols 0-1), position (1, 0)
    m = iebme.encode(codes, bits=4, tile=(4, 4), areas=(2, 2))
    # union positions: (0,1) -> bit 1, (1,0) -> bit 2
    assert m.bitmaps.tolist() == [0b110]
    p = 2
    vals = unpack_codes(m.values, 4)
    # value index q*P + rank
    assert vals[0 * p + 0] == 1 and vals[1 * p + 0] == 0 and vals[2 * p + 0] == 0 and vals[3 * p + 0] == -3
    assert vals[0 * p + 1] == 0 and vals[2 * p + 1] == 5
    assert m.offsets.tolist() == [0, 32]  # 8 codes rounded up to 32 (16 bytes of 4-bit codes)


def test_permutation_semantics():
    """W'[r] = W[perm[r]]: row perm[0] of the tile becomes row 0 of area row 0."""
    codes = np.zeros((4, 4), np.int8)
    codes[3, 0] = 2
    perm = np.array([[3, 0, 1, 2]])
    m = iebme.encode(codes, bits=4, tile=(4, 4), areas=(2, 1), perm=perm)
    # reordered row 0 = original row 3 -> area 0, position (0, 0) -> bit 0
    assert m.bitmaps.tolist() == [1]
    assert np.array_equal(m.decode(), codes)


def test_ragged_shape_pads_with_zeros():
    rng = np.random.default_rng(2)
    c = random_codes(rng, 37, 100, 4)
    m = iebme.encode(c, 4)
    assert m.geometry.padded == (48, 128)
    assert m.offsets.shape == (3 * 2 + 1,)
    assert np.array_equal(m.decode(), c)


def test_encode_rejects_bad_input():
    with pytest.raises(FormatError, match="range"):
        iebme.encode(np.full((16, 64), 8, np.int8), 4)
    with pytest.raises(FormatError, match="divide"):
        iebme.encode(np.zeros((16, 64), np.int8), 4, areas=(3, 2))
    with pytest.raises(FormatError, match="not a permutation"):
        iebme.encode(np.zeros((16, 64), np.int8), 4, perm=np.zeros((1, 16), int))


def test_validate_catches_inconsistent_offsets():
    rng = np.random.default_rng(3)
    m = iebme.encode(random_codes(rng, 32, 128, 4), 4)
    bad = m.offsets.copy()
    bad[2] += 32
    with pytest.raises(FormatError, match="offsets"):
        iebme.from_arrays(m.shape, 4, m.tile, m.areas, m.bitmaps, bad, m.values, None)
    flipped = m.bitmaps.copy()
    flipped[0] ^= np.uint64(1 << 5)
    with pytest.raises(FormatError):
        iebme.from_arrays(m.shape, 4, m.tile, m.areas, flipped, m.offsets, m.values, None)
    with pytest.raises(FormatError, match="values"):
        iebme.from_arrays(m.shape, 4, m.tile, m.areas, m.bitmaps, m.offsets, m.values[:-16], None)


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(1, 70), k=st.integers(1, 150), bits=st.sampled_from([2, 4]),
    geometry=st.sampled_from([((16, 64), (2, 2)), ((8, 32), (2, 2)), ((16, 64), (4, 1)), ((32, 64), (4, 2)),
                              ((6, 12), (3, 2)), ((16, 64), (1, 1))]),
    density=st.floats(0.0, 1.0), use_perm=st.booleans(), seed=st.integers(0, 2**31),
)
def test_iebme_roundtrip_property(m, k, bits, geometry, density, use_perm, seed):
    rng = np.random.default_rng(seed)
    tile, areas = geometry
    c = random_codes(rng, m, k, bits, density)
    g = iebme.Geometry((m, k), tile, areas, bits)
    perm = np.array([rng.permutation(tile[0]) for _ in range(g.n_tiles)]) if use_perm else None
    enc = iebme.encode(c, bits, tile, areas, perm)
    assert np.array_equal(enc.decode(), c)
    # every LT segment starts on a 16-byte boundary
    assert np.all((enc.offsets.astype(np.int64) * bits) % 128 == 0)
    # popcounts bound the true nonzeros: Q * P_t >= nnz of the tile
    assert g.q * int(enc.union_popcounts().sum()) >= np.count_nonzero(c)


# ---------------------------------------------------------------------------------------- Tiled-CBC


def test_tiled_cbc_hand_built():
    w = np.zeros((256, 16), np.float16)
    w[0, 0] = 1.5
    w[65, 0] = -2.0
    w[255, 3] = 0.25
    c = tiled_cbc.encode(w)
    bm = c.bitmap.reshape(16, 4)
    assert bm[0].tolist() == [1, 2, 0, 0]  # row 0 -> word 0 bit 0; row 65 -> word 1 bit 1
    assert bm[3].tolist() == [0, 0, 0, 1 << 63]
    # column 0: 2 values padded to 8 (16 bytes of fp16); column 3 starts at 8
    assert (c.colinfo[0] >> 16, c.colinfo[0] & 0xFFFF) == (0, 2)
    assert (c.colinfo[1] >> 16, c.colinfo[1] & 0xFFFF) == (8, 0)
    assert (c.colinfo[3] >> 16, c.colinfo[3] & 0xFFFF) == (8, 1)
    assert c.tile_offset.tolist() == [0, 16]
    assert c.values[:2].tolist() == [1.5, -2.0] and c.values[8] == 0.25
    assert np.array_equal(c.decode(), w)


def test_tiled_cbc_gtile_order_row_major():
    w = np.zeros((512, 32), np.float16)
    w[300, 20] = 7.0  # GTile (1, 1) -> index 3, column 4, row 44
    c = tiled_cbc.encode(w)
    assert c.tile_offset.tolist() == [0, 0, 0, 0, 8]
    assert c.bitmap[(3 * 16 + 4) * 4 + 0] == np.uint64(1 << 44)
    assert np.array_equal(c.decode(), w)


@settings(max_examples=50, deadline=None)
@given(m=st.integers(1, 600), k=st.integers(1, 70), kind=st.sampled_from(["fp16", 2, 4]),
       density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31), tile_m=st.sampled_from([64, 256]))
def test_tiled_cbc_roundtrip_property(m, k, kind, density, seed, tile_m):
    rng = np.random.default_rng(seed)
    if kind == "fp16":
        w = rng.standard_normal((m, k)).astype(np.float16)
        w[rng.random((m, k)) >= density] = 0
        c = tiled_cbc.encode(w, tile=(tile_m, 16))
    else:
        w = random_codes(rng, m, k, kind, density)
        c = tiled_cbc.encode(w, tile=(tile_m, 16), bits=kind)
    assert np.array_equal(c.decode(), w)
    assert c.column_counts().sum() == np.count_nonzero(w)


def test_tiled_cbc_validate_catches_bad_colinfo():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((256, 32)).astype(np.float16)
    c = tiled_cbc.encode(w)
    bad = c.colinfo.copy()
    bad[5] += 1
    with pytest.raises(FormatError, match="colinfo"):
        tiled_cbc.from_arrays(c.shape, c.tile, None, c.bitmap, bad, c.tile_offset, c.values)


# ---------------------------------------------------------------------------------------- statistics


def test_seed_formulas_match_real_bytes_on_unpadded_fp16():
    """Tiled-CBC real bytes equal SPDP's formula when no column needs padding and shapes divide."""
    w = np.zeros((512, 64), np.float16)
    w[:128] = 1.0  # 128 nonzeros per column: multiple of 8, no padding
    c = tiled_cbc.encode(w)
    s = stats(c)
    assert s["total_bytes"] == tiled_cbc_formula(512, 64, int((w != 0).sum()))
    assert s["formula_bytes"] == s["total_bytes"]
    # TCA-BME: 64x64 tiles, per-tile value runs multiple of 8 values: the formula is exact
    b = baselines(w != 0, 16, None)["tca-bme"]
    assert b["total_bytes"] == tca_bme_formula(512, 64, int((w != 0).sum())) == b["formula_bytes"]


def test_stats_iebme_definitions():
    rng = np.random.default_rng(5)
    c = random_codes(rng, 64, 256, 4, 0.5)
    m = iebme.encode(c, 4)
    s = stats(m, group_size=128)
    nnz = int(np.count_nonzero(c))
    assert s["nnz"] == nnz
    assert s["meta_bytes"] == m.bitmaps.nbytes + m.offsets.nbytes
    assert s["scale_bytes"] == 2 * 64 * 2
    assert s["pmr"] == pytest.approx(0.5 * nnz / s["meta_bytes"])
    assert s["cr"] == pytest.approx(2 * 64 * 256 / s["total_bytes"])
    assert s["bits_per_weight"] == pytest.approx(8 * s["total_bytes"] / (64 * 256))
    assert s["union_positions"] == int(m.union_popcounts().sum())


def test_baselines_csr_bytes():
    mask = np.zeros((10, 20), bool)
    mask[::2, ::3] = True
    b = baselines(mask, 4, 10)
    nnz = int(mask.sum())
    assert b["csr"]["meta_bytes"] == 4 * nnz + 4 * 11
    assert b["csr"]["payload_bytes"] == -(-nnz // 2)
    assert b["dense-fp16"]["total_bytes"] == 400
    assert b["dense-4bit"]["total_bytes"] == 100 + 2 * 10 * 2
