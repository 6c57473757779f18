"""Per-layer recipe rules (issue 31 item 3): targets / ignore / overrides, validated before any work, stored in the
artifact, honoured by every later command; and the activation-sparsity flags' old names still work."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import assert_same_artifacts
from safetensors.torch import load_file

FAST = ("--quiet", "--reorder", "none")
RECIPE = """\
prune: magnitude
sparsity: 0.5
quant: w4a4
format: ie-bme
reorder: none
ignore: ['.*\\.mlp\\.down_proj']
layer_overrides:
  - match: 'model\\.layers\\.0\\..*'
    sparsity: 0.25
    quant: w4a16
  - match: '.*v_proj'
    format: tiled-cbc
    quant: w4a16
"""


@pytest.fixture(scope="module")
def ruled(tmp_path_factory, model_dirs):
    from unionsparse.compressor.cli import main

    root = tmp_path_factory.mktemp("rules")
    (root / "recipe.yaml").write_text(RECIPE)
    out = root / "r.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(model_dirs["llama"]), "-o", str(out), "--config", str(root / "recipe.yaml"), "--quiet"])
    assert e.value.code == 0
    return out


def test_rules_shape_every_layer(ruled, model_dirs):
    from unionsparse.compressor.artifact.store import Artifact

    art = Artifact(ruled)
    names = art.layer_names
    assert not [n for n in names if n.endswith("down_proj")]  # ignored: not compressed...
    weights = load_file(model_dirs["llama"] / "model.safetensors")
    for i in range(2):
        name = f"model.layers.{i}.mlp.down_proj.weight"  # ...but kept whole in dense/
        assert name in art.dense_names
        assert np.array_equal(art.read_dense(name), weights[name].half().numpy())
    for n in names:
        a = art.layer_attrs(n)
        block0 = n.startswith("model.layers.0.")
        want_format = "tiled-cbc" if n.endswith("v_proj") else "ie-bme"
        want_quant = "w4a16" if block0 or n.endswith("v_proj") else "w4a4"
        assert (a["format"], a["quant"]) == (want_format, want_quant), n
        assert ("activations" in a and a["activations"]["bits"] == 4) == (want_quant == "w4a4"), n
        codes = art.read_layer(n).encoding.decode()
        pruned = 1 - np.count_nonzero(weights[f"{n}.weight"].numpy() * (codes != 0)) / codes.size
        assert pruned == pytest.approx(0.25 if block0 else 0.5, abs=0.03), n  # per-layer sparsity
        if block0 or n.endswith("v_proj"):
            assert a["overrides"], n
    differs = {n for n in names if n.startswith("model.layers.0.") or n.endswith("v_proj")}
    dense = {f"model.layers.{i}.mlp.down_proj" for i in range(2)}
    rules = art.attrs["layer_rules"]  # what inspect shows: every layer whose options differ from the run's
    assert set(rules) == differs | dense and all(rules[n] == {"dense": True} for n in dense)
    summary = art.attrs["summary"]
    assert summary["dense_linears"] == 2  # counted at 16 bits in the model's figures


def test_rules_survive_verify_recipe_and_rebuild(ruled, tmp_path, run_cli, model_dirs):
    r = run_cli("verify", ruled, "--n", "1", "--backend", "cpu")
    assert r.code == 0, r.out + r.err
    recipe = run_cli("inspect", ruled, "--recipe")
    assert "layer_overrides" in recipe.out and "ignore" in recipe.out
    again = tmp_path / "again.zarr"  # the stored recipe rebuilds the same bytes
    r = run_cli("compress", model_dirs["llama"], "-o", again, "--config", ruled, "--quiet")
    assert r.code == 0, r.err
    assert_same_artifacts(ruled, again)

    from unionsparse.compressor.model.rebuild import rebuild_model

    model = rebuild_model(ruled)
    w = load_file(model_dirs["llama"] / "model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(model.model.layers[1].mlp.down_proj, torch.nn.Linear)
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight.float(), w.half().float())


@pytest.mark.parametrize("flags, named", [
    (("--ignore", "nothing\\..*"), "matches no decoder linear"),
    (("--targets", "("), "not a regular expression"),
    (("--layer-overrides", '[{"match": ".*q_proj", "bits": 3}]'), "cannot be set per layer"),
    (("--layer-overrides", '[{"match": ".*q_proj"}]'), "sets no option"),
    (("--layer-overrides", '{"match": ".*"}'), "a list of mappings"),
    (("--layer-overrides", '[{"match": ".*q_proj", "quant": "none"}]'), "layer model.layers.0.self_attn.q_proj"),
    (("--layer-overrides", '[{"match": ".*", "dense": true}]'), "leave no decoder linear"),
    (("--targets", ".*q_proj", "--ignore", ".*q_proj"), "leave no decoder linear"),
])
def test_bad_rules_are_one_line_before_any_work(flags, named, tmp_path, model_dirs, run_cli):
    out = tmp_path / "bad.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, *FAST, *flags)
    lines = r.err.strip().splitlines()
    assert r.code == 2 and len(lines) == 1 and named in lines[0] and "Traceback" not in r.err, r.err
    assert not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_targets_compress_only_what_they_match(tmp_path, model_dirs, run_cli):
    out = tmp_path / "t.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, *FAST, "--targets", ".*mlp\\..*", "--json")
    assert r.code == 0, r.err
    from unionsparse.compressor.artifact.store import Artifact

    art = Artifact(out)
    assert art.layer_names and all(".mlp." in n for n in art.layer_names)
    assert "model.layers.0.self_attn.q_proj.weight" in art.dense_names
    assert json.loads(r.out)["dense_linears"] == 8  # q, k, v, o of two blocks


def test_old_activation_sparsity_names_still_work(tmp_path, model_dirs, run_cli, monkeypatch):
    """--dp-sparsity (flag), UNIONSPARSE_COMPRESS_DP_SPARSITY (env) and dp_sparsity (recipe key) all set the
    activation-sparsity target, as --act-sparsity does."""
    base = ("--quiet", "--format", "tiled-cbc", "--quant", "none", "--nsamples", "2", "--seqlen", "32",
            "--act-sparsity-profile", "greedy")
    for how in ("flag", "env", "recipe"):
        out = tmp_path / f"{how}.zarr"
        extra: tuple = ()
        if how == "flag":
            extra = ("--dp-sparsity", "1.5")
        elif how == "env":
            monkeypatch.setenv("UNIONSPARSE_COMPRESS_DP_SPARSITY", "1.5")
        else:
            (tmp_path / "r.yaml").write_text("dp_sparsity: 1.5\n")
            extra = ("--config", tmp_path / "r.yaml")
        r = run_cli("compress", model_dirs["llama"], "-o", out, *base, *extra)
        assert r.code == 2 and "--act-sparsity must lie in [0, 1), got 1.5" in r.err, (how, r.err)
        monkeypatch.delenv("UNIONSPARSE_COMPRESS_DP_SPARSITY", raising=False)
