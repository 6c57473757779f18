"""Integrity of artifacts (issue 27): verify catches every single-byte flip, swap and deletion; a re-signed
manifest does not hide edited metadata; links, special files and forged sizes are refused before any read or
allocation; what an artifact says never reaches the network or the terminal as control sequences."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
from unionsparse.compressor.artifact.layout import MANIFEST
from unionsparse.compressor.artifact.store import Artifact, write_manifest
from unionsparse.compressor.errors import UserError
from unionsparse.compressor.verify.checks import verify

LAYER = "model.layers.0.self_attn.q_proj"


def _byte_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


@pytest.fixture(scope="module")
def mini(tmp_path_factory) -> dict[str, Path]:
    """A 1-block LLaMA (hidden 64, 256 tokens, tied embeddings), its byte tokenizer, its artifact and a text."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from unionsparse.compressor.cli import main

    root = tmp_path_factory.mktemp("mini")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(root / "model")
    _byte_tokenizer(root / "tok")
    out = root / "mini.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(root / "model"), "-o", str(out), "--quiet", "--reorder", "none"])
    assert e.value.code == 0
    (root / "text.raw").write_text("\n".join("the sparse kernel reads the packed codes" for _ in range(8)))
    return {"art": out, "tok": root / "tok", "text": root / "text.raw", "model": root / "model"}


def fresh(mini: dict, tmp: Path, name: str = "a.zarr") -> Path:
    d = tmp / name
    shutil.copytree(mini["art"], d)
    return d


def fails(store: Path) -> list[str]:
    """verify's failures (in process); exit 2 (UserError) or any other exception fails the test."""
    res = verify(str(store), backend="cpu", ns=[1])
    return res.failures


def fail_lines(r) -> list[str]:
    assert "Traceback" not in r.out + r.err
    return [ln for ln in r.out.splitlines() if ln.startswith("FAIL")]


