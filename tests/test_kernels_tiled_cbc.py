"""Tiled-CBC kernels: CPU references against float64 truth from decode(); GPU kernels when CuPy sees a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from unionsparse.formats import tiled_cbc
from unionsparse.formats.errors import FormatError
from unionsparse.kernels.loader import cupy_or_none
from unionsparse.kernels.tiled_cbc_check import check_tiled_cbc_layer, tolerance
from unionsparse.kernels.tiled_cbc_reference import (
    decoded_dense_reference,
    dense_weights_f64,
    spmm_reference,
    spmspv_reference,
)


def _fp16_layer(rng, M, K, sparsity):
    W = rng.standard_normal((M, K)).astype(np.float16)
    W[rng.random((M, K)) < sparsity] = 0
    return W


def _int_layer(rng, M, K, sparsity, bits, g):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = rng.integers(lo, hi + 1, (M, K)).astype(np.int8)
    q[rng.random((M, K)) < sparsity] = 0
    s = (rng.random((M, -(-K // g))) * 0.1 + 0.01).astype(np.float16)
    return q, s


@pytest.mark.parametrize("shape", [(256, 16), (300, 70), (513, 129)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.9])
def test_spmspv_reference_fp16_matches_float64(shape, sparsity):
    rng = np.random.default_rng(hash((shape, sparsity)) % 2**32)
    W = _fp16_layer(rng, *shape, sparsity)
    m = tiled_cbc.encode(W)
    x = rng.standard_normal(shape[1]).astype(np.float16)
    w64 = W.astype(np.float64)
    for tau in (None, 0.0, 0.7):
        xe = x.astype(np.float64)
        if tau is not None:
            xe = np.where(np.abs(x.astype(np.float32)) > tau, xe, 0.0)
        y = spmspv_reference(m, x, tau)
        assert y.dtype == np.float32 and y.shape == (shape[0],)
        err = np.abs(y - w64 @ xe)
        assert (err <= tolerance(w64, xe[None])[0]).all()


def test_spmspv_reference_skips_inactive_columns_without_reading_them():
    rng = np.random.default_rng(1)
    W = _fp16_layer(rng, 256, 32, 0.5)
    m = tiled_cbc.encode(W)
    x = np.ones(32, dtype=np.float16)
    x[16:] = 0.25  # the second GTile is inactive at tau = 0.5
    # corrupt the values of the inactive GTile: a kernel that reads them would produce garbage
    bad = tiled_cbc.TiledCBCMatrix(m.geometry, m.bitmap, m.colinfo, m.tile_offset, m.values.copy())
    bad.values[int(m.tile_offset[1]) :] = np.float16(np.nan)
    y = spmspv_reference(bad, x, 0.5)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(
        y, W[:, :16].astype(np.float64) @ x[:16].astype(np.float64), rtol=1e-5, atol=1e-5
    )
    assert not np.isfinite(spmspv_reference(bad, x, None)).all()  # DP off reads them


@pytest.mark.parametrize("bits,g", [(4, 16), (4, 128), (2, 32)])
def test_spmspv_reference_codes_with_group_scales(bits, g):
    rng = np.random.default_rng(bits * 1000 + g)
    q, s = _int_layer(rng, 300, 200, 0.5, bits, g)
    m = tiled_cbc.encode(q, bits=bits)
    x = rng.standard_normal(200).astype(np.float16)
    w64 = dense_weights_f64(m, s, g)
    np.testing.assert_array_equal(m.decode(), q)
    y = spmspv_reference(m, x, None, s, g)
    assert (np.abs(y - w64 @ x.astype(np.float64)) <= tolerance(w64, x.astype(np.float64)[None])[0]).all()
    # the scales are really used: a different scale changes the output
    y2 = spmspv_reference(m, x, None, s * np.float16(2), g)
    np.testing.assert_allclose(y2, 2 * y, rtol=1e-5, atol=1e-6)


def test_spmm_reference_matches_float64_and_spmspv_rows():
    rng = np.random.default_rng(3)
    W = _fp16_layer(rng, 260, 48, 0.6)
    m = tiled_cbc.encode(W)
    X = rng.standard_normal((5, 48)).astype(np.float16)
    Y = spmm_reference(m, X, out_dtype=np.float32)
    truth = X.astype(np.float64) @ W.astype(np.float64).T
    assert (np.abs(Y - truth) <= tolerance(W.astype(np.float64), X.astype(np.float64))).all()
    np.testing.assert_array_equal(Y[2], spmspv_reference(m, X[2], None))  # same arithmetic order per row
    assert spmm_reference(m, X).dtype == np.float16


@pytest.mark.parametrize("bits,g", [(None, None), (4, 128), (4, 16), (2, 32)])
def test_decoded_dense_reference_is_the_weights_exactly(bits, g):
    """decode_dense's reference, walked from the stored arrays, against the float64 weights from decode(): the
    float16 values as they are; b-bit codes times their group scale as two float16 halves that sum to the weight
    (hi the weight's float16 rounding), and scales read per (row, group)."""
    rng = np.random.default_rng(7 + (bits or 0))
    if bits is None:
        W, s = _fp16_layer(rng, 300, 200, 0.5), None
        m = tiled_cbc.encode(W)
    else:
        q, s = _int_layer(rng, 300, 200, 0.5, bits, g)
        m = tiled_cbc.encode(q, bits=bits)
    got = decoded_dense_reference(m, s, g)
    w64 = dense_weights_f64(m, s, g)
    assert got.dtype == np.float16
    hi = got[:, :200]
    assert hi.view(np.uint16).tolist() == w64.astype(np.float16).view(np.uint16).tolist()
    if bits != 4:  # float16 values and 2-bit codes times float16 scales are float16: no low half
        assert got.shape == (300, 200)
        np.testing.assert_array_equal(hi.astype(np.float64), w64)
        if bits is None:
            return
    else:
        lo = got[:, 200:]
        np.testing.assert_array_equal(hi.astype(np.float64) + lo.astype(np.float64), w64)
        assert (lo != 0).mean() > 0.1  # the low halves carry bits float16 drops
    s2 = s.copy()
    s2[:, -1] *= np.float16(2)
    assert (decoded_dense_reference(m, s2, g)[:, 200 - g : 200] != hi[:, -g:]).any()


def test_reference_detects_corrupt_colinfo():
    rng = np.random.default_rng(4)
    m = tiled_cbc.encode(_fp16_layer(rng, 256, 16, 0.5))
    ci = m.colinfo.copy()
    ci[3] += 1  # count no longer matches the bitmap
    bad = tiled_cbc.TiledCBCMatrix(m.geometry, m.bitmap, ci, m.tile_offset, m.values)
    with pytest.raises(ValueError):
        spmspv_reference(bad, np.ones(16, np.float16), None)


def test_check_layer_cpu_passes_and_rejects_a_broken_layout():
    rng = np.random.default_rng(5)
    W = _fp16_layer(rng, 256, 64, 0.5)
    m = tiled_cbc.encode(W)
    assert check_tiled_cbc_layer(m, tau=0.3, ns=(1, 4), backend="cpu", rng=rng) == []
    ci = m.colinfo.copy()
    ci[1] = (int(ci[1]) & 0xFFFF) | (((int(ci[1]) >> 16) + 8) << 16)  # column 1 starts 8 values late
    bad = tiled_cbc.TiledCBCMatrix(m.geometry, m.bitmap, ci.astype(np.uint32), m.tile_offset, m.values)
    with pytest.raises(FormatError):
        check_tiled_cbc_layer(bad, ns=(1,), backend="cpu", rng=rng)


def test_check_layer_reports_a_kernel_result_beyond_the_bound():
    from unionsparse.kernels.tiled_cbc_check import _compare

    truth = np.array([1.0, 2.0, 3.0])
    tol = np.full(3, 1e-6)
    assert _compare("x", truth + 5e-7, truth, tol) == []
    assert "beyond the float32 bound" in _compare("x", truth + [0, 1e-5, 0], truth, tol)[0]
    assert "not finite" in _compare("x", np.array([1.0, np.nan, 3.0]), truth, tol)[0]


def test_check_layer_quantized_cpu():
    rng = np.random.default_rng(6)
    q, s = _int_layer(rng, 256, 96, 0.5, 4, 32)
    m = tiled_cbc.encode(q, bits=4)
    assert check_tiled_cbc_layer(m, s, 32, tau=0.5, ns=(1, 3), backend="cpu", rng=rng) == []


cp = cupy_or_none()
gpu = pytest.mark.skipif(cp is None, reason="needs CuPy and a CUDA device")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 16), (300, 70), (1024, 1000), (4096, 4096)])
@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.95])
def test_gpu_fp16_layer(shape, sparsity):
    rng = np.random.default_rng(hash((shape, sparsity, "gpu")) % 2**32)
    m = tiled_cbc.encode(_fp16_layer(rng, *shape, sparsity))
    assert check_tiled_cbc_layer(m, tau=0.6, ns=(1, 16, 100), backend="cupy", rng=rng) == []


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits,g,shape", [(4, 128, (1024, 1024)), (4, 16, (300, 200)), (2, 64, (512, 320))])
def test_gpu_quantized_layer(bits, g, shape):
    rng = np.random.default_rng(bits + g)
    q, s = _int_layer(rng, *shape, 0.5, bits, g)
    m = tiled_cbc.encode(q, bits=bits)
    assert check_tiled_cbc_layer(m, s, g, tau=0.5, ns=(1, 3, 8), backend="cupy", rng=rng) == []


