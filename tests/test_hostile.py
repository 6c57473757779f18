"""A catalogue of hostile inputs across every command: exit 2 (1 from verify), one clear line, no traceback,
nothing partial left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from safetensors.torch import load_file, save_file
from unionsparse.compressor.artifact.store import write_manifest


@pytest.fixture(scope="module")
def good(tmp_path_factory, model_dirs) -> Path:
    from unionsparse.compressor.cli import main

    out = tmp_path_factory.mktemp("good") / "good.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(model_dirs["llama"]), "-o", str(out), "--quiet", "--reorder", "none"])
    assert e.value.code == 0
    return out


LAYER = "model.layers.0.self_attn.q_proj"


def copy_store(good: Path, tmp: Path, name: str) -> Path:
    d = tmp / name
    shutil.copytree(good, d)
    return d


def rewrite_array(store: Path, layer: str, key: str, fn) -> None:
    """Replace one array's content (valid crc32c) and re-sign the manifest: a crafted, consistent store."""
    g = zarr.open_group(str(store / "layers" / layer), mode="r+")
    data = fn(np.asarray(g[key][...]).copy())
    arr = g.create_array(key, shape=data.shape, dtype=data.dtype, overwrite=True,
                         compressors=[zarr.codecs.Crc32cCodec()])
    arr[...] = data
    write_manifest(store)


def first_chunk(array_dir: Path) -> Path:
    return next(p for p in sorted(array_dir.rglob("*")) if p.is_file() and p.name != "zarr.json")


def model_copy(model: Path, tmp: Path, name: str) -> Path:
    d = tmp / name
    shutil.copytree(model, d)
    return d


