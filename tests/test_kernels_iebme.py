"""IE-BME SpMM: the CPU reference against dense integer products, and the GPU kernel against the reference."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from unionsparse.formats import iebme
from unionsparse.kernels import available
from unionsparse.kernels.activations import quantize_activations
from unionsparse.kernels.iebme_check import (
    check_iebme_float_layer,
    check_iebme_layer,
    dense_partials,
    float_bound,
    fp16_close,
)
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


@pytest.mark.parametrize("xbits", [4, 8])  # activation codes of W*A4 and W*A8
@pytest.mark.parametrize("m,k,bits,perm,gs,tile,areas", [
    (64, 256, 4, "none", 128, (16, 64), (2, 2)),
    (37, 200, 4, "random", 64, (16, 64), (2, 2)),
    (50, 130, 2, "random", 130, (16, 64), (2, 2)),
    (24, 96, 4, "random", 96, (8, 32), (2, 1)),     # other geometries: the reference is generic
    (33, 70, 2, "none", 64, (16, 64), (4, 2)),
])
def test_reference_partials_match_dense_codes(m, k, bits, perm, gs, tile, areas, xbits):
    rng = np.random.default_rng(m * k + bits)
    codes, mat = random_layer(rng, m, k, bits, perm=perm, tile=tile, areas=areas)
    lim = 1 << (xbits - 1)
    x = rng.integers(-lim, lim, (5, k)).astype(np.int8)
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
    assert ks.x_budget() == ks.X_BUDGET and ks.x_budget(ks.WIDE_WARPS) == 2 * ks.X_BUDGET
    assert ks.config(4, ks.WIDE_WARPS)[1] == ks.WIDE_WARPS
    monkeypatch.setattr(ks, "_settings", ks.LaunchSettings(x_bytes=6144))
    assert ks.x_budget() == 6144 and ks.x_budget(ks.WIDE_WARPS) == 6144
    with pytest.raises(ValueError, match="warps per CTA"):
        ks.LaunchSettings(warps=3)


def test_cluster_launch_structs_match_the_driver_abi(monkeypatch):
    """CUlaunchAttribute is 72 bytes (id, padding, 64-byte value union) and CUlaunchConfig puts the stream at
    byte 32 (cuda.h, CUDA 12+); kernel arguments are device pointers or 4-byte scalars; the cluster path is
    chosen for 2 splits on sm_90 only, its bound can be moved and it can be turned off."""
    import ctypes

    from unionsparse.kernels import cluster_launch as cl
    from unionsparse.kernels import iebme_spmm as ks
    from unionsparse.kernels import study

    assert ctypes.sizeof(cl.LaunchAttribute) == 72 and cl.LaunchAttribute.x.offset == 8
    assert cl.LaunchConfig.hStream.offset == 32 and cl.LaunchConfig.numAttrs.offset == 48
    ptrs, vals = cl.kernel_params([np.int32(7), np.float32(0.5)])
    assert len(ptrs) == 2 and vals[0].value == 7 and ctypes.sizeof(vals[0]) == 4
    ptrs, vals = cl.kernel_params([np.int64(-3), np.uint64(2**63)])
    assert [v.value for v in vals] == [-3, 2**63] and [ctypes.sizeof(v) for v in vals] == [8, 8]
    with pytest.raises(TypeError, match="unsupported kernel argument"):
        cl.kernel_params([7])
    monkeypatch.setattr(ks, "_cc", lambda: 90)
    assert [ks.cluster_split(s) for s in (1, 2, 3, 8)] == [False, True, False, False]
    monkeypatch.setattr(ks, "_settings", ks.LaunchSettings(cluster=8))
    assert [ks.cluster_split(s) for s in (1, 2, 8, 9)] == [False, True, True, False]
    monkeypatch.setattr(ks, "_settings", ks.LaunchSettings(cluster=0))
    assert not ks.cluster_split(4)
    monkeypatch.setattr(ks, "_settings", ks.LaunchSettings())
    monkeypatch.setattr(ks, "_cc", lambda: 80)
    monkeypatch.setattr(cl, "compute_capability", lambda: 80)
    assert not ks.cluster_split(4)
    assert not ks.programmatic()  # programmatic dependent launch: sm_90 with bulk-copy rings, unless turned off
    monkeypatch.setattr(ks, "_cc", lambda: 90)
    monkeypatch.setattr(cl, "compute_capability", lambda: 90)
    assert ks.programmatic() and cl.programmatic_enabled()
    with cl.programmatic_launches(False):
        assert not ks.programmatic() and not cl.programmatic_enabled()
    assert ks.programmatic()
    monkeypatch.setattr(ks, "_settings", ks.LaunchSettings(pdl=False))
    assert not ks.programmatic()
    monkeypatch.setattr(ks, "_settings", ks.LaunchSettings())
    monkeypatch.setitem(study._builds, ks.KERNEL, study.Build(defines=(("IEBME_TMA", 0),)))  # cp.async rings
    assert not ks.programmatic()
    attr = cl.LaunchAttribute(id=cl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, x=1)
    assert bytes(attr)[:12] == bytes([6, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0])  # cuda.h: id 6, the int at byte 8


def _planned_layer(m: int, k: int):
    """A W4 layer of shape (m, k), group 128, with only what the launch plan reads (no GPU arrays)."""
    from unionsparse.kernels import iebme_spmm as ks

    return ks.DeviceLayer(shape=(m, k), bits=4, group_size=128, n_groups=k // 128, values=None, bitmaps=None,
                          offsets=None, pinv=None, wsT=None, ws_acc=None, counters=None, tr=m // 16, tc=k // 64,
                          mp=ks.padded_rows(m))


def test_launch_plan_takes_wide_ctas_only_when_they_need_fewer_waves(monkeypatch):
    """The launch rule, without a GPU (the compiled kernel's register count and the SM count patched): a
    512 x 8192 layer at N = 8 on a one-SM GPU needs 4 waves of 8-warp CTAs (X budget: 32 tiles per chunk)
    and 2 of 16-warp CTAs (64 tiles), so it takes 16; N = 1 (outside ``WIDE_N``, and X never caps its chunk),
    N = 32 and a forced warp count keep theirs; on 132 SMs the same layer fits one wave either way and keeps
    8. The plan's grid and shared memory follow its warps and chunk."""
    from types import SimpleNamespace

    from unionsparse.kernels import iebme_spmm as ks

    monkeypatch.setattr(ks, "_kernel", lambda *a, **k: SimpleNamespace(num_regs=64))
    monkeypatch.setattr(ks, "sm_count", lambda: 1)
    m, k = 512, 8192
    layer = _planned_layer(m, k)
    p8 = ks.plan(layer, 8)
    assert (p8.warps, p8.chunk, p8.grid) == (ks.WIDE_WARPS, 64, (2, 2))
    assert ks.waves(layer, 8, p8.chunk, p8.warps) < ks.waves(layer, 8, ks.chunk_for(layer, 8, warps=8), 8)
    assert p8.smem == ks.smem_bytes(4, False, 8, 64, 64 // 2 + 1, ks.WIDE_WARPS)
    assert ks.plan(layer, 1).warps == 8 and ks.plan(layer, 32).warps == 8
    assert ks.plan(layer, 8, splits=4).grid[1] == 4
    monkeypatch.setattr(ks, "_settings", ks.LaunchSettings(warps=8))
    assert ks.plan(layer, 8).warps == 8
    monkeypatch.setattr(ks, "_settings", ks.LaunchSettings())
    monkeypatch.setattr(ks, "sm_count", lambda: 132)
    assert ks.plan(layer, 8).warps == 8
    assert not ks.single_chunk(layer, 8)  # 128 tiles of K never fit one chunk (at most 124)


def test_max_splits_bounds_the_k_chunks(monkeypatch):
    """``LaunchSettings.max_splits`` (a study of fewer, longer CTAs on the decode step): LLaMA-2-7B's linears on 132
    SMs keep the chunk rule's splits without it (Q/K/V 5, o_proj 11, gate/up 3, down_proj 15), take at most the
    bound with it, and never a chunk above the X budget's cap (down_proj's 172 tiles of K need 2 chunks)."""
    from types import SimpleNamespace

    from unionsparse.kernels import iebme_spmm as ks

    monkeypatch.setattr(ks, "_kernel", lambda *a, **k: SimpleNamespace(num_regs=64))
    monkeypatch.setattr(ks, "sm_count", lambda: 132)
    shapes = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]
    grids = {cap: [] for cap in (None, 4, 2, 1)}
    for cap in grids:
        monkeypatch.setattr(ks, "_settings", ks.LaunchSettings(max_splits=cap))
        grids[cap] = [ks.plan(_planned_layer(m, k), 1).grid[1] for m, k in shapes]
    assert grids == {None: [5, 11, 3, 15], 4: [4, 4, 3, 4], 2: [2, 2, 2, 2], 1: [1, 1, 1, 2]}
    with pytest.raises(ks.KernelError):
        ks.LaunchSettings(max_splits=0)


def test_side_staging_reserves_its_shared_memory(monkeypatch):
    """The outlier side's activation codes and scales are staged in shared memory with X for one side group (not
    for several, read per output); the plan then reserves N x channels bytes of codes and N float32 scales beyond
    the rest of the layout, and nothing for float16 activations (no side)."""
    from types import SimpleNamespace

    from unionsparse.kernels import iebme_spmm as ks

    monkeypatch.setattr(ks, "_kernel", lambda *a, **k: SimpleNamespace(num_regs=64))
    monkeypatch.setattr(ks, "sm_count", lambda: 132)
    m, k = 4096, 4096
    layer = _planned_layer(m, k)

    def side(n, group):
        return ks.Side(np.zeros((8, n), np.int8), np.zeros((8, 1), np.float32), np.zeros((m, n), np.int8),
                       np.zeros((m, 1), np.float32), group)

    assert ks.staged_side(side(128, 128)) == 128 and ks.staged_side(side(272, 512)) == 272
    assert ks.staged_side(side(160, 64)) == 0 and ks.staged_side(None) == 0
    for n in (1, 8):
        base, with_side = ks.plan(layer, n, splits=2), ks.plan(layer, n, splits=2, side=128)
        assert with_side.grid == base.grid and with_side.smem - base.smem == n * 128 + 4 * n
    assert ks.plan(layer, 8, splits=2, xb=2, side=128).smem == ks.plan(layer, 8, splits=2, xb=2).smem


def _launch_variants():
    """``benchmarks/launch_variants.py``, the IE-BME studies' variant strings (not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "launch_variants.py"
    spec = importlib.util.spec_from_file_location("launch_variants", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_study_overrides_parse_and_set_the_launch_settings(monkeypatch):
    """``parse_overrides`` / ``apply_overrides`` (the launch studies' variants, in benchmarks/): keys upper-cased,
    an empty item is the default, unknown keys refused; a variant replaces the launch settings and the kernel's
    study build in force (kept keys stay, every other one returns to its default); no environment variable is
    read or written."""
    import argparse
    import os

    from unionsparse.kernels import iebme_spmm as ks
    from unionsparse.kernels import study

    lv = _launch_variants()
    assert lv.parse_overrides("warps=16, xbytes=32768;") == [{"WARPS": "16", "XBYTES": "32768"}, {}]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown launch setting"):
        lv.parse_overrides("WRAPS=8")
    monkeypatch.setattr(ks, "_settings", ks.LaunchSettings(ilp=4))
    monkeypatch.setattr(ks, "programmatic_enabled", lambda: True)  # an sm_90 GPU
    monkeypatch.setattr(study, "_builds", {ks.KERNEL: study.Build(defines=(("IEBME_TRACE", 1),))})
    env = dict(os.environ)
    assert lv.apply_overrides({"WARPS": "16"}, keep=("TRACE",)) == "WARPS=16"
    assert ks.settings() == ks.LaunchSettings(warps=16) and ks.config(1)[1] == 16
    assert study.build(ks.KERNEL) == study.Build(defines=(("IEBME_TRACE", 1),))
    assert lv.apply_overrides({"TMA": "0", "TRACE": "1", "SOURCE": "old.cu", "PDL": "0"}) != "default"
    assert study.build(ks.KERNEL) == study.Build("old.cu", (("IEBME_TMA", 0), ("IEBME_TRACE", 1)))
    assert ks.settings() == ks.LaunchSettings(pdl=False) and not ks.programmatic()
    assert lv.apply_overrides({"MAXSPLITS": "2"}) == "MAXSPLITS=2" and ks.settings() == ks.LaunchSettings(max_splits=2)
    assert lv.apply_overrides({}) == "default" and ks.settings() == ks.LaunchSettings()
    assert study.build(ks.KERNEL) == study.SHIPPED and study._builds == {}
    assert dict(os.environ) == env
    import dataclasses  # every launch setting can be varied by the studies

    assert set(lv.SETTINGS_KEYS.values()) == {f.name for f in dataclasses.fields(ks.LaunchSettings)}


def test_launch_settings_hold_only_what_the_product_tunes():
    """The product's launch settings are the tuned fields; study builds (another .cu, macros) live in
    kernels/study.py, and nothing but the studies in benchmarks/ and the tests puts one in force."""
    import dataclasses
    import re
    from pathlib import Path

    from unionsparse.kernels import iebme_spmm as ks

    tuned = {"nstage", "warps", "ilp", "minb", "x_bytes", "cluster", "pdl", "max_splits"}
    assert {f.name for f in dataclasses.fields(ks.LaunchSettings)} == tuned
    root = Path(__file__).resolve().parents[1]
    setters = re.compile(r"\b(use_build|building)\(|_builds\[")
    product = [p for d in ("kernels", "compressor", "formats", "solvers") for p in (root / d).rglob("*.py")]
    found = [str(p.relative_to(root)) for p in product if p.name != "study.py" and setters.search(p.read_text())]
    assert found == []


def test_study_builds_compile_apart_from_the_shipped_kernels(monkeypatch, tmp_path):
    """A study build (another revision of the .cu, extra macros) compiles its own kernel, under its own cache
    key, and the shipped build comes back unchanged once the study ends; the one module loader does the same
    for every other kernel."""
    from types import SimpleNamespace

    from unionsparse.kernels import iebme_spmm as ks
    from unionsparse.kernels import loader, study

    compiled = []

    def fake_compile(code, options=(), expressions=()):
        compiled.append((code, tuple(options)))
        return SimpleNamespace(get_function=lambda name: SimpleNamespace(name=name, n=len(compiled)))

    monkeypatch.setattr(ks, "compile_source", fake_compile)
    monkeypatch.setattr(loader, "compile_source", fake_compile)
    monkeypatch.setattr(ks, "programmatic", lambda: False)
    ks._compiled.cache_clear()
    try:
        shipped = ks._kernel(4, 1, False, False, 2, 8, 2)
        other = tmp_path / "iebme_old.cu"
        other.write_text("// an older revision\n" + ks.SOURCE.read_text())
        with study.building(ks.KERNEL, study.Build(str(other), (("IEBME_TRACE", 1),))):
            traced = ks._kernel(4, 1, False, False, 2, 8, 2)
        assert ks._kernel(4, 1, False, False, 2, 8, 2) is shipped and len(compiled) == 2
    finally:
        ks._compiled.cache_clear()
    assert traced is not shipped
    (code0, opts0), (code1, opts1) = compiled
    assert code1.startswith("// an older revision\n") and code0 == ks.SOURCE.read_text() + "\nIEBME_ENTRY(4, 1, 0, 0)\n"
    assert "-DIEBME_TRACE=1" in opts1 and not any("TRACE" in o for o in opts0)
    assert opts1[: len(opts0)] == opts0
    with study.building("glue", study.Build(str(other), (("X", 3),))):
        loader.load_module("glue")
    loader.load_module("glue")
    assert compiled[2][0].startswith("// an older revision") and compiled[2][1] == ("-DX=3",)
    assert compiled[3] == ((loader.KERNEL_DIR / "glue.cu").read_text(), ())


def test_check_layer_cpu_passes_and_catches_corruption():
    rng = np.random.default_rng(5)
    _, mat = random_layer(rng, 48, 192, 4)
    ws = (rng.random((48, 2)) + 0.5).astype(np.float16)
    assert check_iebme_layer(mat, ws, 128, 4, [1, 8], "cpu", rng) == []


gpu = pytest.mark.skipif(not available(), reason="needs CuPy and a CUDA device")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("xbits", [4, 8])
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("perm", ["none", "random"])
@pytest.mark.parametrize("m,k,gs", [(64, 512, 128), (100, 1000, 64), (333, 4100, 4100), (48, 2048, 256)])
def test_gpu_partials_exact_and_output_close(bits, perm, m, k, gs, xbits):
    from unionsparse.kernels.iebme_spmm import prepare_layer, single_chunk, spmm_iebme

    rng = np.random.default_rng(m + k + bits)
    codes, mat = random_layer(rng, m, k, bits, perm=perm)
    g = -(-k // gs)
    ws = (rng.random((m, g)) + 0.5).astype(np.float16)
    layer = prepare_layer(mat, ws, gs)
    for n in (1, 5, 8, 13, 32, 40):
        x = rng.standard_normal((n, k)).astype(np.float32)
        xq, xs = quantize_activations(x, xbits, gs)
        y_ref, p_ref = iebme_spmm_reference(mat, ws, xq, xs, gs)
        for splits in (1, 3):
            p = spmm_iebme(layer, xq, xs, splits=splits, debug_partials=True).get()
            np.testing.assert_array_equal(p, p_ref)
            y = spmm_iebme(layer, xq, xs, splits=splits).get()
            assert not np.isnan(y).any()
            if single_chunk(layer, n, splits):
                np.testing.assert_array_equal(y, y_ref)  # same operations in the same order
            assert fp16_close(y, y_ref).all()


def test_float_reference_is_the_decoded_product():
    """W4A16: the reference reads the stored arrays (row permutations included) and is code x scale x fp16(x)."""
    from unionsparse.kernels.iebme_reference import iebme_float_reference

    rng = np.random.default_rng(3)
    for bits, perm, m, k, gs in ((4, "random", 100, 1000, 64), (2, "none", 64, 512, 128)):
        codes, mat = random_layer(rng, m, k, bits, perm=perm)
        ws = (rng.random((m, -(-k // gs))) + 0.5).astype(np.float16)
        x = rng.standard_normal((3, k)).astype(np.float32)
        truth, bound = float_bound(codes, ws, gs, x)
        y = iebme_float_reference(mat, ws, x, gs).astype(np.float64)
        assert (np.abs(y - truth) <= bound).all()
        wrong = iebme_float_reference(mat, np.roll(ws, 1, axis=1), x, gs).astype(np.float64)
        assert (np.abs(wrong - truth) > bound).any()  # a scale of another group is caught
        assert check_iebme_float_layer(mat, ws, gs, (1, 3), "cpu", rng) == []


def test_verify_float_check_fails_on_a_wrong_reference(monkeypatch):
    """verify's W4A16 check compares against the decoded codes: a reference reading the scales of another group
    fails it."""
    from unionsparse.kernels import iebme_reference

    rng = np.random.default_rng(4)
    _, mat = random_layer(rng, 64, 512, 4, perm="random")
    ws = (rng.random((64, 4)) + 0.5).astype(np.float16)
    right = iebme_reference.iebme_float_reference
    monkeypatch.setattr(iebme_reference, "iebme_float_reference",
                        lambda m, w, x, g: right(m, np.roll(w, 1, axis=1), x, g))
    assert check_iebme_float_layer(mat, ws, 128, (2,), "cpu", rng)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("perm", ["none", "random"])
@pytest.mark.parametrize("m,k,gs", [(64, 512, 128), (100, 1000, 64), (333, 4100, 4100), (48, 2048, 256)])
def test_gpu_float16_activations(bits, perm, m, k, gs):
    """W4A16 / W2A16: the kernel's float16-activation variant against the float64 product of the decoded codes,
    within float32 summation and one float16 rounding, at N = 1 to 40 (two launches above 32), split-K (global and
    cluster), every output written (NaN-poisoned), and equal to the CPU reference within the same bound."""
    from unionsparse.kernels.iebme_reference import iebme_float_reference
    from unionsparse.kernels.iebme_spmm import prepare_layer, spmm_iebme16

    rng = np.random.default_rng(m + k + bits + 16)
    codes, mat = random_layer(rng, m, k, bits, perm=perm)
    ws = (rng.random((m, -(-k // gs))) + 0.5).astype(np.float16)
    layer = prepare_layer(mat, ws, gs)
    for n in (1, 5, 8, 13, 32, 40):
        x = rng.standard_normal((n, k)).astype(np.float16)
        truth, bound = float_bound(codes, ws, gs, x)
        ref = iebme_float_reference(mat, ws, x, gs).astype(np.float64)
        assert (np.abs(ref - truth) <= bound).all()
        for splits in (1, 2, 3, None):
            y = spmm_iebme16(layer, x, splits=splits).get().astype(np.float64)
            assert not np.isnan(y).any(), (n, splits)
            assert (np.abs(y - truth) <= bound).all(), (n, splits, float(np.abs(y - truth).max()))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits, perm, m, k, gs", [(4, "random", 100, 1000, 64), (2, "none", 64, 512, 128),
                                                  (4, "none", 333, 4100, 4100)])
@pytest.mark.parametrize("n_side, side_group", [(16, 16), (128, 128), (272, 512), (160, 64)])
def test_gpu_outlier_side_product_in_the_epilogue(bits, perm, m, k, gs, n_side, side_group):
    """The 8-bit outlier side product added in the kernel's epilogue before the one rounding: the reference's
    float32 main sums plus ``grouped_int_matmul``'s side groups, bit for bit without split-K, within fp16
    tolerance through a cluster (2 splits) and through atomics (3); the side is added once, not per split. One
    side group: its activation codes staged with X, in passes of 128 channels (272: three); several: per output."""
    import cupy as cp
    import torch
    from unionsparse.formats.arithmetic.grouped import grouped_int_matmul
    from unionsparse.kernels.iebme_spmm import Side, prepare_layer, single_chunk, spmm_iebme, staged_side

    rng = np.random.default_rng(m + n_side)
    codes, mat = random_layer(rng, m, k, bits, perm=perm)
    ws = (rng.random((m, -(-k // gs))) + 0.5).astype(np.float16)
    layer = prepare_layer(mat, ws, gs)
    sg = -(-n_side // side_group)
    wq = rng.integers(-127, 128, (m, n_side)).astype(np.int8)
    sw = (rng.random((m, sg)) * 0.01).astype(np.float32)
    for n in (1, 5, 8, 40):
        xq, xs = quantize_activations(rng.standard_normal((n, k)).astype(np.float32), 4, gs)
        oq = rng.integers(-127, 128, (n, n_side)).astype(np.int8)
        osx = (rng.random((n, sg)) * 0.01).astype(np.float32)
        _, p_ref = iebme_spmm_reference(mat, ws, xq, xs, gs)
        y32 = torch.from_numpy(scale_partials(p_ref, ws, xs, dtype=np.float32))
        want = grouped_int_matmul(torch.from_numpy(oq), torch.from_numpy(osx), torch.from_numpy(wq),
                                  torch.from_numpy(sw), side_group, out=y32).half().numpy()
        side = Side(cp.asarray(oq), cp.asarray(osx), cp.asarray(wq), cp.asarray(sw), side_group)
        for splits in (1, 2, 3):
            y = spmm_iebme(layer, xq, xs, splits=splits, side=side).get()
            if single_chunk(layer, n, splits, side=staged_side(side)):
                np.testing.assert_array_equal(y, want)
            assert fp16_close(y, want).all()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("env", [{}, {"TMA": "0"}, {"NSTAGE": "3"}, {"NSTAGE": "3", "TMA": "0"}, {"CLUSTER": "0"},
                                 {"CLUSTER": "8"}, {"CLUSTER": "16"}, {"WARPS": "16"}, {"TRACE": "1"},
                                 {"PDL": "0"}])
def test_gpu_ring_variants_and_trace(monkeypatch, env):
    """Both ring paths (bulk copy + mbarrier, cp.async groups) at depths 2 and 3, over chunks of 1 to 9
    batches, give the exact partial sums; split-K through a thread-block cluster (2 splits on sm_90, up to 8
    or 16 with CLUSTER=8 / 16) and through global atomics (more splits, or CLUSTER=0) give the reference
    output, the cluster path the same bits on every run; a trace build writes ordered per-CTA timestamps
    and the same output."""
    import cupy as cp
    from unionsparse.kernels import iebme_spmm as ks
    from unionsparse.kernels import study

    monkeypatch.setattr(ks, "_settings", ks.settings())
    monkeypatch.setattr(study, "_builds", dict(study._builds))
    _launch_variants().apply_overrides(env)
    rng = np.random.default_rng(21)
    m, k, gs = 100, 2300, 128
    _, mat = random_layer(rng, m, k, 4, perm="random")
    ws = (rng.random((m, -(-k // gs))) + 0.5).astype(np.float16)
    layer = ks.prepare_layer(mat, ws, gs)
    for n in (1, 8, 17):
        xq, xs = quantize_activations(rng.standard_normal((n, k)).astype(np.float32), 4, gs)
        y_ref, p_ref = iebme_spmm_reference(mat, ws, xq, xs, gs)
        for splits in (1, 2, 5, 9):
            if "TRACE" in env:
                x, xsd = ks.prepare_x(layer, xq, xs)
                grid = ks.plan(layer, n, splits).grid
                tr = cp.zeros((grid[0] * grid[1], 5), dtype=cp.uint64)
                y = cp.full((n, m), 0x7E00, dtype=cp.uint16)
                ks.launch(replace(layer, dummy=tr), x, xsd, y, splits=splits)  # the trace build's buffer
                t = tr.get().astype(np.int64)
                assert (t[:, 0] > 0).all() and (np.diff(t[:, :4], axis=1) >= 0).all()
                assert t[:, 4].max() < cp.cuda.Device().attributes["MultiProcessorCount"]
                assert fp16_close(y.view(cp.float16).get(), y_ref).all()
                continue
            p = ks.spmm_iebme(layer, xq, xs, splits=splits, debug_partials=True).get()
            np.testing.assert_array_equal(p, p_ref)
            y = ks.spmm_iebme(layer, xq, xs, splits=splits).get()
            assert fp16_close(y, y_ref).all()
            grid_y = ks.plan(layer, n, splits).grid[1]
            assert ks.cluster_split(grid_y) == (1 < grid_y <= int(env.get("CLUSTER", ks.CLUSTER_UP_TO)))
            if ks.cluster_split(grid_y):
                np.testing.assert_array_equal(ks.spmm_iebme(layer, xq, xs, splits=splits).get(), y)


@gpu
@pytest.mark.gpu
def test_gpu_wide_ctas_when_they_need_fewer_waves(monkeypatch):
    """With a GPU of one SM (patched), a 512 x 8192 layer at N = 8 needs 4+ waves of 8-warp CTAs (X budget:
    32 tiles per chunk) but 2 of 16-warp CTAs (64 tiles): the launch takes 16 warps and gives the reference
    output; N = 32 is outside ``WIDE_N`` and keeps 8."""
    from unionsparse.kernels import iebme_spmm as ks

    rng = np.random.default_rng(8)
    m, k, gs = 512, 8192, 128
    _, mat = random_layer(rng, m, k, 4, perm="none")
    ws = (rng.random((m, k // gs)) + 0.5).astype(np.float16)
    layer = ks.prepare_layer(mat, ws, gs)
    monkeypatch.setattr(ks, "sm_count", lambda: 1)
    p8 = ks.plan(layer, 8)
    assert p8.warps == ks.WIDE_WARPS and p8.chunk > ks.chunk_for(layer, 8, warps=8)
    assert ks.waves(layer, 8, p8.chunk, p8.warps) < ks.waves(layer, 8, ks.chunk_for(layer, 8, warps=8), 8)
    assert ks.plan(layer, 32).warps == 8
    for n in (8, 32):
        xq, xs = quantize_activations(rng.standard_normal((n, k)).astype(np.float32), 4, gs)
        y_ref, p_ref = iebme_spmm_reference(mat, ws, xq, xs, gs)
        np.testing.assert_array_equal(ks.spmm_iebme(layer, xq, xs, debug_partials=True).get(), p_ref)
        assert fp16_close(ks.spmm_iebme(layer, xq, xs).get(), y_ref).all()


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


def test_gpu_study_scripts_check_their_arguments_without_a_gpu():
    """The launch studies parse and check their arguments before touching CuPy: a bad value is one line and
    exit code 2 on any machine, and variant strings parse to override dicts."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    r = subprocess.run([sys.executable, str(bench / "trace_iebme.py"), "--launches", "2"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--launches must be at least 3" in r.stderr
    spec = importlib.util.spec_from_file_location("tune_iebme_warps", bench / "tune_iebme_warps.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    assert tune.parse_variants("WARPS=16,XBYTES=32768;") == [{"WARPS": "16", "XBYTES": "32768"}, {}]
    with pytest.raises(Exception, match="KEY=VALUE"):
        tune.parse_variants("WARPS")


@gpu
@pytest.mark.gpu
def test_bench_times_an_ie_bme_artifacts_own_layers_beside_fp16_and_int8(reference_artifact, run_cli):
    import json

    from unionsparse.compressor.artifact.store import Artifact

    r = run_cli("bench", reference_artifact, "--n", "1,8", "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    names = set(Artifact(str(reference_artifact)).layer_names)
    assert {row["shape"] for row in data["rows"]} == names and {row["N"] for row in data["rows"]} == {1, 8}
    for row in data["rows"]:
        assert row["format"] == "ie-bme" and row["iebme_us"] > 0 and row["speedup_vs_cublas"] > 0
        assert row["int8_us"] is None or row["speedup_vs_int8"] > 0
    assert {int(n) for n in data["summary"]} == {1, 8}


@pytest.mark.parametrize("bits, perm, gs", [(4, "random", 64), (4, "none", 200), (2, "random", 64)])
def test_decoded_dense_reference_is_the_weights_exactly(bits, perm, gs):
    """The IE-BME prefill's dense weight: w = code x scale from the decoded codes, 4-bit as float16 halves whose
    sum is w exactly (hi its float16 rounding), 2-bit as float16 alone; the row permutations undone."""
    from unionsparse.kernels.iebme_reference import decoded_dense_reference

    rng = np.random.default_rng(bits * 11 + gs)
    codes, mat = random_layer(rng, 37, 200, bits, perm=perm)
    ws = (rng.random((37, -(-200 // gs))) * 0.1 + 0.01).astype(np.float16)
    w64 = codes.astype(np.float64) * np.repeat(ws.astype(np.float64), gs, axis=1)[:, :200]
    got = decoded_dense_reference(mat, ws, gs)
    assert got.view(np.uint16)[:, :200].tolist() == w64.astype(np.float16).view(np.uint16).tolist()
    if bits == 4:
        np.testing.assert_array_equal(got[:, :200].astype(np.float64) + got[:, 200:].astype(np.float64), w64)
        assert (got[:, 200:] != 0).mean() > 0.1
    else:
        assert got.shape == (37, 200)
        np.testing.assert_array_equal(got.astype(np.float64), w64)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("perm", ["none", "random"])
@pytest.mark.parametrize("m,k,gs", [(64, 512, 128), (100, 1000, 64), (333, 4100, 4100)])
def test_gpu_decode_dense_and_the_dense_prefill(bits, perm, m, k, gs):
    """kernels/iebme_decode.cu: the dense weight bit for bit its reference (permutations, ragged M and K, one group
    and groups of 64), and the prefill product (decode once + cuBLAS) against the float64 product within the
    kernel's bound, at N = 64 and 300."""
    import cupy as cp
    from unionsparse.kernels.cublas_gemm import dense_halves
    from unionsparse.kernels.iebme_decode import decode_dense, spmm_dense16
    from unionsparse.kernels.iebme_reference import decoded_dense_reference
    from unionsparse.kernels.iebme_spmm import prepare_layer

    rng = np.random.default_rng(m + k + bits + 64)
    codes, mat = random_layer(rng, m, k, bits, perm=perm)
    ws = (rng.random((m, -(-k // gs))) + 0.5).astype(np.float16)
    layer = prepare_layer(mat, ws, gs)
    kp, h = layer.tc * 64, dense_halves(bits)
    ref = decoded_dense_reference(mat, ws, gs)
    want = np.zeros((m, h * kp), np.float16)
    for i in range(h):
        want[:, i * kp : i * kp + k] = ref[:, i * k : (i + 1) * k]
    out = cp.full((m, h * kp), cp.nan, cp.float16)
    assert decode_dense(layer, out).get().view(np.uint16).tolist() == want.view(np.uint16).tolist()
    for n in (64, 300):
        x = rng.standard_normal((n, k)).astype(np.float16)
        truth, bound = float_bound(codes, ws, gs, x)
        y = spmm_dense16(layer, cp.asarray(x)).get().astype(np.float64)
        assert (np.abs(y - truth) <= 2 * bound).all(), (n, float(np.abs(y - truth).max()))


def _int_case(rng, m, k, bits, perm, gs, n, n_side=0):
    """A random IE-BME layer with weight scales, activation codes (4-bit) with scales and an 8-bit outlier side."""
    import torch

    codes, mat = random_layer(rng, m, k, bits, perm=perm)
    ws = (rng.random((m, -(-k // gs))) * 0.1 + 0.01).astype(np.float16)
    xq = rng.integers(-8, 8, (n, k)).astype(np.int8)
    xs = (rng.random((n, -(-k // gs))) * 0.2 + 0.01).astype(np.float16).astype(np.float32)  # as act_quant rounds
    side = None
    if n_side:
        side = (torch.from_numpy(rng.integers(-127, 128, (n, n_side)).astype(np.int8)),
                torch.from_numpy((rng.random((n, 1)) * 0.05).astype(np.float32)),
                torch.from_numpy(rng.integers(-127, 128, (m, n_side)).astype(np.int8)),
                torch.from_numpy((rng.random((m, 1)) * 0.01).astype(np.float32)), n_side)
    return codes, mat, ws, xq, xs, side


def _int_reference(mat, ws, xq, xs, gs, side):
    """The IE-BME kernel's function (reference_ops.iebme_spmm): exact group sums scaled in group order, the side
    product added in float32, one float16 rounding."""
    import torch
    from unionsparse.formats.arithmetic.grouped import grouped_int_matmul
    from unionsparse.kernels.iebme_reference import iebme_partial_sums

    y32 = torch.from_numpy(scale_partials(iebme_partial_sums(mat, xq, gs), ws, xs, dtype=np.float32))
    if side is not None:
        oq, osx, wq, sw, group = side
        grouped_int_matmul(oq, osx, wq, sw, group, out=y32)
    return y32.half()


def _exact(codes, ws, xq, xs, gs, side):
    """(float64 product of the dequantized inputs and weights, side included; the l2 norm of each output's terms)."""
    import torch

    k = codes.shape[1]
    x = torch.from_numpy(xq).double() * torch.from_numpy(xs).double().repeat_interleave(gs, 1)[:, :k]
    w = torch.from_numpy(codes).double() * torch.from_numpy(ws.astype(np.float64)).repeat_interleave(gs, 1)[:, :k]
    y, sq = x @ w.T, (x * x) @ (w * w).T
    if side is not None:
        oq, osx, wq, sw, _ = side
        xo, wo = oq.double() * osx.double(), wq.double() * sw.double()
        y, sq = y + xo @ wo.T, sq + (xo * xo) @ (wo * wo).T
    return y, sq.sqrt()


def _rounding_sized(got, exact, norm2, k) -> bool:
    """Within float16's half ulp (of the next binade where the float32 sum may cross one) of the exact product, plus
    a float32 summation error of 16 sqrt(terms) units of 2^-24 times the l2 norm of the terms (terms: the dense path's
    4 K products). The kernel's function meets it; dropping the inputs' low halves (errors of 2^-12 per input) does
    not."""
    from unionsparse.compressor.runtime.agreement import ulp16

    acc = 16 * (4 * k) ** 0.5 * 2.0**-24 * norm2
    tol = ulp16(exact.abs().float() * (1 + 2**-9)).double() / 2 + acc
    return bool(((got.double() - exact).abs() <= tol).all())


@pytest.mark.parametrize("bits, perm, gs, n_side", [(4, "random", 64, 0), (4, "none", 1000, 16), (2, "random", 128, 8)])
def test_dense_int_product_is_the_kernel_function(bits, perm, gs, n_side):
    """The quantized-activation prompt path (the dense weight's exact halves times the inputs' exact halves s_x · q_x,
    float32 sums, the side product in float32, one rounding) on the reference's dense weight: as close to the exact
    product as float32 summation allows, as the kernel's function is, and a wrong scale row is far outside it."""
    import torch
    from unionsparse.compressor.runtime.agreement import ulp16
    from unionsparse.kernels.iebme_decode import dense_int_product
    from unionsparse.kernels.iebme_reference import decoded_dense_reference

    rng = np.random.default_rng(bits * 7 + gs + n_side)
    codes, mat, ws, xq, xs, side = _int_case(rng, 37, 1000, bits, perm, gs, 70, n_side)
    exact, norm2 = _exact(codes, ws, xq, xs, gs, side)
    want = _int_reference(mat, ws, xq, xs, gs, side).float()
    assert _rounding_sized(want, exact, norm2, 1000)  # the kernel's function meets the bound
    w = torch.from_numpy(decoded_dense_reference(mat, ws, gs))
    got = dense_int_product(w, torch.from_numpy(xq), torch.from_numpy(xs), gs, side).float()
    assert _rounding_sized(got, exact, norm2, 1000)
    wrong = torch.from_numpy(decoded_dense_reference(mat, np.roll(ws, 1, axis=0), gs))
    bad = dense_int_product(wrong, torch.from_numpy(xq), torch.from_numpy(xs), gs, side).float()
    assert ((bad - want).abs() > 4 * ulp16(want)).float().mean() > 0.5


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("perm", ["none", "random"])
@pytest.mark.parametrize("m,k,gs,n_side", [(64, 512, 128, 0), (100, 1000, 64, 16), (333, 4100, 4100, 128)])
def test_gpu_dense_int_prefill(bits, perm, m, k, gs, n_side):
    """The quantized-activation prompt product on the GPU (iebme_decode.spmm_dense_int: the decoded dense weight,
    two cuBLAS GEMMs into float32, the side product) as close to the exact product as float32 sums allow, at N = 64
    and 300, ragged M and K, one group and groups of 64, the outlier side product included."""
    import torch
    from unionsparse.kernels.iebme_decode import spmm_dense_int
    from unionsparse.kernels.iebme_spmm import prepare_layer

    rng = np.random.default_rng(m + k + bits + n_side)
    for n in (64, 300):
        codes, mat, ws, xq, xs, side = _int_case(rng, m, k, bits, perm, gs, n, n_side)
        layer = prepare_layer(mat, ws, gs)
        exact, norm2 = _exact(codes, ws, xq, xs, gs, side)
        xq_d = torch.zeros(n, layer.tc * 64, dtype=torch.int8)
        xq_d[:, :k] = torch.from_numpy(xq)
        dev_side = None if side is None else tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in side)
        got = spmm_dense_int(layer, xq_d.cuda(), torch.from_numpy(xs).cuda(), dev_side).float().cpu()
        assert _rounding_sized(got, exact, norm2, k), (n, float((got.double() - exact).abs().max()))
