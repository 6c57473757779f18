"""--keep-outliers end to end: artifact side matrix, inspect byte counts, verify, eval, bad values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

N_OUT = 16


@pytest.fixture(scope="module")
def outlier_artifact(llama_with_tokenizer, tmp_path_factory) -> Path:
    """The tiny LLaMA, Wanda 50 % + W4A4 + GPTQ with 16 outlier channels, IE-BME with DP reordering."""
    from unionsparse.compressor.cli import main

    model, calib = llama_with_tokenizer
    out = tmp_path_factory.mktemp("outliers") / "o.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(model), "-o", str(out), "--quiet", "--prune", "wanda", "--calib", str(calib),
              "--nsamples", "4", "--seqlen", "64", "--quant", "w4a4", "--gptq", "--keep-outliers", str(N_OUT),
              "--reorder", "dp"])
    assert e.value.code == 0
    return out


def ref_act_quant(x: np.ndarray, bits: int, group: int, clip: float) -> tuple[np.ndarray, np.ndarray]:
    """The documented activation rule, written independently (per token, per group, fp16 scales)."""
    n, k = x.shape
    g = -(-k // group)
    hi = 2 ** (bits - 1) - 1
    codes = np.zeros((n, k), np.int64)
    scales = np.zeros((n, g), np.float16)
    for j in range(g):
        blk = x[:, j * group : (j + 1) * group].astype(np.float32)
        s = (np.abs(blk).max(axis=1) * np.float32(clip) / np.float32(hi + 0.5)).astype(np.float32)
        s = np.maximum(s, np.finfo(np.float16).tiny).astype(np.float16)
        s = np.maximum(s, np.float16(np.finfo(np.float16).tiny))
        scales[:, j] = s
        codes[:, j * group : (j + 1) * group] = np.clip(np.rint(blk / s.astype(np.float32)[:, None]), -hi - 1, hi)
    return codes, scales


def independent_output(x: np.ndarray, arrays: dict, codes: np.ndarray, attrs: dict) -> np.ndarray:
    """float64 [N, M] of the outlier layer from its stored arrays, by explicit int64 group loops."""
    act = attrs["activations"]
    ch = arrays["outlier_channels"].astype(np.int64)
    k = x.shape[1]
    normal = np.setdiff1d(np.arange(k), ch)
    xp = np.concatenate([x[:, normal], np.zeros((x.shape[0], ch.size), np.float32)], axis=1)
    g = attrs["group_size"]
    xq, sx = ref_act_quant(xp, 4, g, act["clip"])
    y = np.zeros((x.shape[0], codes.shape[0]))
    for j in range(-(-k // g)):
        sl = slice(j * g, (j + 1) * g)
        p = xq[:, sl] @ codes[:, sl].astype(np.int64).T
        y += p * (sx[:, j : j + 1].astype(np.float64) * arrays["scales"][:, j].astype(np.float64)[None, :])
    og = act["outlier_group_size"]
    oq, osx = ref_act_quant(x[:, ch], 8, og, 1.0)
    for j in range(-(-ch.size // og)):
        sl = slice(j * og, (j + 1) * og)
        p = oq[:, sl] @ arrays["outlier_codes"][:, sl].astype(np.int64).T
        y += p * (osx[:, j : j + 1].astype(np.float64) * arrays["outlier_scales"][:, 0].astype(np.float64)[None, :])
    return y


def test_artifact_round_trip_with_outliers(outlier_artifact):
    from unionsparse.compressor.artifact.store import Artifact

    art = Artifact(outlier_artifact)
    assert art.attrs["config"]["keep_outliers"] == N_OUT
    for name in art.layer_names:
        rec = art.read_layer(name)
        side, act = rec.outliers, rec.attrs["activations"]
        m, k = rec.encoding.shape
        assert side is not None and side.codes.shape == (m, N_OUT) and side.codes.dtype == np.int8
        assert side.scales.shape == (m, 1) and (side.scales.astype(np.float32) > 0).all()
        assert act["outlier_channels"] == side.channels.tolist() and act["outlier_bits"] == 8
        assert act["outlier_group_size"] == N_OUT and act["bits"] == 4
        codes = rec.encoding.decode()
        assert not codes[:, k - N_OUT :].any()  # the main matrix holds no outlier column
        assert codes.min() >= -8 and codes.max() <= 7
        assert side.perm[-N_OUT:].tolist() == side.channels.tolist()


def test_writer_reader_round_trip_is_exact(tmp_path):
    """A QuantizedLayer with outliers, encoded, written and read back: every array identical."""
    from unionsparse.compressor.artifact.store import Artifact, ArtifactWriter, new_root_attrs
    from unionsparse.compressor.config import CompressConfig
    from unionsparse.compressor.pipeline.encode import encode_layer
    from unionsparse.compressor.quantize.layer import QuantSpec, quantize_layer

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g)
    xsq = torch.rand(256, generator=g)
    xsq[[5, 77, 200]] = 50.0
    ql = quantize_layer(w, QuantSpec.from_mode("w4a4", keep_outliers=8), x_sq_norm=xsq)
    assert {5, 77, 200} <= set(ql.outliers.channels.tolist())
    cfg = CompressConfig(model="m", output=str(tmp_path / "a.zarr"), reorder="none")
    rec = encode_layer("layers.0.proj", ql, cfg)
    out = tmp_path / "a.zarr"
    wr = ArtifactWriter(out, new_root_attrs("m", "0", cfg.to_dict(), {}))
    wr.write_layer(rec)
    wr.finalize({"layers": {rec.name: {}}, "dense": [], "tied": {}})
    back = Artifact(out).read_layer(rec.name)
    a, b = rec.arrays(), back.arrays()
    assert a.keys() == b.keys() and {"outlier_codes", "outlier_scales", "outlier_channels"} <= set(a)
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
    np.testing.assert_array_equal(back.outliers.perm, ql.outliers.perm)
    np.testing.assert_array_equal(ql.dequantize()[:, ql.outliers.channels], ql.outliers.dequantize())


def test_inspect_counts_side_bytes(outlier_artifact, run_cli):
    from unionsparse.compressor.artifact.store import Artifact

    r = run_cli("inspect", outlier_artifact, "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    art = Artifact(outlier_artifact)
    total = 0
    for row in data["layers"]:
        rec = art.read_layer(row["layer"])
        arrays = rec.arrays()
        real = sum(a.nbytes for a in arrays.values())
        side = sum(arrays[k].nbytes for k in ("outlier_codes", "outlier_scales", "outlier_channels"))
        m, k = row["shape"]
        assert row["total_bytes"] == real and row["outlier_bytes"] == side and row["outliers"] == N_OUT
        assert row["scale_bytes"] == arrays["scales"].nbytes + arrays["outlier_scales"].nbytes
        assert row["bits_per_weight"] == pytest.approx(real * 8 / (m * k))
        assert row["cr"] == pytest.approx(2 * m * k / real)
        total += real
    assert data["model"]["total_bytes"] == total
    assert art.attrs["summary"]["total_bytes"] == total


def test_eval_path_equals_independent_integer_computation(outlier_artifact):
    from unionsparse.compressor.artifact.store import Artifact
    from unionsparse.compressor.model.rebuild import rebuild_model
    from unionsparse.formats.arithmetic.linears import FakeQuantLinear

    art = Artifact(outlier_artifact)
    model = rebuild_model(outlier_artifact)
    rng = np.random.default_rng(1)
    for name in art.layer_names[:3] + art.layer_names[-1:]:
        rec = art.read_layer(name)
        layer = model.get_submodule(name)
        assert isinstance(layer, FakeQuantLinear) and layer.outliers is not None
        k = rec.encoding.shape[1]
        x = rng.standard_normal((24, k)).astype(np.float32)
        x[:, rec.outliers.channels[:4]] *= 40.0
        got = layer(torch.from_numpy(x)).detach().numpy()
        want = independent_output(x, rec.arrays(), rec.encoding.decode(), rec.attrs)
        want16 = want.astype(np.float16).astype(np.float32)
        assert (np.abs(got - want16) <= np.abs(want16) * 2.0**-10 + 2.0**-24).all(), name
        assert (got == want16).mean() > 0.95
    ids = torch.arange(32).reshape(1, 32)
    assert torch.isfinite(model(ids).logits).all()


def test_verify_passes_then_catches_side_corruption(outlier_artifact, tmp_path, run_cli):
    from unionsparse.compressor.artifact.store import Artifact, write_manifest

    r = run_cli("verify", outlier_artifact, "--backend", "cpu", "--n", "1,4")
    assert r.code == 0, r.out + r.err
    name = Artifact(outlier_artifact).layer_names[0]
    # a flipped byte in the side matrix's chunk: crc32c codec and manifest both catch it
    bad = tmp_path / "bad.zarr"
    shutil.copytree(outlier_artifact, bad)
    chunk = next(p for p in (bad / "layers" / name / "outlier_codes").rglob("*") if p.is_file() and
                 p.name != "zarr.json")
    raw = bytearray(chunk.read_bytes())
    raw[3] ^= 0x10
    chunk.write_bytes(bytes(raw))
    r = run_cli("verify", bad, "--backend", "cpu")
    assert r.code == 1 and name in r.out + r.err and "outlier_codes" in r.out + r.err
    # consistent checksums but a negative side scale: the range check catches it
    bad2 = tmp_path / "bad2.zarr"
    shutil.copytree(outlier_artifact, bad2)
    import zarr

    g = zarr.open_group(str(bad2 / "layers" / name), mode="r+")
    s = np.asarray(g["outlier_scales"][...])
    s[0, 0] = -s[0, 0]
    g["outlier_scales"][...] = s
    write_manifest(bad2)
    r = run_cli("verify", bad2, "--backend", "cpu")
    assert r.code == 1 and "outlier_scales are not all positive" in r.out + r.err


def test_outlier_check_catches_a_wrong_side_matrix():
    """The CPU reference check fails when the side codes do not belong to the layer (dense truth differs)."""
    from unionsparse.compressor.quantize.layer import QuantSpec, quantize_layer
    from unionsparse.formats import iebme
    from unionsparse.kernels.outlier_check import check_outlier_layer

    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 256, generator=g)
    ql = quantize_layer(w, QuantSpec.from_mode("w4a4", keep_outliers=8), x_sq_norm=torch.rand(256, generator=g))
    m = iebme.encode(ql.qweight.codes, 4, (16, 64), (2, 2), None)
    rng = np.random.default_rng(0)
    assert check_outlier_layer(m, ql.qweight.scales, 128, ql.activations, ql.outliers, [1, 8], "cpu", rng) == []


@pytest.mark.parametrize("flags, words", [
    (("--keep-outliers", "-1"), "non-negative"),
    (("--keep-outliers", "many"), "auto or a non-negative integer"),
    (("--keep-outliers", "16", "--quant", "w4a16"), "w4a4, w2a4, w4a8 or w2a8"),
    (("--keep-outliers", "16", "--format", "tiled-cbc"), "ie-bme"),
    (("--keep-outliers", "128"), "need N < K"),
])
def test_bad_keep_outliers_values(llama_with_tokenizer, tmp_path, run_cli, flags, words):
    model, calib = llama_with_tokenizer
    out = tmp_path / "x.zarr"
    base = ["compress", model, "-o", out, "--prune", "wanda", "--calib", calib, "--nsamples", "2", "--seqlen", "32"]
    r = run_cli(*base, *flags)
    assert r.code == 2, r.out + r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "--keep-outliers" in lines[0] and words in lines[0], r.err
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


@pytest.mark.gpu
def test_gpu_outlier_check(outlier_artifact):
    from unionsparse.kernels import available

    pytest.importorskip("cupy")
    if not available():
        pytest.skip("no CUDA device")
    from unionsparse.compressor.verify.checks import verify

    res = verify(str(outlier_artifact), backend="cupy", ns=[1, 8, 32])
    assert res.ok, res.failures
