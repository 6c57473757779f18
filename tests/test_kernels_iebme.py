"""IE-BME SpMM: the CPU reference against dense integer products, and the GPU kernel against the reference."""

from __future__ import annotations

import numpy as np
import pytest
from unionsparse.formats import iebme
from unionsparse.kernels import available
from unionsparse.kernels.activations import quantize_activations
from unionsparse.kernels.iebme_check import check_iebme_layer, dense_partials, fp16_close
from unionsparse.kernels.iebme_reference import iebme_spmm_reference, scale_partials


def random_layer(rng, m, k, bits, sparsity=0.5, perm="random", tile=(16, 64), areas=(2, 2)):
    lo, hi = (-8, 7) if bits == 4 else (-2, 1)
    codes = rng.integers(lo, hi + 1, (m, k)).astype(np.int8)
    codes[rng.random((m, k)) < sparsity] = 0
    g = iebme.Geometry((m, k), tile, areas, bits)
    p = None
    if perm == "random":
        p = np.stack([rng.permutation(tile[0]) for _ in range(g.n_tiles)]).astype(np.uint8)
    elif perm == "identity":
        p = np.tile(np.arange(tile[0], dtype=np.uint8), (g.n_tiles, 1))
    return codes, iebme.encode(codes, bits=bits, tile=tile, areas=areas, perm=p)


@pytest.mark.parametrize("m,k,bits,perm,gs,tile,areas", [
    (64, 256, 4, "none", 128, (16, 64), (2, 2)),
    (37, 200, 4, "random", 64, (16, 64), (2, 2)),
    (50, 130, 2, "random", 130, (16, 64), (2, 2)),
    (24, 96, 4, "random", 96, (8, 32), (2, 1)),     # other geometries: the reference is generic
    (33, 70, 2, "none", 64, (16, 64), (4, 2)),
])
def test_reference_partials_match_dense_codes(m, k, bits, perm, gs, tile, areas):
    rng = np.random.default_rng(m * k + bits)
    codes, mat = random_layer(rng, m, k, bits, perm=perm, tile=tile, areas=areas)
    x = rng.integers(-8, 8, (5, k)).astype(np.int8)
    g = -(-k // gs)
    ws = (rng.random((m, g)) + 0.5).astype(np.float16)
    xs = (rng.random((5, g)) + 0.5).astype(np.float32)
    y, part = iebme_spmm_reference(mat, ws, x, xs, gs)
    assert part.dtype == np.int32 and part.shape == (5, m, g)
    np.testing.assert_array_equal(part, dense_partials(codes, x, gs))
    # scaled output: fp32 accumulation of scaled groups, fp16 once; close to float64 math
    want = np.einsum("nmg,mg,ng->nm", part.astype(np.float64), ws.astype(np.float64), xs.astype(np.float64))
    assert y.dtype == np.float16
    assert fp16_close(y, want.astype(np.float16)).all()


def test_reference_reads_the_format_not_decode():
    """Corrupting one value byte changes the reference (it reads the arrays), permutations move rows."""
    rng = np.random.default_rng(3)
    codes, mat = random_layer(rng, 32, 128, 4, sparsity=0.0, perm="random")
    x = rng.integers(-8, 8, (2, 128)).astype(np.int8)
    ones = np.ones((32, 1), np.float16), np.ones((2, 1), np.float32)
    _, p0 = iebme_spmm_reference(mat, ones[0], x, ones[1], 128)
    mat.values[0] ^= 0x0F
    _, p1 = iebme_spmm_reference(mat, ones[0], x, ones[1], 128)
    assert not np.array_equal(p0, p1)
    mat.values[0] ^= 0x0F
    swapped = mat.perm.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    other = iebme.IEBMEMatrix(mat.geometry, mat.bitmaps, mat.offsets, mat.values, swapped)
    _, p2 = iebme_spmm_reference(other, ones[0], x, ones[1], 128)
    r0, r1 = int(mat.perm[0, 0]), int(mat.perm[0, 1])
    diff = np.nonzero((p2 != p0).any(axis=(0, 2)))[0]
    assert set(diff) <= {r0, r1} and len(diff) > 0


def test_scale_order_is_fp32_group_order():
    part = np.array([[[1_000_000, -999_999, 3]]], dtype=np.int32)  # [N=1, M=1, G=3]
    ws = np.array([[1.0, 1.0, 0.001]], np.float16)
    xs = np.array([[1.0, 1.0, 1.0]], np.float32)
    acc = np.float32(0)
    for g in range(3):
        acc = acc + np.float32(ws[0, g]) * xs[0, g] * np.float32(part[0, 0, g])
    assert scale_partials(part, ws, xs)[0, 0] == np.float16(acc)


def test_quantize_activations_rule():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 300)).astype(np.float32)
    codes, scales = quantize_activations(x, 4, 128)
    assert codes.dtype == np.int8 and scales.shape == (3, 3)
    assert codes.min() >= -8 and codes.max() <= 7
    s = np.repeat(scales.astype(np.float32), 128, axis=1)[:, :300]
    assert np.abs(codes * s - x).max() <= s.max() / 2 + 1e-6