def _rows_case(bits, rng, M=768, K=1040):
    """A layer of ``bits``-bit codes (None: fp16 values) and its float64 weights."""
    if bits is None:
        W = _fp16_layer(rng, M, K, 0.5)
        return tiled_cbc.encode(W), None, None, W.astype(np.float64)
    q, s = _int_layer(rng, M, K, 0.5, bits, 16)
    m = tiled_cbc.encode(q, bits=bits)
    return m, s, 16, dense_weights_f64(m, s, 16)


def test_spmspv_rows_reference_is_each_row_alone():
    """The several-row spMspV's definition: row n of X with its own mask, as one spMspV of that row."""
    from unionsparse.kernels.tiled_cbc_reference import spmspv_rows_reference

    rng = np.random.default_rng(12)
    for bits in (None, 4):
        m, s, g, w64 = _rows_case(bits, rng, 300, 70)
        X = (rng.standard_normal((5, 70)) * np.linspace(0.3, 3, 5)[:, None]).astype(np.float16)
        Y = spmspv_rows_reference(m, X, 0.8, s, g)
        assert np.array_equal(Y, np.stack([spmspv_reference(m, x, 0.8, s, g) for x in X]))
        masks = np.abs(X.astype(np.float32)) > 0.8
        assert len({mk.tobytes() for mk in masks}) == 5  # the rows' active sets differ
        Xe = np.where(masks, X.astype(np.float64), 0)
        assert (np.abs(Y - Xe @ w64.T) <= tolerance(w64, Xe)).all()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [None, 4, 2])
