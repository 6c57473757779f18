"""Fuzz: mutate the arrays of valid IE-BME and Tiled-CBC encodings (as read back from a store); the reader
must raise FormatError or decode to a well-formed matrix, never crash, read out of bounds or hang."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from unionsparse.formats import iebme, tiled_cbc
from unionsparse.formats.errors import FormatError
from unionsparse.formats.registry import Matrix


def codes(m: int, k: int, bits: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lo, hi = (-8, 7) if bits == 4 else (-2, 1)
    c = rng.integers(lo, hi + 1, size=(m, k)).astype(np.int8)
    c[rng.random((m, k)) < 0.5] = 0
    return c


@pytest.fixture(scope="module")
def iebme_case():
    c = codes(40, 150, 4, 0)  # padded in both directions
    t = (-(-40 // 16)) * (-(-150 // 64))
    perm = np.stack([np.random.default_rng(i).permutation(16) for i in range(t)]).astype(np.uint8)
    m = iebme.encode(c, 4, (16, 64), (2, 2), perm)
    perm = m.perm
    arrays = {"bitmaps": m.bitmaps, "offsets": m.offsets, "values": m.values, "perm": perm}
    return c, arrays


@pytest.fixture(scope="module")
def cbc_case():
    c = codes(300, 40, 4, 1)
    m = tiled_cbc.encode(c, tile=(256, 16), bits=4)
    return c, {"bitmap": m.bitmap, "colinfo": m.colinfo, "tile_offset": m.tile_offset, "values": m.values}


def mutate(a: np.ndarray, kind: str, pos: int, val: int, n: int) -> np.ndarray:
    a = a.copy()
    if kind == "set" and a.size:
        info = np.iinfo(a.dtype)
        a.reshape(-1)[pos % a.size] = np.array(val % (int(info.max) + 1)).astype(a.dtype)
    elif kind == "bitflip" and a.size:
        flat = a.reshape(-1).view(np.uint8)
        flat[pos % flat.size] ^= np.uint8(1 << (val % 8))
    elif kind == "truncate":
        a = a.reshape(-1)[: max(0, a.size - 1 - n)]
    elif kind == "extend":
        a = np.concatenate([a.reshape(-1), np.full(n + 1, val, dtype=np.uint64).astype(a.dtype)])
    elif kind == "retype":
        a = a.astype(np.int64)
    return a


MUTATION = st.tuples(st.sampled_from(["set", "set", "bitflip", "bitflip", "truncate", "extend", "retype"]),
                     st.integers(0, 1 << 20), st.integers(0, (1 << 64) - 1), st.integers(0, 64))
SETTINGS = settings(max_examples=150, deadline=2000, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def check_decode(decoded: np.ndarray, shape: tuple[int, int], bits: int) -> None:
    assert decoded.shape == shape and decoded.dtype == np.int8
    lo, hi = (-8, 7) if bits == 4 else (-2, 1)
    assert decoded.min() >= lo and decoded.max() <= hi


def iebme_from(shape: tuple[int, int], a: dict[str, np.ndarray]) -> iebme.IEBMEMatrix:
    """The IE-BME matrix of ``iebme_case``'s geometry read back from the arrays ``a``."""
    return iebme.from_arrays(shape, 4, (16, 64), (2, 2), a["bitmaps"], a["offsets"], a["values"], a["perm"])


def cbc_from(shape: tuple[int, int], a: dict[str, np.ndarray]) -> tiled_cbc.TiledCBCMatrix:
    """The Tiled-CBC matrix of ``cbc_case``'s geometry read back from the arrays ``a``."""
    return tiled_cbc.from_arrays(shape, (256, 16), 4, a["bitmap"], a["colinfo"], a["tile_offset"], a["values"])


def check_mutation(case: tuple[np.ndarray, dict[str, np.ndarray]], key: str, mut: tuple,
                   read_back: Callable[[tuple[int, int], dict[str, np.ndarray]], Matrix]) -> None:
    """Array ``key`` of ``case`` mutated by ``mut`` and read back by ``read_back(shape, arrays)``: FormatError, or a
    well-formed decode (the original codes when the mutation changed nothing)."""
    c, arrays = case
    bad = dict(arrays)
    bad[key] = mutate(arrays[key], *mut)
    try:
        out = read_back(c.shape, bad).decode()
    except FormatError:
        return
    check_decode(out, c.shape, 4)
    if all(np.array_equal(bad[k], arrays[k]) and bad[k].dtype == arrays[k].dtype for k in arrays):
        assert np.array_equal(out, c)


@SETTINGS
@given(key=st.sampled_from(["bitmaps", "offsets", "values", "perm"]), mut=MUTATION)
def test_iebme_mutations(iebme_case, key, mut):
    check_mutation(iebme_case, key, mut, iebme_from)


@SETTINGS
@given(key=st.sampled_from(["bitmap", "colinfo", "tile_offset", "values"]), mut=MUTATION)
def test_tiled_cbc_mutations(cbc_case, key, mut):
    check_mutation(cbc_case, key, mut, cbc_from)


def test_unmutated_cases_decode_exactly(iebme_case, cbc_case):
    for (c, a), read_back in ((iebme_case, iebme_from), (cbc_case, cbc_from)):
        assert np.array_equal(read_back(c.shape, a).decode(), c)