def test_launch_rows_are_padded_for_every_warp_count(monkeypatch):
    """The scale array and split-K workspace cover whole CTAs for every warp count a launch may use (the
    final reduction of a CTA walks all its rows), and a warp count outside the choices is refused."""
    from unionsparse.kernels import iebme_spmm as ks

    for m in [1, 15, 16, 17, 100, 257, 1000, 4096, 11008, 32000]:
        tr = -(-m // 16)
        for w in ks.WARP_CHOICES:
            assert -(-tr // w) * w * 16 <= ks.padded_rows(m), (m, w)
    assert ks.config(1)[1] in ks.WARP_CHOICES and ks.config(32)[1] in ks.WARP_CHOICES
    assert ks.x_budget() == ks.X_BUDGET
    monkeypatch.setenv("UNIONSPARSE_IEBME_XBYTES", "6144")
    assert ks.x_budget() == 6144
    monkeypatch.setenv("UNIONSPARSE_IEBME_WARPS", "3")
    with pytest.raises(ValueError, match="WARPS"):
        ks.config(1)


def test_check_layer_cpu_passes_and_catches_corruption():
    rng = np.random.default_rng(5)
    _, mat = random_layer(rng, 48, 192, 4)
    ws = (rng.random((48, 2)) + 0.5).astype(np.float16)
    assert check_iebme_layer(mat, ws, 128, 4, [1, 8], "cpu", rng) == []


gpu = pytest.mark.skipif(not available(), reason="needs CuPy and a CUDA device")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("perm", ["none", "random"])
@pytest.mark.parametrize("m,k,gs", [(64, 512, 128), (100, 1000, 64), (333, 4100, 4100), (48, 2048, 256)])
def test_gpu_partials_exact_and_output_close(bits, perm, m, k, gs):
    from unionsparse.kernels.iebme_spmm import prepare_layer, single_chunk, spmm_iebme

    rng = np.random.default_rng(m + k + bits)
    codes, mat = random_layer(rng, m, k, bits, perm=perm)
    g = -(-k // gs)
    ws = (rng.random((m, g)) + 0.5).astype(np.float16)
    layer = prepare_layer(mat, ws, gs)
    for n in (1, 5, 8, 13, 32, 40):
        x = rng.standard_normal((n, k)).astype(np.float32)
        xq, xs = quantize_activations(x, 4, gs)
        y_ref, p_ref = iebme_spmm_reference(mat, ws, xq, xs, gs)
        for splits in (1, 3):
            p = spmm_iebme(layer, xq, xs, splits=splits, debug_partials=True).get()
            np.testing.assert_array_equal(p, p_ref)
            y = spmm_iebme(layer, xq, xs, splits=splits).get()
            assert not np.isnan(y).any()
            if single_chunk(layer, n, splits):
                np.testing.assert_array_equal(y, y_ref)  # same operations in the same order
            assert fp16_close(y, y_ref).all()


@gpu
@pytest.mark.gpu
def test_gpu_check_layer():
    rng = np.random.default_rng(9)
    _, mat = random_layer(rng, 256, 1024, 4)
    ws = (rng.random((256, 8)) + 0.5).astype(np.float16)
    assert check_iebme_layer(mat, ws, 128, 4, [1, 8, 32], "cupy", rng) == []


def test_kernel_sources_compile_under_nvrtc_without_libc_headers():
    """CuPy compiles the .cu files at run time with NVRTC, which has no C library headers.

    The H200 run of `verify --backend cupy` once failed with "cannot open source file stdint.h" when no
    prebuilt cubin was present; this guards every bundled kernel source against it.
    """
    import re
    from pathlib import Path

    kdir = Path(__file__).resolve().parents[1] / "kernels"
    for cu in sorted(kdir.glob("*.cu")):
        bad = re.findall(r"#include\s*<([^>]+)>", cu.read_text())
        libc = [h for h in bad if h.endswith(".h") and not h.startswith(("cuda", "mma", "cuda_fp16"))]
        assert not libc, f"{cu.name} includes {libc}"