def edit_json(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def chunk_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*") if p.is_file() and not p.name.endswith(".json"))


# ------------------------------------------------------------------------------- flips, swaps, deletions


def flip_positions(f: Path, every_byte: bool) -> range | list[int]:
    """Every byte of the small metadata files; of the two larger JSON files (a layer's attributes, the
    manifest) both ends and every 7th byte between; of chunk files the start, body and trailing CRC-32C."""
    n = f.stat().st_size
    if every_byte:
        return range(n)
    if f.name.endswith(".json"):  # from the end: the manifest's last line is its own digest
        return sorted({*range(min(n, 256)), *range(max(0, n - 256), n), *range(256, n, 7)}, reverse=True)
    body = [4 + i * (n - 12) // 8 for i in range(8)]
    return sorted({*range(min(n, 4)), *body, *range(max(0, n - 8), n)})


def sample_files(store: Path) -> list[tuple[Path, bool]]:
    """(file, every byte?): the manifest and one layer's attributes sampled; the root, group and array
    metadata of that layer and of one dense tensor, every byte; every chunk file sampled."""
    layer = store / "layers" / LAYER
    dense = sorted((store / "dense").iterdir())[0]
    full = [store / "zarr.json", store / "layers" / "zarr.json", store / "dense" / "zarr.json",
            *(layer / k / "zarr.json" for k in ("bitmaps", "offsets", "values", "scales")), dense / "zarr.json"]
    return ([(store / MANIFEST, False), (layer / "zarr.json", False)] + [(f, True) for f in full]
            + [(f, False) for f in chunk_files(store)])


def test_every_single_byte_flip_fails_verify(mini, tmp_path, run_cli):
    d = fresh(mini, tmp_path)
    assert fails(d) == []
    t0, tried = time.perf_counter(), 0
    for f, every_byte in sample_files(d):
        raw = f.read_bytes()
        with open(f, "r+b") as fh:
            for j in flip_positions(f, every_byte):
                fh.seek(j)
                fh.write(bytes([raw[j] ^ (1 << (j % 8))]))
                fh.flush()
                assert fails(d), (f, j)
                fh.seek(j)
                fh.write(raw[j : j + 1])
                fh.flush()
                tried += 1
    assert tried > 7000 and fails(d) == []
    # through the command line: exit 1, a FAIL line naming the file, no traceback
    for f, _ in sample_files(d)[:11]:
        raw = f.read_bytes()
        f.write_bytes(raw[:7] + bytes([raw[7] ^ 0x20]) + raw[8:])
        r = run_cli("verify", d, "--n", "1", "--quiet")
        f.write_bytes(raw)
        assert r.code == 1, (f, r.out, r.err)
        lines = fail_lines(r)
        rel = f.relative_to(d).as_posix()
        assert len(lines) == 1 and (rel.split("/")[-1] in lines[0]), (rel, lines)
    print(f"{tried} flips in {time.perf_counter() - t0:.1f} s")


def test_every_swap_of_same_size_chunk_files_fails_verify(mini, tmp_path):
    d = fresh(mini, tmp_path)
    by_size: dict[int, list[Path]] = {}
    for f in chunk_files(d):
        by_size.setdefault(f.stat().st_size, []).append(f)
    swaps = 0
    for group in by_size.values():
        for a, b in itertools.combinations(group, 2):
            ra, rb = a.read_bytes(), b.read_bytes()
            if ra == rb:  # identical bytes (e.g. two norms of ones): swapping them changes nothing
                continue
            a.write_bytes(rb)
            b.write_bytes(ra)
            assert fails(d), (a, b)
            a.write_bytes(ra)
            b.write_bytes(rb)
            swaps += 1
    assert swaps >= 20
    # the example of the audit: the scales of two layers of the same shape
    a, b = (d / "layers" / n / "scales" / "c" / "0" / "0" for n in (LAYER, "model.layers.0.self_attn.o_proj"))
    ra, rb = a.read_bytes(), b.read_bytes()
    a.write_bytes(rb)
    b.write_bytes(ra)
    assert any("scales" in f and "SHA-256" in f for f in fails(d))


def test_every_file_deletion_fails_verify(mini, tmp_path, run_cli):
    d = fresh(mini, tmp_path)
    files = sorted(p for p in d.rglob("*") if p.is_file())
    for f in files:
        raw = f.read_bytes()
        f.unlink()
        try:
            assert fails(d), f
        finally:
            f.write_bytes(raw)
    assert len(files) > 50 and fails(d) == []


def test_missing_manifest_fails_in_one_line(mini, tmp_path, run_cli):
    d = fresh(mini, tmp_path)
    (d / MANIFEST).unlink()
    r = run_cli("verify", d, "--n", "1", "--quiet")
    assert r.code == 1
    lines = fail_lines(r)
    assert len(lines) == 1 and MANIFEST in lines[0] and "missing" in lines[0], r.out


# ---------------------------------------------------------------------------- re-signed metadata edits


def _layer_stat(key, fn):
    return f"layers/{LAYER}/zarr.json", lambda doc: doc["attributes"]["stats"].__setitem__(
        key, fn(doc["attributes"]["stats"][key])), f"stats.{key}"


def _root(fn, needle):
    return "zarr.json", lambda doc: fn(doc["attributes"]), needle


EDITS = {  # what -> (file, edit, what the FAIL line must name)
    "stats.nnz": _layer_stat("nnz", lambda v: v - 100),
    "stats.sparsity": _layer_stat("sparsity", lambda v: v + 0.2),
    "stats.bits_per_weight": _layer_stat("bits_per_weight", lambda v: v / 2),
    "stats.total_bytes": _layer_stat("total_bytes", lambda v: v - 64),
    "stats.pmr last bit": _layer_stat("pmr", lambda v: math.nextafter(v, math.inf)),
    "baselines.csr": (f"layers/{LAYER}/zarr.json",
                      lambda doc: doc["attributes"]["baselines"]["csr"].__setitem__("meta_bytes", 1), "baselines.csr"),
    "activations": (f"layers/{LAYER}/zarr.json",
                    lambda doc: doc["attributes"]["activations"].__setitem__("bits", 8), "activation record"),
    "activations dropped": (f"layers/{LAYER}/zarr.json", lambda doc: doc["attributes"].pop("activations"),
                            "activation record"),
    "summary.bits_per_weight": _root(lambda a: a["summary"].__setitem__("bits_per_weight", 1.5),
                                     "summary.bits_per_weight"),
    "summary.sparsity": _root(lambda a: a["summary"].__setitem__("sparsity", 0.9), "summary.sparsity"),
    "root index": _root(lambda a: a["layers"][LAYER].__setitem__("bits", 2), "root index"),
    "recipe": _root(lambda a: a["config"].__setitem__("quant", "w2a4"), "the recipe says"),
    "model_config": _root(lambda a: a["model_config"].__setitem__("intermediate_size", 96), "model_config"),
    "format_version": _root(lambda a: a.__setitem__("format_version", 0), "format_version"),
    "group node": ("layers/zarr.json", lambda doc: doc.__setitem__("node_type", "grup"), "layers/zarr.json"),
    "array fill_value": (f"layers/{LAYER}/values/zarr.json", lambda doc: doc.__setitem__("fill_value", "x"),
                         "fill_value"),
}


@pytest.mark.parametrize("what", list(EDITS))
def test_resigned_manifest_does_not_hide_edited_metadata(mini, tmp_path, run_cli, what):
    d = fresh(mini, tmp_path)
    rel, fn, needle = EDITS[what]
    edit_json(d / rel, fn)
    write_manifest(d)  # whoever edited the metadata also re-signed the manifest
    r = run_cli("verify", d, "--n", "1", "--quiet")
    assert r.code == 1, (what, r.out, r.err)
    lines = fail_lines(r)
    assert any(needle in ln for ln in lines), (what, lines)


def test_old_crc32c_manifest_is_refused_by_verify_but_readable(mini, tmp_path, run_cli):
    import crc32c

    d = fresh(mini, tmp_path)
    files = {p.relative_to(d).as_posix(): [p.stat().st_size, crc32c.crc32c(p.read_bytes())]
             for p in sorted(d.rglob("*")) if p.is_file() and p.name != MANIFEST}
    body = json.dumps({"files": files}, sort_keys=True, separators=(",", ":"))
    (d / MANIFEST).write_text(body + "\n" + f"crc32c {crc32c.crc32c(body.encode()):08x}\n")
    r = run_cli("verify", d, "--n", "1", "--quiet")
    assert r.code == 1
    lines = fail_lines(r)
    assert len(lines) == 1 and "old crc32c manifest" in lines[0]
    assert run_cli("inspect", d).code == 0  # reading older artifacts still works


# ----------------------------------------------------------------------- links, special files, sizes


def test_links_and_special_files_in_the_store_are_refused(mini, tmp_path, run_cli):
    import os

    chunk = f"layers/{LAYER}/values/c/0"
    outside = tmp_path / "outside"
    outside.mkdir()
    cases = []
    d = fresh(mini, tmp_path, "file_link.zarr")  # a link to a byte-identical copy: content would match
    shutil.copy(d / chunk, outside / "values")
    (d / chunk).unlink()
    (d / chunk).symlink_to(outside / "values")
    cases.append(d)
    d = fresh(mini, tmp_path, "dir_link.zarr")
    shutil.copytree(d / "layers" / LAYER, outside / "layer")
    shutil.rmtree(d / "layers" / LAYER)
    (d / "layers" / LAYER).symlink_to(outside / "layer", target_is_directory=True)
    cases.append(d)
    d = fresh(mini, tmp_path, "dev_zero.zarr")
    (d / chunk).unlink()
    (d / chunk).symlink_to("/dev/zero")
    cases.append(d)
    d = fresh(mini, tmp_path, "fifo.zarr")
    (d / chunk).unlink()
    os.mkfifo(d / chunk)
    cases.append(d)
    for d in cases:
        r = run_cli("verify", d, "--n", "1", "--quiet")
        assert r.code == 1, (d.name, r.out, r.err)
        lines = fail_lines(r)
        assert len(lines) == 1 and "refused" in lines[0], (d.name, lines)
        for args in (["inspect", d], ["eval", d, "--text", mini["text"], "--tokenizer", mini["tok"]]):
            r = run_cli(*args)
            err = [ln for ln in r.err.splitlines() if ln.strip()]
            assert r.code == 2 and len(err) == 1 and "refused" in err[0], (args, r.err)


def _set_array_meta(store: Path, rel: str, shape: list[int], chunks: list[int]) -> None:
    def fn(doc):
        doc["shape"] = shape
        doc["chunk_grid"]["configuration"]["chunk_shape"] = chunks

    edit_json(store / rel / "zarr.json", fn)
    write_manifest(store)


@pytest.mark.parametrize("chunked", [True, False])
def test_declared_huge_shape_is_refused_without_allocating(mini, tmp_path, run_cli, chunked):
    """400 MB declared for a few hundred bytes of file: refused from the file sizes, nothing allocated."""
    d = fresh(mini, tmp_path)
    n = 400_000_000
    _set_array_meta(d, f"layers/{LAYER}/values", [n], [n // 100] if chunked else [n])
    tracemalloc.start()
    try:
        failures = fails(d)
        with pytest.raises(UserError, match="declares|declared chunk"):
            Artifact(d).read_layer(LAYER)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, peak
    assert any(LAYER in f and ("declares" in f or "declared chunk" in f) for f in failures), failures
    r = run_cli("eval", d, "--text", mini["text"], "--tokenizer", mini["tok"])
    assert r.code == 2 and "declare" in r.err and "internal error" not in r.err, r.err


@pytest.mark.parametrize("key,value", [("vocab_size", 1 << 22), ("num_hidden_layers", 64),
                                       ("intermediate_size", 1 << 18)])
def test_forged_model_config_is_refused_before_building(mini, tmp_path, run_cli, key, value):
    d = fresh(mini, tmp_path)
    edit_json(d / "zarr.json", lambda doc: doc["attributes"]["model_config"].__setitem__(key, value))
    write_manifest(d)
    from unionsparse.compressor.model.rebuild import rebuild_model

    with pytest.raises(UserError, match="model_config"):
        rebuild_model(d)
    r = run_cli("eval", d, "--text", mini["text"], "--tokenizer", mini["tok"], "--seqlen", "16")
    err = [ln for ln in r.err.splitlines() if ln.strip()]
    assert r.code == 2 and len(err) == 1 and "model_config" in err[0], (key, r.code, r.err)


# ------------------------------------------------------------------------------ what an artifact says


def test_eval_never_loads_the_tokenizer_an_artifact_names(mini, tmp_path, run_cli, monkeypatch):
    import transformers

    d = fresh(mini, tmp_path)
    edit_json(d / "zarr.json", lambda doc: doc["attributes"]["source"].__setitem__("model", "attacker/evil-repo"))
    write_manifest(d)
    calls: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def spy(name, *args, **kwargs):
        calls.append(str(name))
        if not Path(name).exists():
            raise OSError("this test allows no network")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    r = run_cli("eval", d, "--text", mini["text"], "--seqlen", "16")
    err = [ln for ln in r.err.splitlines() if ln.strip()]
    assert r.code == 2 and len(err) == 1 and "--tokenizer" in err[0], r.err
    assert not any("evil" in c for c in calls), calls
    # a tokenizer stored in the artifact is used, offline; one given explicitly too
    shutil.copytree(mini["tok"], d / "tokenizer")
    write_manifest(d)
    r = run_cli("eval", d, "--text", mini["text"], "--seqlen", "16", "--json")
    assert r.code == 0, r.err
    assert calls and not any("evil" in c for c in calls), calls  # the stored files (read through a copy)
    assert run_cli("eval", d, "--text", mini["text"], "--seqlen", "16", "--tokenizer", mini["tok"]).code == 0
    assert not any("evil" in c for c in calls), calls
    assert run_cli("verify", d, "--n", "1", "--quiet").code == 0  # the tokenizer files are in the manifest


def _rename_layer(store: Path, old: str, new: str) -> None:
    (store / "layers" / old).rename(store / "layers" / new)

    def fn(doc):
        index = doc["attributes"]["layers"]
        doc["attributes"]["layers"] = {new if k == old else k: v for k, v in index.items()}

    edit_json(store / "zarr.json", fn)
    write_manifest(store)


def test_markup_and_escape_sequences_in_names_are_shown_inert(mini, tmp_path, run_cli):
    d = fresh(mini, tmp_path, "markup.zarr")
    name = "[bold red]EVIL[blink][link=https:x]y"
    _rename_layer(d, LAYER, name)
    r = run_cli("inspect", d)
    assert r.code == 0, r.err
    assert name in r.out  # printed as it is, not interpreted
    r = run_cli("verify", d, "--n", "1", "--quiet")  # a renamed layer: the model lacks q_proj now
    assert r.code == 1 and any("q_proj" in ln for ln in fail_lines(r)), r.out
    d = fresh(mini, tmp_path, "escape.zarr")
    name = "x\x1b[2J\x1b]0;pwned\x07y"
    _rename_layer(d, LAYER, name)
    for args, code in ((["inspect", d], 2), (["verify", d, "--n", "1", "--quiet"], 1),
                       (["inspect", d, "--layer", name], 2)):
        r = run_cli(*args)
        text = r.out + r.err
        assert r.code == code, (args, r.code, text)
        assert "\x1b" not in text and "\x07" not in text and "Traceback" not in text, (args, text)
        assert "\\x1b" in text, (args, text)
