"""The format contract is open: this module alone defines and registers a third format, dense b-bit codes (the
baseline every sparse format is compared with), and it goes through compress, verify, inspect and generate on
the CPU without any other file knowing of it (docs/architecture.md, "Adding a format")."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
from unionsparse.formats import registry
from unionsparse.formats.bitpack import code_range, pack_codes, unpack_codes
from unionsparse.formats.errors import FormatError
from unionsparse.formats.storage_stats import figures, scale_bytes

NAME = "dense-bbit"


@dataclass(frozen=True)
class DenseMatrix:
    """Every code of an [M, K] matrix packed at ``bits`` bits, row-major (no index at all)."""

    shape: tuple[int, int]
    bits: int
    tile: tuple[int, int]
    values: np.ndarray  # uint8, the packed codes

    def decode(self) -> np.ndarray:
        m, k = self.shape
        return unpack_codes(self.values, self.bits, m * k).astype(np.int8).reshape(m, k)

    def validate(self) -> None:
        m, k = self.shape
        if self.values.dtype != np.uint8 or self.values.size * 8 != -(-m * k * self.bits // 8) * 8:
            raise FormatError(f"values: {self.values.size} bytes do not hold {m}x{k} codes of {self.bits} bits")


def encode(codes: np.ndarray, bits: int, tile: tuple[int, int]) -> DenseMatrix:
    lo, hi = code_range(bits)
    codes = np.asarray(codes)
    if codes.ndim != 2 or codes.min(initial=0) < lo or codes.max(initial=0) > hi:
        raise FormatError(f"codes must be a 2-D array in [{lo}, {hi}]")
    flat = codes.astype(np.int8).ravel()
    pad = (-flat.size * bits) % 8 // bits
    return DenseMatrix(codes.shape, bits, tuple(tile), pack_codes(np.concatenate([flat, np.zeros(pad, np.int8)]),
                                                                  bits))


def from_arrays(shape, bits, tile, values) -> DenseMatrix:
    m = DenseMatrix(tuple(shape), int(bits), tuple(tile), np.asarray(values))
    m.validate()
    return m


def statistics(m: DenseMatrix, group_size: int | None) -> dict:
    rows, cols = m.shape
    nnz = int(np.count_nonzero(m.decode()))
    return figures(rows, cols, nnz, m.bits, m.values.nbytes, 0, scale_bytes(rows, cols, group_size or 128))


def geometry(tile, extra, bits, group_size) -> None:
    if bits is None:
        raise FormatError("dense-bbit stores b-bit codes")


@pytest.fixture(scope="module")
def dense_format():
    fmt = registry.register(registry.Format(
        NAME, DenseMatrix, (1, 1), ("values",), holds_fp16=False, reorders_rows=False, activation_sparsity=False,
        outlier_side=False, extra_geometry=(),
        encoder=lambda v, bits, tile, extra, perm: encode(v, bits, tile),
        rebuilder=lambda shape, bits, tile, extra, arr: from_arrays(shape, bits, tile, arr("values", True)),
        geometry_check=geometry, statistics=statistics))
    yield fmt
    registry._REGISTRY.pop(NAME)


def test_a_registered_format_round_trips_through_the_registry(dense_format):
    codes = np.random.default_rng(0).integers(-8, 8, (37, 70)).astype(np.int8)
    m = dense_format.encode(codes, bits=4, tile=dense_format.default_tile, areas=(2, 2))  # areas: not its own
    assert registry.of(m) is dense_format and np.array_equal(m.decode(), codes)
    back = dense_format.from_arrays(dense_format.geometry_attrs(m), lambda k, req: dense_format.to_arrays(m).get(k))
    assert np.array_equal(back.decode(), codes) and dense_format.stats(m)["format"] == NAME


def test_compress_verify_inspect_and_generate_a_third_format(dense_format, llama_with_tokenizer, tmp_path, run_cli):
    from unionsparse.compressor import runtime

    model, _ = llama_with_tokenizer
    out = tmp_path / "dense.zarr"
    r = run_cli("compress", model, "-o", out, "--quiet", "--prune", "magnitude", "--sparsity", "0.5", "--quant",
                "w4a16", "--format", NAME, "--reorder", "none")
    assert r.code == 0, r.err
    r = run_cli("verify", out, "--json")
    assert r.code == 0, r.out + r.err
    r = run_cli("inspect", out, "--json")
    assert r.code == 0, r.err
    layers = json.loads(r.out)["layers"]
    assert layers and all(row["format"] == NAME for row in layers)
    rt = runtime.load(out)
    g = rt.generate([5, 17, 33], max_new_tokens=6, ignore_eos=True)
    assert len(g.ids) == 6
    r = run_cli("generate", out, "--prompt", "the model", "--max-new-tokens", "4")
    assert r.code == 0, r.err
