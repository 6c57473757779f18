"""`unionsparse export`: Hugging Face folders and compressed-tensors checkpoints of tiny artifacts, loaded back
with transformers and compressed-tensors and compared with `eval`'s arithmetic; output-folder safety."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from unionsparse.compressor.artifact.store import Artifact
from unionsparse.compressor.model.rebuild import rebuild_model
from unionsparse.compressor.pruning import magnitude
from unionsparse.formats.arithmetic.weights import dequantize

pytest.importorskip("compressed_tensors")

N_OUT = 16
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def one_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def compress(root: Path, name: str, model: Path, *flags: str) -> Path:
    from unionsparse.compressor.cli import main

    out = root / f"{name}.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(model), "-o", str(out), "--quiet", *flags])
    assert e.value.code == 0
    return out


@pytest.fixture(scope="module")
def source(llama_with_tokenizer, tmp_path_factory) -> Path:
    """The tiny LLaMA with a tokenizer and a generation config of its own (sampling defaults)."""
    src = tmp_path_factory.mktemp("export_src") / "llama"
    shutil.copytree(llama_with_tokenizer[0], src)
    gen = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "temperature": 0.7}))
    return src


@pytest.fixture(scope="module")
def arts(source, llama_with_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """Artifacts of `source`: W2A4 IE-BME reordered, W4A16 Tiled-CBC, fp16 Tiled-CBC with dynamic-sparsity
    thresholds, W4A4 IE-BME with outlier channels."""
    model, calib = source, llama_with_tokenizer[1]
    root = tmp_path_factory.mktemp("export_arts")
    cal = ("--calib", str(calib), "--nsamples", "4", "--seqlen", "64")
    return {
        "w2": compress(root, "w2", model, "--prune", "magnitude", "--quant", "w2a4", "--group-size", "64",
                       "--format", "ie-bme", "--reorder", "dp"),
        "w4cbc": compress(root, "w4cbc", model, "--prune", "magnitude", "--quant", "w4a16", "--format", "tiled-cbc"),
        # group 192: K=128 layers get one scale per row (clamped), K=256 layers a ragged last group
        "g192": compress(root, "g192", model, "--prune", "magnitude", "--quant", "w4a16", "--format", "tiled-cbc",
                         "--group-size", "192"),
        "fp16": compress(root, "fp16", model, "--prune", "magnitude", "--quant", "none", "--format", "tiled-cbc",
                         "--dp-sparsity", "0.3", "--dp-calib", str(calib), "--nsamples", "4", "--seqlen", "64"),
        "outliers": compress(root, "outliers", model, "--prune", "wanda", *cal, "--quant", "w4a4",
                             "--keep-outliers", str(N_OUT), "--reorder", "none"),
    }


def load_hf(folder: Path):
    return AutoModelForCausalLM.from_pretrained(str(folder)).eval()  # no trust_remote_code: plain transformers


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits.float()


def assert_matches_eval(loaded, art_path: Path) -> None:
    """Every compressed layer holds eval's weight rounded to fp16; logits agree with eval to fp16 tolerance."""
    ref = rebuild_model(art_path, act_quant=False)  # `eval`'s arithmetic without activation quantization
    ours = dict(loaded.named_parameters())
    for name in Artifact(art_path).layer_names:
        w = ours[f"{name}.weight"]
        assert w.dtype == torch.float16
        assert torch.equal(w, ref.get_submodule(name).weight.detach().half()), name
    torch.testing.assert_close(logits(loaded), logits(ref), rtol=0, atol=1e-2)


