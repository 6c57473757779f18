"""The defaults keep quality (issue 35, item 6): W4A4 / W2A4 (and W4A8 / W2A8) IE-BME keep Atom outlier channels
unless told otherwise (``--keep-outliers auto``: min(128, K // 4) per layer), chosen from calibration statistics
that the bundled English text (``--calib builtin``, the default) gives offline."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from unionsparse.compressor.config import CompressConfig

ENV = "UNIONSPARSE_COMPRESS_KEEP_OUTLIERS"  # conftest pins it to 0 for the rest of the suite


def cfg(**kw) -> CompressConfig:
    return CompressConfig(model="m", output="o.zarr", **kw)


@pytest.mark.parametrize("quant", ["w4a4", "w2a4", "w4a8", "w2a8"])
@pytest.mark.parametrize("k, expected", [(576, 128), (1536, 128), (256, 64), (128, 32), (8, 2), (3, 0)])
def test_default_keeps_outliers_for_ie_bme_with_quantized_activations(quant, k, expected):
    c = cfg(quant=quant, format="ie-bme")
    assert c.keep_outliers == "auto"
    assert c.validate_options().outliers_for(k) == expected
    assert c.uses_outliers and c.needs_calibration  # with the default --prune magnitude too


@pytest.mark.parametrize("quant, fmt", [("w4a16", "ie-bme"), ("none", "tiled-cbc"), ("w4a4", "tiled-cbc"),
                                        ("w2a4", "tiled-cbc"), ("w4a16", "tiled-cbc")])
def test_auto_is_zero_where_outliers_do_not_apply(quant, fmt):
    c = cfg(quant=quant, format=fmt).validate_options()
    assert c.outliers_for(576) == 0 and c.outliers_for(4096) == 0
    assert not c.uses_outliers and not c.needs_calibration  # magnitude pruning: no calibration pass


def test_explicit_counts_are_kept_as_given():
    assert cfg(keep_outliers=16).validate_options().outliers_for(576) == 16
    assert cfg(keep_outliers=0).validate_options().outliers_for(576) == 0
    assert not cfg(keep_outliers=0).needs_calibration
    assert cfg(keep_outliers="24").validate_options().keep_outliers == 24  # a recipe or an env var: text
    assert cfg(keep_outliers="AUTO").validate_options().keep_outliers == "auto"


def test_per_layer_override_into_ie_bme_w4a4_calibrates():
    """A run whose own options keep no outliers, with a layer override that does, collects the statistics."""
    c = cfg(quant="w4a16", layer_overrides=({"match": ".*down_proj", "quant": "w4a4"},))
    assert c.uses_outliers and c.needs_calibration
    assert not cfg(quant="w4a16", layer_overrides=({"match": ".*", "dense": True, "quant": "w4a4"},)).uses_outliers


def test_cli_and_config_defaults_agree():
    from unionsparse.compressor.cli import cli

    params = {p.name: p for p in cli.commands["compress"].params}
    assert params["keep_outliers"].default == CompressConfig.keep_outliers == "auto"
    assert params["calib"].default == CompressConfig.calib == "builtin"
    assert "auto" in params["keep_outliers"].help and "min(128" in params["keep_outliers"].help
    assert "builtin" in params["calib"].help


@pytest.mark.parametrize("flags, words", [
    (("--keep-outliers", "-3"), "auto or a non-negative integer"),
    (("--keep-outliers", "lots"), "auto or a non-negative integer"),
    (("--keep-outliers", "2.5"), "auto or a non-negative integer"),
    (("--keep-outliers", "16", "--quant", "w4a16"), "w4a8 or w2a8"),
    (("--keep-outliers", "16", "--quant", "none", "--format", "tiled-cbc"), "w4a8 or w2a8"),
    (("--keep-outliers", "16", "--format", "tiled-cbc"), "ie-bme"),
])
def test_bad_values_are_one_line_and_exit_2(flags, words, model_dirs, tmp_path, run_cli, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    out = tmp_path / "x.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, *flags)
    assert r.code == 2, r.out + r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "--keep-outliers" in lines[0] and words in lines[0], r.err
    assert not out.exists()


@pytest.mark.parametrize("flags", [("--keep-outliers", "auto", "--quant", "w4a16"),
                                   ("--keep-outliers", "auto", "--quant", "none", "--format", "tiled-cbc"),
                                   ("--quant", "w4a16")])
def test_auto_where_outliers_do_not_apply_is_accepted_and_needs_no_calibration(flags, model_dirs, tmp_path,
                                                                                run_cli, monkeypatch):
    """auto (given or the default) with W4A16 / fp16 Tiled-CBC: no outliers, no calibration (the tokenizer-less
    tiny model compresses), no error."""
    monkeypatch.delenv(ENV, raising=False)
    out = tmp_path / "x.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, "--quiet", "--reorder", "none", *flags)
    assert r.code == 0, r.err
    from unionsparse.compressor.artifact.store import Artifact

    art = Artifact(out)
    assert art.attrs["config"]["keep_outliers"] == "auto" and "calib" not in art.attrs["config"]
    assert not any("outlier_channels" in art.read_layer(n).arrays() for n in art.layer_names)


@pytest.fixture
def no_network(monkeypatch):
    """Any name lookup fails: the hub cannot be reached."""
    def refuse(*_a, **_k):
        raise OSError("network disabled by the test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)


def test_builtin_calibration_text_loads_offline(no_network, llama_with_tokenizer):
    from unionsparse.compressor.calibrate import samples

    docs = samples.load_documents("builtin")
    assert len(docs) >= 20 and sum(map(len, docs)) > 50_000
    assert not any(d.lstrip().startswith("#") or samples.DOCUMENT_SEPARATOR in d for d in docs)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_with_tokenizer[0])
    x, info = samples.load_calibration("builtin", tok, nsamples=3, seqlen=48, seed=0, return_info=True)
    assert tuple(x.shape) == (3, 48) and info["source"] == "builtin"
    with pytest.raises(Exception, match="--calib c4"):  # the hub sources still go to the hub
        samples.load_documents("c4")


def test_default_compress_writes_outlier_columns(no_network, llama_with_tokenizer, tmp_path, run_cli,
                                                 monkeypatch):
    """compress with the defaults (magnitude, W4A4, IE-BME, auto outliers, builtin text), offline: every layer
    carries min(128, K // 4) outlier channels, the recipe says auto and builtin, and verify accepts it."""
    monkeypatch.delenv(ENV, raising=False)
    model, _ = llama_with_tokenizer
    out = tmp_path / "d.zarr"
    r = run_cli("compress", model, "-o", out, "--quiet", "--nsamples", "2", "--seqlen", "32", "--reorder", "none")
    assert r.code == 0, r.err
    from unionsparse.compressor.artifact.store import Artifact

    art = Artifact(out)
    recipe = art.attrs["config"]
    assert recipe["keep_outliers"] == "auto" and recipe["calib"] == "builtin" and recipe["prune"] == "magnitude"
    assert art.layer_names
    for name in art.layer_names:
        arrays = art.read_layer(name).arrays()
        k = art.attrs["layers"][name]["shape"][1]
        assert "outlier_channels" in arrays, name
        ch = arrays["outlier_channels"]
        assert ch.size == min(128, k // 4) and np.all(np.diff(ch) > 0) and ch.max() < k, name
    v = run_cli("verify", out, "--n", "1", "--backend", "cpu", "--quiet")
    assert v.code == 0, v.out + v.err


def test_a_model_without_tokenizer_says_how_to_skip_outliers(model_dirs, tmp_path, run_cli, monkeypatch):
    """The default calibrates for outlier channels; a model it cannot tokenize for gets one line that names the
    way out (--keep-outliers 0), and nothing is written."""
    monkeypatch.delenv(ENV, raising=False)
    out = tmp_path / "x.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, "--nsamples", "2", "--seqlen", "32")
    assert r.code == 2, r.out + r.err
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "tokenizer" in lines[0] and "--keep-outliers 0" in lines[0], r.err
    assert not out.exists() and not list(tmp_path.glob("*.partial"))