def test_gpu_spmspv_rows_every_launch(bits):
    """The several-row kernel (a batched decode step): 2 to 11 rows (launches of 8), each row's own threshold
    mask (rows of different scales), split-K chunks and stream-K, two launches each (tickets reset), every output
    written (NaN-poisoned), within the float32 bound of each row's own spMspV; fp16 output too."""
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmspv import spmspv

    rng = np.random.default_rng(21 if bits is None else bits)
    m, s, g, w64 = _rows_case(bits, rng)
    dev = DeviceTiledCBC(m, s, g)
    M, K = w64.shape
    for n in (2, 3, 4, 5, 8, 11):
        X = (rng.standard_normal((n, K)) * np.linspace(0.5, 2.0, n)[:, None]).astype(np.float16)
        for tau in (0.6, None):
            Xe = X.astype(np.float64) if tau is None else np.where(np.abs(X.astype(np.float32)) > tau,
                                                                    X.astype(np.float64), 0)
            truth, tol = Xe @ w64.T, tolerance(w64, Xe)
            for kw in [dict(chunk=c) for c in (1, 3, 16, 65, None)] + [dict(streamk=True, blocks=b)
                                                                       for b in (1, 7, 48, None)]:
                for _ in range(2):
                    out = cp.full((n, M), cp.nan, cp.float32)
                    y = cp.asnumpy(spmspv(dev, cp.asarray(X), tau, out=out, **kw))
                    assert (np.abs(y - truth) <= tol).all(), (n, tau, kw)
            y16 = cp.asnumpy(spmspv(dev, cp.asarray(X), tau)).astype(np.float64)
            assert (np.abs(y16 - truth) <= tolerance(w64, Xe, 1.0, fp16_out=True)).all(), (n, tau, "fp16 out")


@gpu
@pytest.mark.gpu
def test_gpu_all_chunks_stages_and_spmm_tiles_agree():
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmm import V2_CONFIGS as SPMM_CONFIGS
    from unionsparse.kernels.tiled_cbc_spmm import spmm
    from unionsparse.kernels.tiled_cbc_spmspv import V2_CONFIGS, spmspv

    rng = np.random.default_rng(9)
    W = _fp16_layer(rng, 768, 1040, 0.5)
    m = tiled_cbc.encode(W)
    dev = DeviceTiledCBC(m)
    x = rng.standard_normal(1040).astype(np.float16)
    ref = spmspv_reference(m, x, 0.4)
    xe = np.where(np.abs(x.astype(np.float32)) > 0.4, x.astype(np.float64), 0)
    tol = tolerance(W.astype(np.float64), xe[None])[0]
    runs = [dict(warps=w, stages=st, mode=md) for b, w, st in V2_CONFIGS if b == 16 for md in (0, 3)]
    runs += [dict(warps=w, stages=st, mode=md, streamk=True, blocks=nb)
             for w, st, md in ((4, 2, 0), (8, 2, 0), (4, 3, 3), (4, 2, 3), (8, 2, 3))
             for nb in (1, 2, 7, 48, 195, None)]
    for kw in runs:
        for chunk in (1, 2, 3, 4, 8, 16, 32, 65, None) if not kw.get("streamk") else (None,):
            for _ in range(2):  # second launch: the split-K tickets were reset by the first
                out = cp.full(768, cp.nan, cp.float32)
                y = cp.asnumpy(spmspv(dev, cp.asarray(x), 0.4, out=out, chunk=chunk, **kw))
                assert (np.abs(y - W.astype(np.float64) @ xe) <= tol).all(), (chunk, kw)
    assert np.abs(ref - W.astype(np.float64) @ xe).max() <= tol.max()
    for n in (16, 33, 200):
        X = rng.standard_normal((n, 1040)).astype(np.float16)
        truth = X.astype(np.float64) @ W.astype(np.float64).T
        bound = tolerance(W.astype(np.float64), X.astype(np.float64), 2.0, True)
        for cfg in SPMM_CONFIGS:
            for splits in (1, 2, 3, 40, None):
                for _ in range(2):
                    out = cp.full((n, 768), cp.nan, cp.float16)
                    Y = spmm(dev, cp.asarray(X), out=out, config=cfg, splits=splits, method="fused")
                    assert (np.abs(cp.asnumpy(Y).astype(np.float64) - truth) <= bound).all(), (n, cfg, splits)
        Y = cp.asnumpy(spmm(dev, cp.asarray(X), method="dense")).astype(np.float64)
        assert (np.abs(Y - truth) <= bound).all(), (n, "dense")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1000, 1036), (3 * 256, 64), (256, 16)])
