"""compress --config: recipe files, flags over the file, unknown keys, reproducing an artifact."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import assert_same_artifacts
from unionsparse.compressor.artifact.store import Artifact


def only_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def same_arrays(a: str, b: str) -> None:
    x, y = Artifact(a), Artifact(b)
    assert x.layer_names == y.layer_names
    for name in x.layer_names:
        ra, rb = x.read_layer(name).arrays(), y.read_layer(name).arrays()
        assert ra.keys() == rb.keys()
        for k in ra:
            assert ra[k].dtype == rb[k].dtype and np.array_equal(ra[k], rb[k]), (name, k)


def test_yaml_recipe_sets_options_and_flags_override(tmp_path, model_dirs, run_cli):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(model_dirs["llama"]), "sparsity": 0.6, "quant": "w2a4",
                                      "group-size": 64, "tile": [16, 64], "reorder": "none"}))
    r = run_cli("compress", "--config", recipe, "-o", tmp_path / "a.zarr", "--sparsity", "0.7", "--quiet")
    assert r.code == 0, r.err
    cfg = Artifact(tmp_path / "a.zarr").attrs["config"]
    assert cfg["sparsity"] == 0.7  # the flag wins
    assert (cfg["quant"], cfg["group_size"], cfg["reorder"], cfg["tile"]) == ("w2a4", 64, "none", [16, 64])
    assert cfg["model"] == str(model_dirs["llama"])  # MODEL came from the file


def test_artifact_recipe_reproduces_it_byte_for_byte(tmp_path, model_dirs, run_cli):
    first = tmp_path / "first.zarr"
    r = run_cli("compress", model_dirs["qwen2"], "-o", first, "--quiet", "--sparsity", "0.6",
                "--reorder", "dp", "--group-size", "64", "--seed", "3")
    assert r.code == 0, r.err
    # 1) straight from the artifact
    r = run_cli("compress", "--config", first, "-o", tmp_path / "again.zarr", "--quiet")
    assert r.code == 0, r.err
    # 2) through the YAML that inspect --recipe prints
    r = run_cli("inspect", first, "--recipe")
    assert r.code == 0
    (tmp_path / "recipe.yaml").write_text(r.out)
    assert yaml.safe_load(r.out) == Artifact(first).attrs["config"]
    r = run_cli("compress", "--config", tmp_path / "recipe.yaml", "-o", tmp_path / "yaml.zarr", "--quiet")
    assert r.code == 0, r.err
    for other in ("again.zarr", "yaml.zarr"):
        assert Artifact(tmp_path / other).attrs["config"] == Artifact(first).attrs["config"]
        same_arrays(first, tmp_path / other)


@pytest.mark.parametrize("content, suffix, needle", [
    ("sparsity: 0.5\nsparsityy: 0.6\n", ".yaml", "'sparsityy'"),
    ('{"output": "x.zarr"}', ".json", "'output'"),
    ("sparsity: [0.5\n", ".yaml", "not valid YAML"),
    ("[1, 2]\n", ".yml", "mapping"),
    ("{bad json", ".json", "not valid JSON"),
    ("sparsity = 0.5\n", ".toml", "must be a .yaml"),
])
def test_bad_recipe_files_exit_2_naming_the_problem(tmp_path, model_dirs, run_cli, content, suffix, needle):
    f = tmp_path / f"r{suffix}"
    f.write_text(content)
    out = tmp_path / "x.zarr"
    r = run_cli("compress", model_dirs["llama"], "--config", f, "-o", out)
    assert r.code == 2
    line = only_line(r.err)
    assert "--config" in line and needle in line, line
    assert not out.exists() and not (tmp_path / "x.zarr.partial").exists()


def test_missing_recipe_and_bad_value_in_recipe(tmp_path, model_dirs, run_cli):
    r = run_cli("compress", model_dirs["llama"], "--config", tmp_path / "no.yaml", "-o", tmp_path / "x.zarr")
    assert r.code == 2 and "does not exist" in only_line(r.err)
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"sparsity": 1.5}))
    r = run_cli("compress", model_dirs["llama"], "--config", f, "-o", tmp_path / "x.zarr")
    assert r.code == 2 and "--sparsity" in only_line(r.err)


def test_recipe_keys_follow_the_compress_options():
    """Every key an artifact stores is accepted back (so a new compress option cannot break --config)."""
    from unionsparse.compressor.cli import cli
    from unionsparse.compressor.config import CompressConfig
    from unionsparse.compressor.recipe import option_keys

    keys = option_keys(cli.commands["compress"])
    stored = CompressConfig(model="m", output="o.zarr").to_dict()
    assert set(stored) <= set(keys), set(stored) - set(keys)
    assert "output" not in keys and "config" not in keys


def test_stored_recipe_lists_only_settings_the_run_used(tmp_path, model_dirs, llama_with_tokenizer, run_cli):
    """Calibration settings appear in the stored recipe only when the run calibrated (issue 27: a magnitude run
    listed c4 / 128 x 2048 tokens it never read); activation-sparsity settings only with a target."""
    out = tmp_path / "m.zarr"
    assert run_cli("compress", model_dirs["llama"], "-o", out, "--quiet", "--reorder", "none").code == 0
    cfg = Artifact(out).attrs["config"]
    assert not {"calib", "nsamples", "seqlen", "seed", "act_sparsity_profile", "act_sparsity_calib"} & set(cfg)
    model, calib = llama_with_tokenizer
    out = tmp_path / "w.zarr"
    r = run_cli("compress", model, "-o", out, "--quiet", "--reorder", "none", "--prune", "wanda", "--calib", calib,
                "--nsamples", "2", "--seqlen", "32")
    assert r.code == 0, r.err
    cfg = Artifact(out).attrs["config"]
    assert (cfg["nsamples"], cfg["seqlen"], cfg["calib"]) == (2, 32, str(calib))
    again = tmp_path / "again.zarr"  # the shorter recipe still rebuilds the same bytes
    assert run_cli("compress", model_dirs["llama"], "-o", again, "--config", tmp_path / "m.zarr", "--quiet").code == 0
    assert_same_artifacts(tmp_path / "m.zarr", again)