def packed_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """pack-quantized written out independently: code + 2^(b-1) in b bits, element j of a word at bit b*j."""
    per = 32 // bits
    m, k = codes.shape
    u = np.zeros((m, -(-k // per) * per), np.uint32)
    u[:, :k] = (codes.astype(np.int32) + (1 << (bits - 1))).astype(np.uint32)
    u = u.reshape(m, -1, per)
    return sum(u[:, :, j] << np.uint32(bits * j) for j in range(per)).astype(np.uint32)


def saved(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# ---------------------------------------------------------------------------------------------- hf


@pytest.mark.parametrize("kind", ["w2", "fp16", "outliers"])
def test_hf_export_loads_and_matches_eval(arts, kind, tmp_path, run_cli, source):
    out = tmp_path / "hf"
    r = run_cli("export", arts[kind], "-o", out, "--to", "hf")
    assert r.code == 0, r.err
    loaded = load_hf(out)
    assert loaded.dtype == torch.float16
    assert_matches_eval(loaded, arts[kind])
    art = Artifact(arts[kind])
    for name in art.layer_names:  # exact zeros exactly where the artifact has zero codes / values
        rec = art.read_layer(name)
        dec = np.asarray(rec.encoding.decode())
        w = loaded.get_submodule(name).weight.detach().numpy()
        if rec.outliers is not None:  # main part in permuted column order; the 8-bit side fills the rest
            k, n = w.shape[1], rec.outliers.channels.size
            w, dec = w[:, rec.outliers.perm[: k - n]], dec[:, : k - n]
        assert np.array_equal(w == 0, dec == 0), name
    # tokenizer and generation config of the source model came along
    assert AutoTokenizer.from_pretrained(str(out))("sparse kernel")["input_ids"] == \
        AutoTokenizer.from_pretrained(str(source))("sparse kernel")["input_ids"]
    assert (out / "generation_config.json").read_bytes() == (source / "generation_config.json").read_bytes()
    assert GenerationConfig.from_pretrained(str(out)).temperature == 0.7
    meta = json.loads((out / "unionsparse.json").read_text())
    assert meta["target"] == "hf" and meta["complete"] and set(meta["files"]) | {"unionsparse.json"} == \
        {p.name for p in out.iterdir()}
    notes = [ln for ln in r.err.splitlines() if ln.startswith("note: not expressed")]
    assert len(notes) == len(meta["not_expressed"])
    want = {"w2": "activation quantization", "fp16": "dynamic-sparsity thresholds", "outliers": "activation"}[kind]
    assert any(want in n for n in notes), r.err


def test_hf_zeros_are_the_pruned_weights(arts, tmp_path, run_cli, source):
    """Independent of the artifact: magnitude pruning of the source weights gives the exported zeros."""
    out = tmp_path / "hf"
    assert run_cli("export", arts["fp16"], "-o", out).code == 0
    orig, got = load_file(str(source / "model.safetensors")), saved(out)
    for name in Artifact(arts["fp16"]).layer_names:
        keep = magnitude(orig[f"{name}.weight"].float(), 0.5).numpy()
        w = got[f"{name}.weight"]
        assert not w[~torch.from_numpy(keep)].any(), name
        assert torch.equal(w[torch.from_numpy(keep)], orig[f"{name}.weight"].half()[torch.from_numpy(keep)]), name


def test_hf_sharded_with_index(arts, tmp_path, run_cli):
    out = tmp_path / "hf"
    r = run_cli("export", arts["w2"], "-o", out, "--max-shard-size", "200KB", "--json")
    assert r.code == 0, r.err
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("model-*.safetensors")}
    assert json.loads(r.out)["files"] == json.loads((out / "unionsparse.json").read_text())["files"]
    assert_matches_eval(load_hf(out), arts["w2"])


def test_source_quantization_config_is_not_exported(arts, tmp_path, run_cli, monkeypatch):
    """A GGUF source's model config holds quantization_config {quant_method: gguf}: the decoded folder must not."""
    init = Artifact.__init__

    def gguf_source(self, path, *args, **kwargs):
        init(self, path, *args, **kwargs)
        gguf = {"quant_method": "gguf", "gguf_file": "m.gguf", "dequantize": False}
        self.attrs["model_config"] = {**self.attrs["model_config"], "quantization_config": gguf}

    monkeypatch.setattr(Artifact, "__init__", gguf_source)
    for target, want in (("hf", None), ("compressed-tensors", "compressed-tensors")):
        out = tmp_path / target
        assert run_cli("export", arts["w2"], "-o", out, "--to", target).code == 0
        qc = json.loads((out / "config.json").read_text()).get("quantization_config")
        assert (qc and qc["quant_method"]) == want


def test_stored_tokenizer_is_exported_byte_for_byte(arts, tmp_path):
    """An artifact holding its tokenizer exports exactly those files, whatever its source model says."""
    from unionsparse.compressor.artifact.tokenizer import has_tokenizer, stored_files
    from unionsparse.compressor.export import export_hf

    art = Artifact(arts["w2"])
    assert has_tokenizer(art)
    art.attrs["source"] = {"model": "HuggingFaceTB/SmolLM2-135M"}  # never consulted
    res = export_hf(art, tmp_path / "hf")
    assert not any("tokenizer" in n for n in res.notes)
    for name, data in stored_files(art).items():
        assert (tmp_path / "hf" / name).read_bytes() == data, name


def old_artifact(art: Artifact, monkeypatch) -> Artifact:
    """``art`` as an artifact written before compress stored the tokenizer."""
    from unionsparse.compressor.artifact import tokenizer

    monkeypatch.setattr(tokenizer, "has_tokenizer", lambda _art: False)
    return art


def test_tokenizer_from_a_changed_source_is_flagged(arts, source, tmp_path, monkeypatch):
    from unionsparse.compressor.export import export_hf

    art = old_artifact(Artifact(arts["w2"]), monkeypatch)
    assert not any("differ" in n for n in export_hf(art, tmp_path / "a").notes)  # the fingerprint compress stored
    art.attrs["source"] = {**art.attrs["source"], "fingerprint": "0" * 64}
    res = export_hf(art, tmp_path / "b")
    assert (tmp_path / "b" / "tokenizer.json").is_file() and any("differ from those compressed" in n
                                                                  for n in res.notes)


def test_tokenizer_never_downloaded(arts, tmp_path, monkeypatch):
    """A hub id as source gives a note and a folder without tokenizer, and no connection is attempted."""
    from unionsparse.compressor.export import export_hf

    def no_network(*args, **kwargs):
        raise AssertionError("export tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    art = old_artifact(Artifact(arts["w2"]), monkeypatch)
    art.attrs["source"] = {"model": "HuggingFaceTB/SmolLM2-135M"}
    res = export_hf(art, tmp_path / "hf")
    assert any("tokenizer: not copied" in n and "never downloads" in n for n in res.notes)
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    assert (tmp_path / "hf" / "config.json").is_file()


# -------------------------------------------------------------------------------- compressed-tensors


def assert_packed(out: Path, art: Artifact, names: list[str], grp: dict) -> None:
    """Each layer's packed words, scales and shape are the artifact's, bit for bit; compressed-tensors unpacks and
    decompresses them to the artifact's codes and fp16 dequantized weights."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(grp)
    bits = scheme.weights.num_bits
    t = saved(out)
    for name in names:
        rec = art.read_layer(name)
        codes = rec.encoding.decode()  # original row order
        packed, scale, shape = (t[f"{name}.weight_{k}"] for k in ("packed", "scale", "shape"))
        assert f"{name}.weight" not in t
        assert packed.dtype == torch.int32 and shape.tolist() == list(codes.shape)
        assert np.array_equal(packed.numpy().view(np.uint32), packed_words(codes, bits)), name  # layout, by hand
        assert np.array_equal(unpack_from_int32(packed, bits, torch.Size(codes.shape)).numpy(), codes), name
        assert scale.dtype == torch.float16
        assert np.array_equal(scale.numpy().view(np.uint16), rec.scales.view(np.uint16)), name
        w = PackedQuantizationCompressor.decompress({"weight_packed": packed, "weight_scale": scale,
                                                     "weight_shape": shape}, scheme)["weight"]
        assert torch.equal(w, torch.from_numpy(dequantize(codes, rec.scales, rec.attrs["group_size"])).half()), name


def assert_loads_like_eval(out: Path, art_path: Path) -> None:
    """transformers loads the checkpoint through compressed-tensors (decompressing on the first forward)."""
    loaded = load_hf(out)
    ref = rebuild_model(art_path, act_quant=False)
    torch.testing.assert_close(logits(loaded), logits(ref), rtol=0, atol=1e-2)
    for name in Artifact(art_path).layer_names:
        assert torch.equal(loaded.get_submodule(name).weight.detach(), ref.get_submodule(name).weight.detach().half())


@pytest.mark.parametrize("kind,bits,group", [("w2", 2, 64), ("w4cbc", 4, 128)])
def test_compressed_tensors_round_trip(arts, kind, bits, group, tmp_path, run_cli):
    out = tmp_path / "ct"
    r = run_cli("export", arts[kind], "-o", out, "--to", "compressed-tensors")
    assert r.code == 0, r.err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    (grp,) = qc["config_groups"].values()
    assert grp["targets"] == ["Linear"] and grp["input_activations"] is None
    want = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}
    assert {k: grp["weights"][k] for k in want} == want
    art = Artifact(arts[kind])
    assert_packed(out, art, art.layer_names, grp)
    assert_loads_like_eval(out, arts[kind])
    meta = json.loads((out / "unionsparse.json").read_text())
    assert meta["target"] == "compressed-tensors" and meta["dense_layers"] == {}
    notes = [ln.split("compressed-tensors: ", 1)[1] for ln in r.err.splitlines() if "not expressed" in ln]
    assert notes == meta["not_expressed"]
    if kind == "w2":
        assert any(n.startswith("activation quantization") for n in notes)
        assert any(n.startswith("per-tile row permutations") for n in notes)


def test_compressed_tensors_per_channel_and_ragged_groups(arts, tmp_path, run_cli):
    """Group 192: K=128 layers have one scale per row (strategy channel); K=256 layers end in a ragged group,
    which compressed-tensors cannot hold: dense fp16, in ignore, with a line saying which group size would do."""
    out = tmp_path / "ct"
    r = run_cli("export", arts["g192"], "-o", out, "--to", "compressed-tensors")
    assert r.code == 0, r.err
    art = Artifact(arts["g192"])
    ragged = [n for n in art.layer_names if art.layer_attrs(n)["shape"][1] == 256]
    assert ragged and all(n.endswith("down_proj") for n in ragged)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(qc["ignore"]) == sorted(ragged + ["lm_head"])
    (grp,) = qc["config_groups"].values()
    assert grp["weights"]["strategy"] == "channel" and grp["weights"]["num_bits"] == 4
    assert_packed(out, art, [n for n in art.layer_names if n not in ragged], grp)
    t = saved(out)
    ref = rebuild_model(arts["g192"], act_quant=False)
    for n in ragged:
        assert torch.equal(t[f"{n}.weight"], ref.get_submodule(n).weight.detach().half())
    assert_loads_like_eval(out, arts["g192"])
    (line,) = [ln for ln in r.err.splitlines() if "ragged" in ln]
    assert "K = 256" in line and "--group-size 128" in line and "ignore" in line


def test_readback_check_catches_a_wrong_code(arts, tmp_path):
    """The export's own read-back through compressed-tensors fails on one flipped packed word."""
    from safetensors.torch import save_file
    from unionsparse.compressor import export

    out = tmp_path / "ct"
    export.export_compressed_tensors(arts["w4cbc"], out)
    art = Artifact(arts["w4cbc"])
    export._check_packed(out, art, export._pack_plan(art))
    t = load_file(str(out / "model.safetensors"))
    key = f"{art.layer_names[3]}.weight_packed"
    t[key][5, 2] ^= 1 << 9
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match="packed codes differ"):
        export._check_packed(out, art, export._pack_plan(art))


def test_compressed_tensors_outlier_layers_dense_in_ignore(arts, tmp_path, run_cli, monkeypatch):
    """Block 1 taken from the outlier artifact: those layers are written dense fp16 and named in ignore."""
    other = Artifact(arts["outliers"])
    read, attrs = Artifact.read_layer, Artifact.layer_attrs

    def mixed(fn):
        return lambda self, name: fn(other if name.startswith("model.layers.1.") else self, name)

    monkeypatch.setattr(Artifact, "read_layer", mixed(read))
    monkeypatch.setattr(Artifact, "layer_attrs", mixed(attrs))
    out = tmp_path / "ct"
    r = run_cli("export", arts["w2"], "-o", out, "--to", "compressed-tensors")
    assert r.code == 0, r.err
    names = Artifact(arts["w2"]).layer_names
    dense = [n for n in names if n.startswith("model.layers.1.")]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(qc["ignore"]) == sorted(dense + ["lm_head"])
    t = saved(out)
    ref = rebuild_model(arts["w2"], act_quant=False)  # patched too: eval's model of the mixed artifact
    for n in names:
        if n in dense:
            assert f"{n}.weight_packed" not in t and torch.equal(t[f"{n}.weight"], ref.get_submodule(n).weight.half())
        else:
            assert f"{n}.weight_packed" in t and f"{n}.weight" not in t
    torch.testing.assert_close(logits(load_hf(out)), logits(ref), rtol=0, atol=1e-2)
    assert any("outlier channels" in ln and "ignore" in ln for ln in r.err.splitlines())
    assert set(json.loads((out / "unionsparse.json").read_text())["dense_layers"]) == set(dense)


# ------------------------------------------------------------------------------------- refusals, safety


@pytest.mark.parametrize("kind,words", [("fp16", "use --to hf"), ("outliers", "use --to hf")])
def test_compressed_tensors_refuses_what_it_cannot_pack(arts, kind, words, tmp_path, run_cli):
    out = tmp_path / "ct"
    r = run_cli("export", arts[kind], "-o", out, "--to", "compressed-tensors")
    assert r.code == 2 and words in one_line(r.err)
    assert not out.exists() and not (tmp_path / "ct.partial").exists()


def test_target_from_the_environment(arts, tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("UNIONSPARSE_EXPORT_TO", "compressed-tensors")
    r = run_cli("export", arts["fp16"], "-o", tmp_path / "ct")
    assert r.code == 2 and "use --to hf" in one_line(r.err)


def test_compressed_tensors_missing_package(arts, tmp_path, run_cli, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "compressed_tensors", None)
    r = run_cli("export", arts["w2"], "-o", tmp_path / "ct", "--to", "compressed-tensors")
    assert r.code == 2 and "unionsparse[export]" in one_line(r.err)


def test_bad_input_is_one_line(arts, tmp_path, run_cli, llama_with_tokenizer):
    src, _ = llama_with_tokenizer
    for args, words in [((src, "-o", tmp_path / "a"), "not a unionsparse artifact"),
                        ((tmp_path / "nope.zarr", "-o", tmp_path / "b"), "no such artifact"),
                        ((arts["w2"], "-o", tmp_path / "c", "--to", "gguf"), "--to"),
                        ((arts["w2"], "-o", tmp_path / "d", "--max-shard-size", "big"), "--max-shard-size"),
                        ((arts["w2"], "-o", tmp_path / "no" / "e"), "does not exist")]:
        r = run_cli("export", *args)
        assert r.code == 2 and words in one_line(r.err), (args, r.err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_output_folder_safety(arts, tmp_path, run_cli):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    r = run_cli("export", arts["w2"], "-o", out)  # not empty
    assert r.code == 2 and "--overwrite" in one_line(r.err)
    r = run_cli("export", arts["w2"], "-o", out, "--overwrite")  # not an export
    assert r.code == 2 and "not written by unionsparse export" in one_line(r.err)
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and (out / "mine.txt").read_text() == "keep"
    (out / "mine.txt").unlink()  # an empty folder is used as it is
    assert run_cli("export", arts["w2"], "-o", out, "--max-shard-size", "200KB").code == 0
    assert len(list(out.glob("model-*.safetensors"))) > 1
    r = run_cli("export", arts["w2"], "-o", out, "--overwrite")  # an earlier export is replaced, old shards go
    assert r.code == 0, r.err
    assert not list(out.glob("model-*.safetensors")) and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial or replaced folder left
    (out / "notes.md").write_text("user file")  # a file the export did not write: not replaced
    r = run_cli("export", arts["w2"], "-o", out, "--overwrite")
    assert r.code == 2 and "notes.md" in one_line(r.err)
    assert (out / "notes.md").read_text() == "user file" and (out / "model.safetensors").is_file()


def test_failure_midway_leaves_nothing(arts, tmp_path, run_cli, monkeypatch):
    from unionsparse.compressor import export

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export, "_copy_tokenizer", boom)
    r = run_cli("export", arts["w2"], "-o", tmp_path / "out")
    assert r.code == 3 and "disk full" in one_line(r.err)
    assert list(tmp_path.iterdir()) == []


def test_partial_folders(arts, tmp_path, run_cli):
    """An interrupted export's DIR.partial is replaced; one the export did not make is refused."""
    out, part = tmp_path / "out", tmp_path / "out.partial"
    part.mkdir()
    (part / "x").write_text("someone else's")
    r = run_cli("export", arts["w2"], "-o", out)
    assert r.code == 2 and "out.partial" in one_line(r.err) and (part / "x").is_file()
    shutil.rmtree(part)
    part.mkdir()
    (part / "unionsparse.json").write_text(json.dumps({"unionsparse_export": 1, "complete": False}))
    (part / "model.safetensors").write_bytes(b"half")
    assert run_cli("export", arts["w2"], "-o", out).code == 0
    assert not part.exists() and (out / "config.json").is_file()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()