def test_gpu_dense_path_and_its_graph_capture(shape):
    """Decode + cublasGemmEx (Y^T = W X^T, column-major): the dense product for ragged M and K (X wider than
    K), and the whole path captures into one CUDA graph (CuPy's own cuBLAS bindings refuse capture)."""
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmm import spmm_dense

    rng = np.random.default_rng(shape[0])
    M, K = shape
    W = _fp16_layer(rng, M, K, 0.5)
    dev = DeviceTiledCBC(tiled_cbc.encode(W))
    kx = -(-K // 8) * 8
    for n in (1, 37, 512):
        X = np.zeros((n, kx), np.float16)
        X[:, :K] = rng.standard_normal((n, K)).astype(np.float16)
        truth = X[:, :K].astype(np.float64) @ W.astype(np.float64).T
        bound = tolerance(W.astype(np.float64), X[:, :K].astype(np.float64), 2.0, True)
        out = cp.full((n, M), cp.nan, cp.float16)
        Y = cp.asnumpy(spmm_dense(dev, cp.asarray(X), out)).astype(np.float64)
        assert (np.abs(Y - truth) <= bound).all(), n
    Xd = cp.asarray(X)
    out = cp.full((X.shape[0], M), cp.nan, cp.float16)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        spmm_dense(dev, Xd, out)  # warm-up outside the capture
        out.fill(cp.nan)
        s.synchronize()
        s.begin_capture()
        spmm_dense(dev, Xd, out)
        graph = s.end_capture()
        assert bool(cp.isnan(out).all())  # captured, not run
        graph.launch(s)
        s.synchronize()
    assert (np.abs(cp.asnumpy(out).astype(np.float64) - truth) <= bound).all()

@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape,sparsity", [((768, 1040), 0.5), ((300, 70), 0.3), ((257, 48), 0.9), ((256, 16), 0.0)])
def test_gpu_warp_spmm_every_config_split_and_width(shape, sparsity):
    """v3 (warp-streamed) SpMM: ragged M and K, empty and full columns, every config, split-K counts, widths
    that fill 1..8 n-tiles partially, more than one launch (N > 64), tickets reused."""
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmm import V3_CONFIGS, spmm

    rng = np.random.default_rng(hash((shape, sparsity, "v3")) % 2**32)
    W = _fp16_layer(rng, *shape, sparsity)
    M, K = shape
    m = tiled_cbc.encode(W)
    dev = DeviceTiledCBC(m)
    for n in (1, 5, 8, 16, 27, 32, 40, 64, 100):
        X = rng.standard_normal((n, K)).astype(np.float16)
        truth = X.astype(np.float64) @ W.astype(np.float64).T
        bound = tolerance(W.astype(np.float64), X.astype(np.float64), 2.0, True)
        cfgs = [c for c in V3_CONFIGS if 8 * c[0] >= min(n, 64)] if n <= 64 else [None]
        for cfg in cfgs:
            for splits in (1, 2, 3, 40, None):
                for _ in range(2):
                    out = cp.full((n, M), cp.nan, cp.float16)
                    Y = spmm(dev, cp.asarray(X), out=out, config=cfg, splits=splits, method="warp")
                    err = np.abs(cp.asnumpy(Y).astype(np.float64) - truth)
                    assert (err <= bound).all(), (n, cfg, splits, float(err.max()))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape,sparsity", [((768, 1040), 0.5), ((300, 70), 0.3), ((257, 200), 0.9), ((256, 16), 0.0),
                                            ((130, 300), 0.5)])
def test_gpu_wgmma_spmm_every_config_split_and_width(shape, sparsity):
    """v4 (wgmma, sm_90a) SpMM: ragged M (a last 128-row half with 2 rows) and K (K % 8 != 0 too), empty
    and full columns, every config, split-K counts (including more splits than steps), widths that fill n-tiles
    partially and span several, tickets reused. Skips on GPUs other than compute capability 9.0."""
    from unionsparse.kernels import tiled_cbc_spmm as k
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC

    if not k.wgmma_available():
        pytest.skip("wgmma needs a compute-capability 9.0 GPU")
    configs, smem, method = k.V4_CONFIGS, k.v4_smem, "wgmma"
    rng = np.random.default_rng(hash((shape, sparsity, method)) % 2**32)
    W = _fp16_layer(rng, *shape, sparsity)
    M, K = shape
    m = tiled_cbc.encode(W)
    dev = DeviceTiledCBC(m)
    limit = int(cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"])
    fit = [c for c in configs if smem(dev, c, m.geometry.grid[1]) <= limit]
    assert all(c in fit for c in configs if c[2] == 3 and c[0] <= 128)  # 3 stages fit even a dense layer
    for c in set(configs) - set(fit):
        with pytest.raises(ValueError, match="shared memory"):
            k.spmm(dev, cp.zeros((1, K), cp.float16), config=c, splits=1, method=method)
    spmm = k.spmm
    for n in (1, 5, 16, 27, 64, 100, 200, 300):
        X = rng.standard_normal((n, K)).astype(np.float16)
        truth = X.astype(np.float64) @ W.astype(np.float64).T
        bound = tolerance(W.astype(np.float64), X.astype(np.float64), 2.0, True)
        for cfg in (*fit, None):
            for splits in (1, 2, 3, 40, None):
                for _ in range(2):
                    out = cp.full((n, M), cp.nan, cp.float16)
                    Y = spmm(dev, cp.asarray(X), out=out, config=cfg, splits=splits, method=method)
                    err = np.abs(cp.asnumpy(Y).astype(np.float64) - truth)
                    assert (err <= bound).all(), (n, cfg, splits, float(err.max()))


def test_wgmma_launch_names_match_the_instantiations_and_the_rules_fit():
    """Every v4 config the launcher can name is instantiated in the .cu file (and only those); the config rule
    covers the tokens with the smallest tile up to 128 and keeps shared memory within the limit given; the
    split rule fills a 132-SM GPU's block slots and stays at one split when the GPU is already full."""
    import re
    from pathlib import Path

    from unionsparse.kernels import tiled_cbc_spmm as k

    src = (Path(__file__).resolve().parents[1] / "kernels" / "tiled_cbc_spmm.cu").read_text()
    built = {tuple(int(v) for v in m) for m in re.findall(r"^TCBC_SPMM4\((\d+), (\d+), (\d+)\)", src, re.M)}
    assert built == set(k.V4_CONFIGS)

    class Layer:  # what the rules read of a DeviceTiledCBC: 28672 x 8192 at 50% (a GTile holds ~2 KB)
        grid, Mp = (112, 512), 112 * 256

        def max_window_bytes(self, gk):
            return gk * 2304

    lay = Layer()
    for n, bn in ((1, 16), (16, 16), (17, 32), (64, 64), (65, 128), (4096, 128)):
        cfg = k.v4_config(lay, n, 232448)
        assert cfg[0] == bn and k.v4_smem(lay, cfg, 128) <= 232448
        assert cfg[2] == max(c[2] for c in k.V4_CONFIGS if c[0] == bn)  # the deepest ring fits here
    assert k.v4_config(lay, 4096, 170000) == (128, 1, 3)  # 4 stages do not fit: 3
    with pytest.raises(ValueError, match="fits"):
        k.v4_config(lay, 16, 50000)
    cfg = k.v4_config(lay, 16, 232448)
    assert k.v4_splits(lay, 16, cfg, k.v4_smem(lay, cfg, 1)) == 1  # 112 blocks: 2 splits would take 2 waves
    lay.grid, lay.Mp = (16, 256), 16 * 256  # 4096 x 4096: 16 blocks per split
    sp = k.v4_splits(lay, 16, cfg, k.v4_smem(lay, cfg, 1))
    assert 112 <= 16 * sp <= 132  # one wave, nearly full
    assert k.v4_splits(lay, 4096, (128, 1, 3), 200000) == 1  # 32 x 16 blocks: the GPU is full without splits
    # method="auto": v3 up to 8 tokens, v4 on sm_90 up to 32, the fused v2 below 32 elsewhere, dense beyond
    assert [k.auto_method(n, True) for n in (1, 8, 9, 32, 33, 4096)] == ["warp"] * 2 + ["wgmma"] * 2 + ["dense"] * 2
    assert [k.auto_method(n, False) for n in (8, 9, 31, 32)] == ["warp", "fused", "fused", "dense"]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape,sparsity", [((768, 1040), 0.5), ((300, 48), 0.3), ((257, 64), 0.9), ((256, 16), 0.0)])
def test_gpu_decode_dense_is_exact(shape, sparsity):
    """Every GTile count modulo the 4 GTiles a block decodes, ragged M, empty and full columns."""
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmm import decode_dense

    rng = np.random.default_rng(sum(shape))
    W = _fp16_layer(rng, *shape, sparsity)
    W[:, 3] = 0  # an empty column
    W[:, 5] = 1.5  # a full one
    dev = DeviceTiledCBC(tiled_cbc.encode(W))
    kp = -(-shape[1] // 16) * 16
    want = np.zeros((shape[0], kp), np.float16)
    want[:, : shape[1]] = W
    out = cp.full((shape[0], kp), cp.nan, cp.float16)
    got = cp.asnumpy(decode_dense(dev, out))
    assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits,g,shape", [(4, 128, (768, 1040)), (2, 32, (300, 48)), (4, 16, (257, 200)),
                                          (4, 2048, (256, 1040))])