def model_cases(model: Path, tmp: Path) -> list[tuple[list, str]]:
    cases = []
    d = model_copy(model, tmp, "dangling")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(tmp / "gone.safetensors")
    cases.append((["compress", d], "model.safetensors"))
    d = model_copy(model, tmp, "dir_weights")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    cases.append((["compress", d], "model.safetensors"))
    d = model_copy(model, tmp, "huge_header")
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes((1 << 40).to_bytes(8, "little") + raw[8:])
    cases.append((["compress", d], "safetensors header"))
    d = model_copy(model, tmp, "truncated_st")
    (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    cases.append((["compress", d], "model.safetensors"))
    d = model_copy(model, tmp, "bad_json_header")
    n = int.from_bytes(raw[:8], "little")
    (d / "model.safetensors").write_bytes(raw[:8] + b"{" * n + raw[8 + n:])
    cases.append((["compress", d], "safetensors header"))
    d = model_copy(model, tmp, "shape_mismatch")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (d / "config.json").write_text(json.dumps(cfg))
    cases.append((["compress", d], "shape"))
    d = model_copy(model, tmp, "bad_config")
    (d / "config.json").write_text("{not json")
    cases.append((["compress", d], "MODEL"))
    d = model_copy(model, tmp, "inf_weights")
    sd = load_file(str(d / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    sd[key] = sd[key].clone()
    sd[key][0, 0] = float("inf")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    cases.append((["compress", d], "down_proj"))
    g = tmp / "trunc.gguf"
    g.write_bytes(b"GGUF\x03\x00\x00\x00")
    cases.append((["compress", g], "trunc.gguf"))
    g = tmp / "garbage.gguf"
    g.write_bytes(b"\x00" * 32)
    cases.append((["compress", g], "GGUF"))
    cases.append((["compress", tmp / "absent.gguf"], "absent.gguf"))
    return cases


def option_cases(model: Path, tmp: Path) -> list[tuple[list, str]]:
    return [
        (["compress", model, "--sparsity", "1.5"], "--sparsity"),
        (["compress", model, "--sparsity", "nan"], "--sparsity"),
        (["compress", model, "--group-size", "-4"], "--group-size"),
        (["compress", model, "--group-size", "96"], "--group-size"),
        (["compress", model, "--areas", "0x2"], "--areas"),
        (["compress", model, "--tile", "512x64"], "--tile"),
        (["compress", model, "--nm", "4:2"], "--nm"),
        (["compress", model, "--workers", "0"], "--workers"),
        (["compress", model, "--workers", "2", "--scheduler", "tcp://127.0.0.1:9"], "exclusive"),
        (["compress", model, "--reorder", "greedy"], "--reorder"),
        (["compress", model, "--format", "tiled-cbc", "--tile", "100x16"], "--tile"),
        (["compress", model, "--format", "tiled-cbc", "--reorder", "dp"], "--reorder"),
        (["compress", model, "--act-sparsity", "0.5"], "--act-sparsity"),
    ]


def store_cases(good: Path, tmp: Path) -> list[tuple[list, str]]:
    """Stores for inspect (exit 2) and verify (exit 1)."""
    cases = []
    d = copy_store(good, tmp, "newer.zarr")
    meta = json.loads((d / "zarr.json").read_text())
    meta["attributes"]["format_version"] = 2
    (d / "zarr.json").write_text(json.dumps(meta))
    write_manifest(d)
    cases += [(["inspect", d], "format_version"), (["verify", d], "format_version")]
    d = copy_store(good, tmp, "trunc_root.zarr")
    text = (d / "zarr.json").read_text()
    (d / "zarr.json").write_text(text[: len(text) // 2])
    cases += [(["inspect", d], "trunc_root.zarr"), (["verify", d, "--n", "1"], "zarr.json")]
    d = copy_store(good, tmp, "incomplete.zarr")
    meta = json.loads((d / "zarr.json").read_text())
    meta["attributes"]["complete"] = False
    (d / "zarr.json").write_text(json.dumps(meta))
    write_manifest(d)
    cases += [(["inspect", d], "incomplete"), (["verify", d], "incomplete")]
    d = tmp / "a_file.zarr"
    d.write_text("hello")
    cases += [(["inspect", d], "a_file.zarr"), (["verify", d], "a_file.zarr")]
    d = copy_store(good, tmp, "no_chunk.zarr")
    chunk = first_chunk(d / "layers" / LAYER / "values")
    chunk.unlink()
    write_manifest(d)  # only the structure can catch it now
    cases.append((["verify", d, "--n", "1"], LAYER))
    d = copy_store(good, tmp, "no_array.zarr")
    shutil.rmtree(d / "layers" / LAYER / "offsets")
    write_manifest(d)
    cases.append((["verify", d, "--n", "1"], "offsets"))
    d = copy_store(good, tmp, "past_values.zarr")
    rewrite_array(d, LAYER, "offsets", lambda o: np.where(np.arange(o.size) > 0, o + 1024, o).astype(o.dtype))
    cases.append((["verify", d, "--n", "1"], LAYER))
    d = copy_store(good, tmp, "popcount.zarr")

    def flip_bit(b: np.ndarray) -> np.ndarray:
        b[0] ^= np.uint64(1 << 5)
        return b

    rewrite_array(d, LAYER, "bitmaps", flip_bit)
    cases.append((["verify", d, "--n", "1"], LAYER))
    d = copy_store(good, tmp, "bad_perm.zarr")
    rewrite_array(d, LAYER, "values", lambda v: v[: v.size // 2])
    cases.append((["verify", d, "--n", "1"], LAYER))
    d = copy_store(good, tmp, "bad_scales.zarr")
    rewrite_array(d, LAYER, "scales", lambda s: s[:, :-1] if s.shape[1] > 1 else s[:-1])
    cases.append((["verify", d, "--n", "1"], "scales"))
    return cases


def resign_json(store: Path, rel: str, fn) -> None:
    """Edit one JSON file of the store and re-sign the manifest (a crafted, consistent store)."""
    doc = json.loads((store / rel).read_text())
    fn(doc)
    (store / rel).write_text(json.dumps(doc))
    write_manifest(store)


def integrity_cases(good: Path, tmp: Path, tokenizer: Path) -> list[tuple[list, str]]:
    """Issue 27: links, manifests, swaps, forged sizes and configs, names with control characters."""
    cases = []
    text = tmp / "eval.txt"
    text.write_text("the model weights of the sparse kernel\n" * 40)
    d = copy_store(good, tmp, "no_manifest.zarr")
    (d / "unionsparse_manifest.json").unlink()
    cases.append((["verify", d, "--n", "1"], "unionsparse_manifest.json is missing"))
    d = copy_store(good, tmp, "link.zarr")
    chunk = first_chunk(d / "layers" / LAYER / "values")
    shutil.copy(chunk, tmp / "outside_chunk")
    chunk.unlink()
    chunk.symlink_to(tmp / "outside_chunk")
    cases += [(["verify", d, "--n", "1"], "symbolic link"), (["inspect", d], "symbolic link"),
              (["eval", d, "--text", text, "--tokenizer", tokenizer, "--seqlen", "64"], "symbolic link")]
    d = copy_store(good, tmp, "swapped_scales.zarr")
    a, b = (first_chunk(d / "layers" / n / "scales") for n in (LAYER, "model.layers.0.self_attn.o_proj"))
    ra, rb = a.read_bytes(), b.read_bytes()
    a.write_bytes(rb)
    b.write_bytes(ra)
    cases.append((["verify", d, "--n", "1"], "scales/c/0/0: size or SHA-256 differs"))
    d = copy_store(good, tmp, "edited_stats.zarr")
    resign_json(d, f"layers/{LAYER}/zarr.json", lambda m: m["attributes"]["stats"].__setitem__("nnz", 1))
    cases.append((["verify", d, "--n", "1"], "stats.nnz"))
    d = copy_store(good, tmp, "huge_shape.zarr")
    resign_json(d, f"layers/{LAYER}/values/zarr.json", lambda m: m.__setitem__("shape", [1 << 33]))
    cases += [(["verify", d, "--n", "1"], LAYER),
              (["eval", d, "--text", text, "--tokenizer", tokenizer, "--seqlen", "64"], "declares")]
    d = copy_store(good, tmp, "forged_config.zarr")
    resign_json(d, "zarr.json", lambda m: m["attributes"]["model_config"].__setitem__("vocab_size", 1 << 24))
    cases.append((["eval", d, "--text", text, "--tokenizer", tokenizer, "--seqlen", "64"], "model_config"))
    cases.append((["eval", good, "--text", text, "--seqlen", "64"], "--tokenizer"))
    d = copy_store(good, tmp, "escape_name.zarr")
    evil = "q\x1b]0;owned\x07\x1b[2J"
    (d / "layers" / LAYER).rename(d / "layers" / evil)
    resign_json(d, "zarr.json", lambda m: m["attributes"].__setitem__(
        "layers", {evil if k == LAYER else k: v for k, v in m["attributes"]["layers"].items()}))
    cases += [(["inspect", d], "control character"), (["verify", d, "--n", "1"], "control character")]
    return cases


def test_catalogue(tmp_path, model_dirs, good, run_cli, llama_with_tokenizer):
    model = model_dirs["llama"]
    o = tmp_path / "o.zarr"
    cases = [(args + ["-o", o, "--quiet"] if args[0] == "compress" else args, needle)
             for args, needle in model_cases(model, tmp_path) + option_cases(model, tmp_path)]
    cases += store_cases(good, tmp_path)
    cases += integrity_cases(good, tmp_path, llama_with_tokenizer[0])
    assert len(cases) >= 30
    for args, needle in cases:
        r = run_cli(*args)
        text = r.out + r.err
        assert "Traceback" not in text, (args, text)
        assert "\x1b" not in text and "\x07" not in text, (args, text)  # nothing reaches the terminal raw
        if args[0] == "verify" and r.code == 1:  # a store of ours that fails a check
            fails = [ln for ln in r.out.splitlines() if ln.startswith("FAIL")]
            assert fails and any(needle in ln for ln in fails), (args, r.out)
            assert "FAILED" in r.out.strip().splitlines()[-1]
        else:
            assert r.code == 2, (args, r.code, text)
            lines = [ln for ln in r.err.splitlines() if ln.strip()]
            assert len(lines) == 1, (args, r.err)
            assert needle in lines[0], (args, lines[0])
            assert "internal error" not in lines[0], (args, lines[0])
        assert not o.exists() and not (tmp_path / "o.zarr.partial").exists(), args


def test_verify_reports_every_failing_layer(good, tmp_path, run_cli):
    d = copy_store(good, tmp_path, "two_bad.zarr")
    names = ["model.layers.0.self_attn.k_proj", "model.layers.1.mlp.up_proj"]
    for n in names:
        chunk = first_chunk(d / "layers" / n / "values")
        b = bytearray(chunk.read_bytes())
        b[len(b) // 2] ^= 0xFF
        chunk.write_bytes(b)
    r = run_cli("verify", d, "--n", "1", "--quiet")
    assert r.code == 1
    fails = [ln for ln in r.out.splitlines() if ln.startswith("FAIL")]
    for n in names:
        assert any(f"layer {n}" in ln for ln in fails), (n, r.out)
    last = r.out.strip().splitlines()[-1]
    assert f"FAILED: {len(fails)} problem(s)" in last


def test_fifty_single_byte_flips_all_caught(good, tmp_path):
    """Flip one byte at a time (50 flips over every file of the store); verify must fail on each."""
    import random

    from unionsparse.compressor.verify.checks import verify

    d = copy_store(good, tmp_path, "flips.zarr")
    files = sorted(p for p in d.rglob("*") if p.is_file())
    rnd = random.Random(8)
    for i in range(50):
        f = rnd.choice(files)
        raw = f.read_bytes()
        j = rnd.randrange(len(raw))
        f.write_bytes(raw[:j] + bytes([raw[j] ^ (1 << rnd.randrange(8))]) + raw[j + 1:])
        try:
            res = verify(str(d), backend="cpu", ns=[1])
            assert not res.ok, (i, f, j)
        except Exception as e:  # bad input (exit 2) is a catch too, as long as it is a clean UserError
            from unionsparse.compressor.errors import UserError

            assert isinstance(e, UserError), (i, f, j, e)
        finally:
            f.write_bytes(raw)
    assert verify(str(d), backend="cpu", ns=[1]).ok


def safety_cases(model: Path, tmp: Path) -> list[tuple[list, str]]:
    """Data safety (issue 27): what -o may replace, partials, finite tensors, lengths, unused calibration files."""
    cases: list[tuple[list, str]] = []
    calib = tmp / "calib.jsonl"
    calib.write_text(json.dumps({"text": "some calibration text " * 50}) + "\n")
    f = tmp / "a_file.zarr"
    f.write_text("mine")
    cases.append((["compress", model, "-o", f, "--overwrite"], "is a file"))
    d = tmp / "user_dir.zarr"
    d.mkdir()
    (d / "thesis.txt").write_text("mine")
    cases.append((["compress", model, "-o", d, "--overwrite"], "not a unionsparse artifact"))
    holder = tmp / "holder.zarr"
    shutil.copytree(model, holder / "m")
    cases.append((["compress", holder / "m", "-o", holder, "--overwrite"], "input model"))
    cases.append((["compress", model, "-o", model / "inside.zarr"], "input model"))
    cases.append((["compress", model, "-o", f / "x.zarr"], "not a folder"))
    p = tmp / "p.zarr.partial"
    p.mkdir()
    (p / "keep.txt").write_text("mine")
    cases.append((["compress", model, "-o", tmp / "p.zarr", "--resume"], "p.zarr.partial"))
    cases.append((["compress", model, "--calib", tmp / "nope.jsonl"], "--calib"))
    cases.append((["compress", model, "--act-sparsity-calib", tmp / "nope.json"], "--act-sparsity-calib"))
    cases.append((["compress", model, "--prune", "wanda", "--calib", calib, "--seqlen", "100000"], "--seqlen"))
    cases.append((["compress", model, "--prune", "wanda", "--calib", calib, "--seqlen", "1000000000"], "--seqlen"))
    cases.append((["compress", model, "--prune", "bogus"], "--prune"))
    for name, key, value in (("nan_embed", "model.embed_tokens.weight", float("nan")),
                             ("inf_norm", "model.layers.0.input_layernorm.weight", float("inf")),
                             ("huge_weight", "model.layers.0.self_attn.q_proj.weight", 1e30)):
        d = model_copy(model, tmp, name)
        sd = load_file(str(d / "model.safetensors"))
        sd[key] = sd[key].clone()
        sd[key].view(-1)[0] = value
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
        cases.append((["compress", d], key.removesuffix(".weight")))
    text = tmp / "eval.txt"
    text.write_text("words " * 100)
    cases.append((["eval", model, "--text", text, "--seqlen", "100000"], "--seqlen"))
    cases.append((["eval", model, "--text", text, "--max-windows", "0"], "--max-windows"))
    return cases


def test_safety_catalogue(tmp_path, model_dirs, run_cli):
    """Each case: exit 2, exactly one line naming the problem, no traceback, nothing written, nothing deleted."""
    model = model_dirs["llama"]
    o = tmp_path / "o.zarr"
    cases = safety_cases(model, tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert len(cases) >= 15
    for args, needle in cases:
        if args[0] == "compress":
            args = args + ["--quiet"] + ([] if "-o" in args else ["-o", o])
        r = run_cli(*args)
        text = r.out + r.err
        assert "Traceback" not in text, (args, text)
        assert r.code == 2, (args, r.code, text)
        lines = [ln for ln in r.err.splitlines() if ln.strip()]
        assert len(lines) == 1, (args, r.err)
        assert needle in lines[0] and "internal error" not in lines[0], (args, lines[0])
        assert not o.exists() and not (tmp_path / "o.zarr.partial").exists(), args
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing deleted
