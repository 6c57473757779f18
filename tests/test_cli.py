"""compress / inspect / verify end to end on tiny real models, bad input, corruption."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from unionsparse.compressor.artifact.store import Artifact, write_manifest
from unionsparse.compressor.pruning.methods import magnitude
from unionsparse.formats.arithmetic.weights import rtn


def only_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line, got: {text!r}"
    assert "Traceback" not in text
    return lines[0]


@pytest.fixture(scope="module")
def llama_artifact(tmp_path_factory, model_dirs):
    from unionsparse.compressor.cli import main

    out = tmp_path_factory.mktemp("art") / "llama.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(model_dirs["llama"]), "-o", str(out), "--quiet", "--sparsity", "0.5",
              "--quant", "w4a4", "--format", "ie-bme", "--reorder", "dp"])
    assert e.value.code == 0
    return out


def test_compress_iebme_codes_match_independent_prune_and_quant(llama_artifact, model_dirs):
    art = Artifact(llama_artifact)
    weights = load_file(str(model_dirs["llama"] / "model.safetensors"))
    names = art.layer_names
    assert len(names) == 2 * 7  # q k v o gate up down per block
    for name in names:
        w = weights[f"{name}.weight"].float()
        mask = magnitude(w, 0.5)
        assert (mask.sum(dim=1) == w.shape[1] - int(w.shape[1] * 0.5)).all()
        q = rtn(w * mask, 4, 128)
        rec = art.read_layer(name)
        assert np.array_equal(rec.encoding.decode(), q.codes), name
        assert np.array_equal(rec.scales, q.scales)
        assert rec.encoding.perm is not None
        assert rec.attrs["reorder"]["union_positions_after"] <= rec.attrs["reorder"]["union_positions_before"]
    # everything else is in dense/, so the model can be rebuilt
    dense = set(art.dense_names) | set(art.attrs["tied"])
    for key in weights:
        if not any(key == f"{n}.weight" for n in names):
            assert key in dense, key


def test_inspect_json_totals(llama_artifact, run_cli):
    r = run_cli("inspect", llama_artifact, "--json", "--compare")
    assert r.code == 0
    data = json.loads(r.out)
    layers = data["layers"]
    total = sum(x["total_bytes"] for x in layers)
    weights = sum(x["shape"][0] * x["shape"][1] for x in layers)
    assert data["model"]["total_bytes"] == total
    assert data["model"]["bits_per_weight"] == pytest.approx(8 * total / weights)
    assert data["model"]["cr"] == pytest.approx(2 * weights / total)
    for b in ("dense-fp16", "dense-4bit", "csr", "tiled-csl", "tca-bme"):
        assert b in data["model_baselines"]
    assert data["model_baselines"]["dense-fp16"]["total_bytes"] == 2 * weights
    assert data["model"]["union_density_after_reorder"] <= data["model"]["union_density_before_reorder"]
    r = run_cli("inspect", llama_artifact)
    assert r.code == 0 and "model" in r.out and "pmr" in r.out


def test_verify_ok(llama_artifact, run_cli):
    r = run_cli("verify", llama_artifact, "--n", "1,4", "--backend", "cpu")
    assert r.code == 0, r.out + r.err
    assert "OK" in r.out


@pytest.mark.parametrize("arch", ["opt", "qwen2"])
@pytest.mark.parametrize("quant", ["none", "w4a16"])
def test_tiled_cbc_other_architectures(tmp_path, model_dirs, run_cli, arch, quant):
    out = tmp_path / f"{arch}.zarr"
    r = run_cli("compress", model_dirs[arch], "-o", out, "--format", "tiled-cbc", "--quant", quant, "--quiet")
    assert r.code == 0, r.err
    art = Artifact(out)
    sd = load_file(str(model_dirs[arch] / "model.safetensors"))
    name = art.layer_names[0]
    rec = art.read_layer(name)
    w = sd[f"{name}.weight"].float()
    pruned = w * magnitude(w, 0.5)
    if quant == "none":
        assert np.array_equal(rec.encoding.decode(), pruned.half().numpy())
    else:
        assert np.array_equal(rec.encoding.decode(), rtn(pruned, 4, 128).codes)
    if arch == "opt" or arch == "qwen2":  # biases are dense tensors
        assert any(n.endswith("bias") for n in art.dense_names)
    assert run_cli("verify", out, "--n", "1,3").code == 0


def test_compress_notes_a_format_no_gpu_kernel_runs(tmp_path, model_dirs, run_cli):
    """Tiled-CBC with quantized activations is accepted (the CPU runs it) but no GPU kernel takes it and it keeps no
    outlier channels: compress says so in one note and gives the settings a GPU runs; none for those."""
    model = model_dirs["llama"]
    r = run_cli("compress", model, "-o", tmp_path / "a.zarr", "--format", "tiled-cbc", "--quant", "w4a4")
    assert r.code == 0, r.err
    notes = [ln for ln in r.err.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and "no GPU kernel of tiled-cbc" in notes[0] and "noise" in notes[0], r.err
    assert "--quant w4a16" in notes[0]
    r = run_cli("compress", model, "-o", tmp_path / "b.zarr", "--format", "tiled-cbc", "--quant", "w4a8", "--json")
    assert r.code == 0, r.err
    (note,) = json.loads(r.out)["notes"]
    assert "no GPU kernel" in note and "noise" not in note  # 8-bit activations keep quality
    for args in (("--format", "tiled-cbc", "--quant", "w4a16"), ("--format", "ie-bme", "--quant", "w4a4")):
        r = run_cli("compress", model, "-o", tmp_path / f"{args[1]}-{args[3]}.zarr", *args)
        assert r.code == 0 and "note:" not in r.err, (args, r.err)


def test_resume_continues_and_matches(tmp_path, model_dirs, run_cli):
    """A partial store (as left by a crash) is continued; the result equals an uninterrupted run."""
    full = tmp_path / "full.zarr"
    assert run_cli("compress", model_dirs["llama"], "-o", full, "--quiet", "--reorder", "none").code == 0
    out = tmp_path / "res.zarr"
    partial = tmp_path / "res.zarr.partial"
    shutil.copytree(full, partial)
    import zarr

    root = zarr.open_group(str(partial), mode="r+")
    root.attrs["complete"] = False
    layers = sorted(root["layers"].group_keys())
    for name in layers[5:]:
        shutil.rmtree(partial / "layers" / name)
    root["layers"][layers[4]].attrs["complete"] = False  # half-written layer: must be redone
    r = run_cli("compress", model_dirs["llama"], "-o", out, "--quiet", "--reorder", "none", "--resume")
    assert r.code == 0, r.err
    a, b = Artifact(full), Artifact(out)
    assert a.layer_names == b.layer_names
    for name in a.layer_names:
        ra, rb = a.read_layer(name).arrays(), b.read_layer(name).arrays()
        assert ra.keys() == rb.keys()
        for k in ra:
            assert np.array_equal(ra[k], rb[k]), (name, k)


def test_flipped_bytes_fail_verify(llama_artifact, tmp_path, run_cli):
    rnd = random.Random(0)
    files = [p.relative_to(llama_artifact) for p in llama_artifact.rglob("*") if p.is_file()]
    for i in range(6):
        d = tmp_path / f"flip{i}.zarr"
        shutil.copytree(llama_artifact, d)
        f = d / rnd.choice(files)
        b = bytearray(f.read_bytes())
        j = rnd.randrange(len(b))
        b[j] ^= 1 << rnd.randrange(8)
        f.write_bytes(b)
        r = run_cli("verify", d, "--n", "1", "--quiet")
        assert r.code == 1, (f, r.out, r.err)
        assert "Traceback" not in r.out + r.err


# ------------------------------------------------------------------------------------------ bad input


def bad_cases(model: Path, tmp: Path, artifact: Path) -> list[tuple[list, str]]:
    no_config = tmp / "empty_model"
    no_config.mkdir()
    broken = tmp / "broken_model"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    newer = tmp / "newer.zarr"
    shutil.copytree(artifact, newer)
    meta = json.loads((newer / "zarr.json").read_text())
    meta["attributes"]["format_version"] = 99
    (newer / "zarr.json").write_text(json.dumps(meta))
    write_manifest(newer)  # a consistent store from a newer writer, not a corrupted one
    notart = tmp / "plain"
    notart.mkdir()
    linky = tmp / "linky"  # any folder a user may name, a link inside: not an artifact, said before any scan
    linky.mkdir()
    (linky / "elsewhere").symlink_to(tmp)
    badgguf = tmp / "bad.gguf"
    badgguf.write_bytes(b"NOTG" + b"\0" * 100)
    o = str(tmp / "o.zarr")
    return [
        (["compress", tmp / "missing", "-o", o], "MODEL"),
        (["compress", no_config, "-o", o], "config.json"),
        (["compress", broken, "-o", o], "safetensors header"),
        (["compress", badgguf, "-o", o], "GGUF"),
        (["compress", model, "-o", o, "--sparsity", "1.0"], "--sparsity"),
        (["compress", model, "-o", o, "--sparsity", "-0.1"], "--sparsity"),
        (["compress", model, "-o", o, "--format", "csr"], "--format"),
        (["compress", model, "-o", o, "--quant", "w3a3"], "--quant"),
        (["compress", model, "-o", o, "--areas", "3x2"], "--areas"),
        (["compress", model, "-o", o, "--tile", "16x96"], "--group-size"),
        (["compress", model, "-o", o, "--tile", "16by64"], "--tile"),
        (["compress", model, "-o", o, "--quant", "none"], "--quant none"),
        (["compress", model, "-o", o, "--group-size", "0"], "--group-size"),
        (["compress", model, "-o", o, "--prune", "wanda", "--calib", str(tmp / "nope.jsonl")], "--calib"),
        (["compress", model, "-o", o, "--sparsity", "abc"], "sparsity"),
        (["compress", model, "-o", str(artifact)], "already exists"),
        (["inspect", tmp / "nothing.zarr"], "no such artifact"),
        (["inspect", notart], "not a unionsparse artifact"),
        (["generate", linky, "--prompt", "hi"], "not a unionsparse artifact"),
        (["export", linky, "-o", tmp / "exported"], "not a unionsparse artifact"),
        (["inspect", newer], "format_version"),
        (["verify", newer], "format_version"),
        (["verify", artifact, "--n", "0"], "--n"),
        (["verify", artifact, "--backend", "tpu"], "--backend"),
        (["inspect", artifact, "--layer", "model.nope"], "--layer"),
    ]


def test_bad_input_one_line_exit_2(tmp_path, model_dirs, llama_artifact, run_cli):
    for args, needle in bad_cases(model_dirs["llama"], tmp_path, llama_artifact):
        r = run_cli(*args)
        assert r.code == 2, (args, r.code, r.out, r.err)
        line = only_line(r.err)
        assert needle in line, (args, line)
        assert not (tmp_path / "o.zarr").exists() and not (tmp_path / "o.zarr.partial").exists(), args


def test_choices_live_in_one_place_and_are_checked_once(tmp_path, model_dirs, llama_artifact, run_cli, monkeypatch):
    """compress: each option with choices lists its configuration field's choices and leaves the check to the
    configuration, which a run validates once; every command: a bad choice is one line naming the option, exit 2."""
    import dataclasses

    from unionsparse.compressor import cli, config
    from unionsparse.compressor.errors import UserError
    from unionsparse.compressor.pipeline import compress as pipeline

    fields = {f.name: f.metadata["cli"] for f in dataclasses.fields(config.CompressConfig) if f.metadata.get("cli")}
    params = {p.name: p for p in cli.compress.params}
    with_choices = [name for name, meta in fields.items() if meta["choices"]]
    assert {"prune", "quant", "format", "reorder", "device", "sparsity_profile"} <= set(with_choices)
    for name in with_choices:
        meta = fields[name]
        choices = meta["choices"]() if callable(meta["choices"]) else meta["choices"]
        assert params[name].type.choices == tuple(choices), name
        assert params[name].type.convert("bogus", params[name], None) == "bogus", name  # shown, not checked...
        with pytest.raises(UserError, match=re.escape(f"{'/'.join(meta['flags'])}: unknown value 'bogus'")):
            config.CompressConfig(model="m", output="o", **{name: "bogus"}).validate_options()  # ...but here
    model, o = model_dirs["llama"], tmp_path / "o.zarr"
    for args, flag in ((["compress", model, "-o", o, "--reorder", "greedy"], "--reorder"),
                       (["compress", model, "-o", o, "--dp-profile", "greedyish"], "--act-sparsity-profile"),
                       (["bench", "--format", "csr"], "--format"), (["bench", "--shapes", "all"], "--shapes"),
                       (["export", llama_artifact, "-o", o, "--to", "onnx"], "--to"),
                       (["generate", llama_artifact, "--device", "tpu"], "--device")):
        r = run_cli(*args)
        assert r.code == 2 and flag in only_line(r.err), (args, r.err)
    validated = []
    real = config.CompressConfig.validate
    monkeypatch.setattr(config.CompressConfig, "validate", lambda self: validated.append(1) or real(self))

    def stop(*_a, **_k):
        raise UserError("stopped after validation")

    monkeypatch.setattr(pipeline, "_compress", stop)
    r = run_cli("compress", model, "-o", o, "--quiet")
    assert r.code == 2 and "stopped after validation" in only_line(r.err) and validated == [1]


def test_nan_weights_rejected_and_nothing_left(tmp_path, model_dirs, run_cli):
    bad = tmp_path / "nan_model"
    shutil.copytree(model_dirs["llama"], bad)
    sd = load_file(str(bad / "model.safetensors"))
    key = "model.layers.1.mlp.up_proj.weight"
    sd[key] = sd[key].clone()
    sd[key][3, 5] = float("nan")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in sd.items()}, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "nan.zarr"
    r = run_cli("compress", bad, "-o", out, "--quiet", "--reorder", "none")
    assert r.code == 2
    assert "NaN" in only_line(r.err) and "up_proj" in r.err
    assert not out.exists() and not Path(str(out) + ".partial").exists()


def test_version_and_help(run_cli):
    r = run_cli("--version")
    assert r.code == 0 and "unionsparse" in r.out
    assert run_cli("compress", "--help").code == 0


def test_tensor_equality_helper_sanity():
    # guards the helpers above: magnitude keeps the largest |w| per row
    w = torch.tensor([[1.0, -3.0, 2.0, 0.5]])
    assert magnitude(w, 0.5).tolist() == [[False, True, True, False]]