def test_gpu_decode_dense_of_codes_is_its_reference_and_feeds_the_dense_product(bits, g, shape):
    """b-bit codes: decode_dense bit for bit its reference (4-bit: hi and lo halves; ragged M, every GTile count
    modulo 4, one group and groups of 16), and spmm's dense method (the runtime's int-code prefill) within float32
    summation of the exact weights."""
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmm import decode_dense, dense_halves, spmm

    rng = np.random.default_rng(bits * 31 + g)
    M, K = shape
    q, s = _int_layer(rng, M, K, 0.5, bits, g)
    q[:, 3] = 0  # an empty column
    q[:, 5] = 1  # a full one
    m = tiled_cbc.encode(q, bits=bits)
    dev = DeviceTiledCBC(m, s, g)
    kp, h = -(-K // 16) * 16, dense_halves(bits)
    ref = decoded_dense_reference(m, s, g)
    want = np.zeros((M, h * kp), np.float16)
    for i in range(h):
        want[:, i * kp : i * kp + K] = ref[:, i * K : (i + 1) * K]
    out = cp.full((M, h * kp), cp.nan, cp.float16)
    got = cp.asnumpy(decode_dense(dev, out))
    assert got.view(np.uint16).tolist() == want.view(np.uint16).tolist()
    w64 = dense_weights_f64(m, s, g)
    for n in (1, 40):
        X = rng.standard_normal((n, K)).astype(np.float16)
        Y = cp.asnumpy(spmm(dev, cp.asarray(X))).astype(np.float64)
        truth = X.astype(np.float64) @ w64.T
        assert (np.abs(Y - truth) <= tolerance(w64, X.astype(np.float64), 2.0, True)).all(), n


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits,g", [(4, 128), (2, 32), (4, 16)])
def test_gpu_quantized_spmspv_every_chunk(bits, g):
    """Every decode mode of b-bit codes (4-bit: 0 and 4), split-K chunks and stream-K, within the float32 bound."""
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmspv import MODES, spmspv

    rng = np.random.default_rng(bits * 7 + g)
    q, s = _int_layer(rng, 1000, 1200, 0.5, bits, g)
    # rows 0-255 with no zero code (every bitmap byte full: 8 codes a byte, 16 a lane in mode 4), rows 256-511 at
    # 95% (bytes of 0 or 1 code), columns 0-15 empty: each decode's edge cases beside the random 50%
    lo = -(1 << (bits - 1))
    full = rng.integers(lo, -lo - 1, (256, 1200)).astype(np.int8)
    q[:256] = np.where(full >= 0, full + 1, full)
    q[256:512][rng.random((256, 1200)) < 0.95] = 0
    q[:, :16] = 0
    m = tiled_cbc.encode(q, bits=bits)
    dev = DeviceTiledCBC(m, s, g)
    w64 = dense_weights_f64(m, s, g)
    x = rng.standard_normal(1200).astype(np.float16)
    xe = np.where(np.abs(x.astype(np.float32)) > 0.3, x.astype(np.float64), 0)
    tol = tolerance(w64, xe[None])[0]
    runs = [dict(mode=md) for md in MODES[bits]] + [dict(streamk=True, blocks=nb, mode=md) for nb in (5, None)
                                                     for md in MODES[bits]]
    for kw in runs:
        for chunk in (1, 3, 8, 75, None) if not kw.get("streamk") else (None,):
            out = cp.full(1000, cp.nan, cp.float32)
            y = cp.asnumpy(spmspv(dev, cp.asarray(x), 0.3, out=out, chunk=chunk, **kw))
            assert (np.abs(y - w64 @ xe) <= tol).all(), (kw, chunk)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("defines", ["", "#define TCBC_BULK 0", "#define TCBC_WHOLE 1"])
def test_gpu_spmspv_copy_paths(defines, tmp_path, monkeypatch):
    """v2's copies: bulk copies per run of active columns (sm_90), 16-byte cp.async (before sm_90, forced
    here), and b-bit GTiles copied whole (the study build TCBC_WHOLE): fp16 and int4 (decode modes 0 and 4),
    split-K and stream-K, runs of active columns that start, end and span GTiles, all-inactive GTiles."""
    from pathlib import Path

    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC
    from unionsparse.kernels.tiled_cbc_spmspv import spmspv

    src = tmp_path / "variant.cu"
    kernel = Path(__file__).resolve().parents[1] / "kernels" / "tiled_cbc_spmspv.cu"
    src.write_text(defines + "\n" + kernel.read_text())
    from unionsparse.kernels import study, tiled_cbc_spmspv

    monkeypatch.setitem(study._builds, tiled_cbc_spmspv.KERNEL, study.Build(source=str(src)))
    rng = np.random.default_rng(17)
    for bits in (16, 4):
        if bits == 16:
            W = _fp16_layer(rng, 700, 1100, 0.5)
            W[:, 32:48] = 0  # a GTile column with no nonzero: never active
            dev, w64 = DeviceTiledCBC(tiled_cbc.encode(W)), W.astype(np.float64)
        else:
            q, sc = _int_layer(rng, 700, 1100, 0.5, 4, 64)
            m = tiled_cbc.encode(q, bits=4)
            dev, w64 = DeviceTiledCBC(m, sc, 64), dense_weights_f64(m, sc, 64)
        for tau in (0.0, 0.5, 1.2):
            x = rng.standard_normal(1100).astype(np.float16)
            x[64:80] = 0  # a fully inactive GTile column
            xe = np.where(np.abs(x.astype(np.float32)) > tau, x.astype(np.float64), 0)
            tol = tolerance(w64, xe[None])[0]
            for kw in (dict(chunk=1, streamk=False), dict(chunk=5, streamk=False), dict(streamk=True, blocks=7),
                       dict(streamk=None), dict(stages=3, streamk=False), dict(warps=8, streamk=True),
                       dict(chunk=5, streamk=False, mode=0), dict(chunk=5, streamk=False, mode=4),
                       dict(streamk=True, blocks=7, mode=4)):
                # int4 has one warp count (4); mode 4 decodes 4-bit codes only
                if bits != 16 and kw.get("warps") == 8 or bits == 16 and kw.get("mode") == 4:
                    continue
                out = cp.full(700, cp.nan, cp.float32)
                y = cp.asnumpy(spmspv(dev, cp.asarray(x), tau, out=out, **kw))
                assert (np.abs(y - w64 @ xe) <= tol).all(), (defines, bits, tau, kw)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [None, 4, 2])
def test_encode_on_device_matches_cpu_encoder(bits):
    from unionsparse.kernels.tiled_cbc_device import encode_on_device

    rng = np.random.default_rng(11)
    W = _fp16_layer(rng, 520, 72, 0.6) if bits is None else _int_layer(rng, 520, 72, 0.6, bits, 16)[0]
    m = tiled_cbc.encode(W, bits=bits)
    d = encode_on_device(cp.asarray(W), bits=bits)
    assert d["bits"] == bits
    for name in ("bitmap", "colinfo", "tile_offset", "values"):
        np.testing.assert_array_equal(cp.asnumpy(d[name]), getattr(m, name), err_msg=name)
    with pytest.raises(ValueError, match="int8 W and bits 4 or 2"):
        encode_on_device(cp.asarray(W).astype(cp.float16), bits=4)


def _nvrtc():
    """libnvrtc through ctypes (NVRTC_LIB, the system library or the nvidia-cuda-nvrtc wheel), else None."""
    import ctypes
    import ctypes.util
    import glob
    import os

    cands = [os.environ.get("NVRTC_LIB"), ctypes.util.find_library("nvrtc")]
    try:
        import nvidia.cuda_nvrtc as w  # type: ignore[import-not-found]

        cands += sorted(glob.glob(os.path.join(list(w.__path__)[0], "lib", "libnvrtc.so*")))
    except Exception:
        pass
    cands += sorted(glob.glob("/tmp/nvcc/x/nvidia/cuda_nvrtc/lib/libnvrtc.so*"))
    for c in cands:
        if c:
            try:
                return ctypes.CDLL(c)
            except OSError:
                continue
    return None


@pytest.mark.parametrize("name,arch", [("tiled_cbc_spmspv.cu", "compute_90"), ("tiled_cbc_spmspv.cu", "compute_80"),
                                       ("tiled_cbc_spmm.cu", "compute_90"), ("tiled_cbc_spmm.cu", "compute_90a"),
                                       ("tiled_cbc_decode.cu", "compute_90"), ("tiled_cbc_decode.cu", "compute_80"),
                                       ("act_quant.cu", "compute_90"), ("glue.cu", "compute_90"),
                                       ("attention.cu", "compute_90"), ("lm_head.cu", "compute_90"),
                                       ("lm_head.cu", "compute_80"),
                                       ("norm_quant.cu", "compute_90"), ("outlier_side.cu", "compute_90")])
def test_kernel_source_compiles(name, arch):
    """Front-end compile (PTX, no GPU) of every explicitly instantiated kernel; spMspV also before sm_90,
    where its copies take the cp.async path."""
    _nvrtc_compiles(name, arch)


@pytest.mark.parametrize("name,arch", [("glue.cu", "compute_90"), ("norm_quant.cu", "compute_90"),
                                       ("norm_quant.cu", "compute_80"), ("norm_quant.cu", "compute_75")])
@pytest.mark.parametrize("early", [0, 1])
def test_norm_builds_compile(name, arch, early):
    """The norms with their early copies (kernels/pdl.cuh: cp.async of the weights before the wait; a plain copy
    before sm_80) and without (the study build NORM_EARLY=0)."""
    _nvrtc_compiles(name, arch, f"-DNORM_EARLY={early}")


def _nvrtc_compiles(name: str, arch: str, *defines: str) -> None:
    import ctypes
    from pathlib import Path

    lib = _nvrtc()
    if lib is None:
        pytest.skip("no libnvrtc here")
    src_dir = Path(__file__).resolve().parents[1] / "kernels"
    src = (src_dir / name).read_bytes()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), 0, None, None) == 0
    opts = [f"-arch={arch}".encode(), b"-std=c++17", f"-I{src_dir}".encode(), *(d.encode() for d in defines)]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, log.value.decode(errors="replace")


def test_spmspv_launch_names_match_the_kernels_instantiations():
    """Every v2 kernel the launcher can name (configs x decode modes, defaults included) is instantiated in the
    .cu file, and nothing instantiated is unreachable: a mismatch is a 'named symbol not found' on the GPU."""
    import re
    from pathlib import Path

    from unionsparse.kernels import tiled_cbc_spmspv as k

    src = (Path(__file__).resolve().parents[1] / "kernels" / "tiled_cbc_spmspv.cu").read_text()
    built = {tuple(int(v) for v in m) for m in re.findall(r"^TCBC2\((\d+), (\d+), (\d+), (\d+)\)", src, re.M)}
    named = {(b, w, s, m) for b, w, s in k.V2_CONFIGS for m in k.MODES[b]}
    assert built == named
    assert all(k.DEFAULT_MODES[b] in k.MODES[b] and 0 in k.MODES[b] for b in k.BITS)
    exprs = {e for e in k._EXPR if e.startswith("tcbc_spmspv2<")}
    rows = {tuple(int(v) for v in m) for m in re.findall(r"^TCBC2R\((\d+), (\d+), (\d+), 0, (\d+)\)", src, re.M)}
    named_rows = {(b, *k.v2_default_config_bits(b), r) for b in k.BITS for r in k.ROWS}
    assert rows == named_rows  # the several-row kernels: each value type's default config, mode 0
    assert exprs == ({f"tcbc_spmspv2<{b}, {w}, {s}" + (">" if m == 0 else f", {m}>") for b, w, s, m in named}
                     | {f"tcbc_spmspv2<{b}, {w}, {s}, 0, {r}>" for b, w, s, r in rows})


def test_benchmark_checks_arguments_and_reports_int_codes_without_a_gpu(tmp_path):
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_tiled_cbc.py"
    spec = importlib.util.spec_from_file_location("bench_tiled_cbc", script)
    bench_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_script)
    write_md = bench_script.write_md
    for bad, msg in (("--spmspv-bits=16,8", "expected 16, 4 or 2"), ("--spmm-ns=0", "positive integers")):
        r = subprocess.run([sys.executable, str(script), bad], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    row = dict(M=4096, K=4096, static=0.5, t_cublas_us=20.0, t_spmspv_us=10.0, speedup=2.0, t_default_us=11.0,
               t_spmspv_dp_off_us=14.0, gbps_spmspv=900.0, gbps_cublas=3300.0, best_warps=4,
               best_stages=3, best_chunk=8, best_streamk=False, best_mode=0)
    res = dict(machine=dict(gpu="G", nvidia_smi="s", cupy="c", torch="t", cuda_runtime=1), command="cmd",
               copy_gbps=4000.0, spmspv=[dict(row, bits=16), dict(row, bits=4, group=128)])
    g = dict(best=1.3, default=1.2, dp_off=1.1, median_gbps=2000.0, n_shapes=31)
    res["geomean_spmspv"] = {"static 50% + dynamic 30%": g, "static 50% + dynamic 30%, int4 values": g}
    write_md(res, tmp_path / "r.md")
    lines = (tmp_path / "r.md").read_text().splitlines()
    b16, b4 = [ln for ln in lines if ln.startswith("- static 50%")]
    assert "**1.30x**" in b16 and "**1.30x**" in b4
    fp16, int4 = [ln for ln in lines if ln.startswith("| 4096 |")]
    assert "| fp16 |" in fp16 and fp16.split(" | ")[-1] == "4/3/8/m0 |"
    assert "| int4 (g128) |" in int4


def test_bench_summary_mixes_ie_bme_and_tiled_cbc_layers():
    from unionsparse.compressor.bench.kernels import summarize

    rows = [dict(N=1, speedup_vs_cublas=2.0, fp16_weight_MB=200.0, iebme_bw_frac=0.6, speedup_vs_int8=1.5),
            dict(N=1, speedup_vs_cublas=0.5, fp16_weight_MB=300.0, kernel="spmspv"),
            dict(N=16, speedup_vs_cublas=0.8, fp16_weight_MB=300.0, kernel="spmm")]
    s = summarize(rows)
    assert s[1]["geomean_speedup_vs_cublas"] == pytest.approx(1.0) and s[1]["cases"] == 2
    assert s[1]["mean_bw_frac_over_100MB"] == pytest.approx(0.6)  # IE-BME rows only
    assert s[16]["mean_bw_frac_over_100MB"] is None and s[16]["geomean_speedup_vs_cublas"] == pytest.approx(0.8)


def test_spmspv_mode_study_checks_arguments_and_summarizes_without_a_gpu():
    """The decode-mode study rejects a bad sparsity with one line and exit code 2 before touching CuPy, and
    its summary is the geomean over shapes of speedup and of the time ratio to the default setting."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "study_spmspv_modes.py"
    r = subprocess.run([sys.executable, str(script), "--statics", "0.5,1.2"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "expected sparsities in [0, 1)" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(script), "--baseline", "/nonexistent/old.cu"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "is not a file" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(script), "--bits", "8"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice" in r.stderr and "Traceback" not in r.stderr
    spec = importlib.util.spec_from_file_location("study_spmspv_modes", script)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    rows = [dict(t_cublas_us=100.0, tried_by_setting_us={study.BASE: 100.0, "w4/d2/x1/m3": 50.0}),
            dict(t_cublas_us=10.0, tried_by_setting_us={study.BASE: 20.0, "w4/d2/x1/m3": 40.0, "w8/d2/x1/m0": 5.0})]
    s = study.summarize(rows)
    assert s[study.BASE]["speedup"] == pytest.approx((1.0 * 0.5) ** 0.5)
    assert s["w4/d2/x1/m3"]["vs_default"] == pytest.approx((2.0 * 0.5) ** 0.5)
    assert s["w4/d2/x1/m3"]["min_vs_default"] == 0.5 and s["w4/d2/x1/m3"]["max_vs_default"] == 2.0
    assert s["w8/d2/x1/m0"]["n"] == 1 and s["w8/d2/x1/m0"]["vs_default"] == pytest.approx(4.0)


def test_streamk_shares_cover_every_gtile_once_and_number_the_parts_of_each_row():
    """The stream-K arithmetic of tcbc_spmspv2 (block shares of the row-major GTile order, owner(), part and
    nparts per segment), replayed in Python: every GTile is in exactly one block's share, each row's parts
    are numbered 0..nparts-1 once each, and streamk_parts() bounds the partial rows the kernel writes."""
    from unionsparse.kernels.tiled_cbc_spmspv import streamk_parts

    for gr, gc in ((1, 1), (3, 65), (112, 512), (7, 3)):
        t = gr * gc
        for nb in sorted({1, 2, 7, 48, 660, t // 4 or 1, t}):
            if nb > t:
                continue
            owner = lambda g, nb=nb, t=t: ((g + 1) * nb - 1) // t  # noqa: E731
            seen = np.zeros(t, dtype=int)
            parts: dict[int, list[int]] = {}
            for b in range(nb):
                f, fend = b * t // nb, (b + 1) * t // nb
                while f < fend:
                    tr = f // gc
                    nct = min(fend, (tr + 1) * gc) - f
                    seen[f:f + nct] += 1
                    assert all(owner(g) == b for g in (f, f + nct - 1))
                    part = b - owner(tr * gc)
                    nparts = owner((tr + 1) * gc - 1) - owner(tr * gc) + 1
                    parts.setdefault(tr, []).append(part)
                    assert 0 <= part < nparts <= streamk_parts((gr, gc), nb)
                    f += nct
            assert (seen == 1).all()
            for tr, pp in parts.items():
                assert sorted(pp) == list(range(len(pp))), (gr, gc, nb, tr)


def test_default_spmspv_launch_takes_stream_k_only_for_large_badly_filled_layers():
    """use_streamk on fp16 layers at static 50% (largest GTile ~4.3 KB: 5 blocks of 4 warps per SM): split-K
    fills 560 of 660 block slots for 28672 x 8192 (stream-K), 592 for 4096 x 4096 (too small for stream-K)
    and 640 for 8192 x 8192 (full enough)."""
    from types import SimpleNamespace

    from unionsparse.kernels.tiled_cbc_spmspv import use_streamk, v2_default_chunk

    def layer(m, k):
        return SimpleNamespace(grid=(-(-m // 256), -(-k // 16)), bits=None, max_gtile_value_bytes=lambda: 4400)

    assert use_streamk(layer(28672, 8192), 4, 2, sms=132)
    assert use_streamk(layer(49152, 12288), 4, 2, sms=132)
    assert not use_streamk(layer(4096, 4096), 4, 2, sms=132)
    assert not use_streamk(layer(8192, 8192), 4, 2, sms=132)
    assert v2_default_chunk(layer(28672, 8192), 4, 2, sms=132) == 103  # 5 splits x 112 rows
    # grids follow the device's SM count (a 58-SM GPU: 290 block slots, 2 splits of 256 GTiles)
    assert v2_default_chunk(layer(28672, 8192), 4, 2, sms=58) == 256
    assert use_streamk(layer(28672, 8192), 4, 2, sms=58) and not use_streamk(layer(4096, 4096), 4, 2, sms=58)


def test_launch_rules_size_grids_by_the_device_sm_count():
    from unionsparse.kernels import H200_SMS, sm_count
    from unionsparse.kernels.loader import cupy_or_none

    cp = cupy_or_none()
    expected = H200_SMS if cp is None else cp.cuda.Device().attributes["MultiProcessorCount"]
    assert sm_count() == expected


def test_driver_launch_arguments_are_checked_without_a_gpu():
    """The driver launch passes a ctypes struct by value (a pointer to its bytes) beside scalars, and refuses
    what it cannot pass."""
    import ctypes

    from unionsparse.kernels.cluster_launch import kernel_params

    class Pair(ctypes.Structure):
        _fields_ = [("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

    m = Pair(1, 2)
    ptrs, vals = kernel_params([m, np.int32(7)])
    assert ptrs[0] == ctypes.addressof(m) and vals[1].value == 7
    with pytest.raises(TypeError, match="unsupported"):
        kernel_params([3])
