"""`unionsparse eval --tasks`: lm-evaluation-harness tasks on the model an artifact rebuilds, with task data from
local files only. A tiny W4A4 artifact, a made-up ARC-Easy-format test split whose answer keys are set from the
rebuilt model's own choices (so the expected accuracy is known and differs from the source model's), scored by
the CLI and by hand with plain transformers; missing data, bad arguments and a missing lm_eval are one line,
exit 2, before the model is rebuilt; no socket is connected."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

needs_lm_eval = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                   reason="lm_eval is not installed (pip install -e '.[tasks]')")

LIMIT = 12  # items scored with --limit; the file holds 16
RIGHT = 8  # the first RIGHT items' answer key is the rebuilt model's choice, the others' is not

QUESTIONS = [  # made up; most answers differ in one letter (near ties, so weights decide), a few in length
    ("What sits on the mat?", ["cat", "cap", "car", "can"]),
    ("What falls from clouds?", ["rain", "rail", "raid", "rein"]),
    ("Which word is the longest?", ["a", "ant", "antelope", "an"]),
    ("What do bees make?", ["honey", "money", "hones", "holey"]),
    ("Where do fish live?", ["lake", "lane", "lame", "lace"]),
    ("What is hot?", ["fire", "fine", "fife", "fir"]),
    ("What do we read?", ["book", "boot", "boom", "boon"]),
    ("Which one can fly?", ["bird", "bard", "bind", "bark"]),
    ("What do cows drink?", ["water", "wafer", "later", "waver"]),
    ("Which is a colour?", ["red", "r", "reddish brown", "re"]),
    ("What grows on trees?", ["leaf", "loaf", "lead", "leap"]),
    ("What lights the day?", ["sun", "sum", "sup", "son"]),
    ("Which is a fruit?", ["pear", "peer", "pier", "peat"]),
    ("What do we sleep in?", ["bed", "bad", "bud", "bid"]),
    ("What has four legs?", ["dog", "a big old dog", "do", "d"]),
    ("What makes a sound?", ["bell", "belt", "bolt", "ball"]),
]
LABELS = ["A", "B", "C", "D"]


# ------------------------------------------------------------------------------------------ helpers


def one_line(r) -> str:
    assert "Traceback" not in r.out + r.err, r.err
    lines = [ln for ln in r.err.splitlines() if ln.strip() and "unionsparse:" in ln]
    assert len(lines) == 1, f"expected exactly one error line on stderr, got: {r.err!r}"
    assert "internal error" not in lines[0], lines[0]
    return lines[0]


def refused(r, *needles: str) -> str:
    assert r.code == 2, (r.code, r.out, r.err)
    line = one_line(r)
    for n in needles:
        assert n in line, (n, line)
    return line


def prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"  # lm-eval's arc_easy doc_to_text


def per_char(choices: list[str]) -> np.ndarray:
    return np.array([len(c) for c in choices], dtype=float)  # acc_norm's divisor: the choice's characters


def choice_logliks(model, tok, question: str, choices: list[str]) -> np.ndarray:
    """Sum of next-token log-probabilities of " " + choice after the prompt (the request lm-eval builds)."""
    out = []
    ctx = tok.encode(prompt(question))
    for c in choices:
        whole = tok.encode(prompt(question) + " " + c)
        assert whole[: len(ctx)] == ctx
        with torch.no_grad():
            logits = model(torch.tensor([whole[:-1]])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        out.append(sum(float(logp[i - 1, whole[i]]) for i in range(len(ctx), len(whole))))
    return np.array(out)


def scores(model, tok, keys: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per item: correct by acc (argmax log-likelihood) and by acc_norm (divided by the choice's characters)."""
    acc, norm = [], []
    for (q, choices), key in zip(QUESTIONS, keys, strict=False):
        ll = choice_logliks(model, tok, q, choices)
        acc.append(int(np.argmax(ll)) == key)
        norm.append(int(np.argmax(ll / per_char(choices))) == key)
    return np.array(acc), np.array(norm)


def write_arc(path: Path, keys: list[int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"q{i}", "question": q, "choices": {"text": c, "label": LABELS}, "answerKey": LABELS[k]}
            for i, ((q, c), k) in enumerate(zip(QUESTIONS, keys, strict=True))]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def write_hellaswag(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"ind": i, "activity_label": "Cooking", "ctx_a": "A man puts a pan on the stove.", "ctx_b": "he",
             "ctx": "A man puts a pan on the stove. he", "split": "val", "split_type": "indomain", "source_id": "s",
             "endings": ["cracks an egg into it.", "flies away.", "sings [title] loudly.", "is a pan."],
             "label": str(i % 4)} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def source(model_dirs, tmp_path_factory) -> Path:
    """The tiny LLaMA with its blocks' linears x10 (at the random init the embeddings dominate and compression
    hardly moves the model's choices), a byte-level tokenizer of fixed ids (the byte alphabet sorted;
    conftest's follows the alphabet's set order, which changes between runs) and an EOS token (lm-eval
    prefixes with BOS or EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    src = tmp_path_factory.mktemp("tasks_src") / "llama"
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.mul_(10.0)
    model.save_pretrained(src)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=min(vocab)).save_pretrained(src)
    return src


@pytest.fixture(scope="module")
def art(source, tmp_path_factory) -> Path:
    """W4A4 IE-BME: the rebuilt model quantizes activations per token, so it is not the dense source."""
    from unionsparse.compressor.cli import main

    out = tmp_path_factory.mktemp("tasks_art") / "w4a4.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(source), "-o", str(out), "--quiet", "--prune", "magnitude", "--quant", "w4a4",
              "--reorder", "none"])
    assert e.value.code == 0
    return out


@pytest.fixture(scope="module")
def expected(art, source):
    """Answer keys from the rebuilt model's choices (right for the first RIGHT items, wrong for the rest), and
    the per-item correctness (acc, acc_norm) of the rebuilt and of the source model under them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from unionsparse.compressor.model.rebuild import rebuild_model

    tok = AutoTokenizer.from_pretrained(source)
    rebuilt = rebuild_model(art)
    picks = [int(np.argmax(choice_logliks(rebuilt, tok, q, c))) for q, c in QUESTIONS]
    keys = [p if i < RIGHT else (p + 1) % 4 for i, p in enumerate(picks)]
    dense = AutoModelForCausalLM.from_pretrained(source).eval()
    return keys, scores(rebuilt, tok, keys), scores(dense, tok, keys)


@pytest.fixture
def data(tmp_path, expected, monkeypatch) -> Path:
    """DIR/arc_easy/test.jsonl and DIR/hellaswag/validation.jsonl; the datasets cache under tmp_path."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    d = tmp_path / "task-data"
    write_arc(d / "arc_easy" / "test.jsonl", expected[0])
    write_hellaswag(d / "hellaswag" / "validation.jsonl")
    return d


@pytest.fixture
def no_network(monkeypatch) -> list:
    """Every socket connect is recorded and refused."""
    attempts: list = []

    def refuse(self, address, *a, **k):
        attempts.append(address)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


@pytest.fixture
def no_rebuild(monkeypatch):
    """The model may not be loaded or rebuilt: the checks must come first."""
    from unionsparse.compressor.evaluate import perplexity

    def boom(*_a, **_k):
        raise AssertionError("the model was loaded before the task arguments and data were checked")

    monkeypatch.setattr(perplexity, "load_for_eval", boom)


# ------------------------------------------------------------------------------------------ tests


@needs_lm_eval
def test_tasks_score_the_rebuilt_model_offline(art, data, expected, run_cli, no_network, monkeypatch):
    """--json: acc and acc_norm with stderr over the first --limit items equal the hand-computed scores of the
    rebuilt model (the source model scores differently); the data is read with the hub clients offline and
    nothing connects to the network; the offline variables are put back."""
    import datasets
    import huggingface_hub.constants

    seen = []
    real_load = datasets.load_dataset

    def load_dataset(*a, **k):
        seen.append((a[0] if a else k.get("path"), os.environ.get("HF_DATASETS_OFFLINE"),
                     os.environ.get("HF_HUB_OFFLINE"), datasets.config.HF_HUB_OFFLINE,
                     huggingface_hub.constants.HF_HUB_OFFLINE))
        return real_load(*a, **k)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    _, (acc_r, norm_r), (acc_s, _) = expected
    assert acc_s[:LIMIT].mean() != acc_r[:LIMIT].mean()  # the test tells the rebuilt model from the source
    assert norm_r[:LIMIT].mean() != acc_r[:LIMIT].mean()  # and acc from acc_norm
    before = {v: os.environ.get(v) for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    r = run_cli("eval", art, "--tasks", "arc_easy", "--tasks-data", data, "--limit", LIMIT, "--json", "--record")
    assert r.code == 0, r.err
    res = json.loads(r.out)
    t = res["tasks"]["arc_easy"]
    from unionsparse.compressor.report.figures import read_figures  # --record: beside the artifact, for inspect

    kept = read_figures(art)["tasks"][f"arc_easy, {LIMIT} items"]
    assert kept["acc"] == t["metrics"]["acc"]["value"] and kept["acc_norm"] == t["metrics"]["acc_norm"]["value"]
    assert "tasks     arc_easy" in run_cli("inspect", art).out
    assert t["samples"] == LIMIT and res["kind"] == "artifact" and res["limit"] == LIMIT
    acc, norm = t["metrics"]["acc"], t["metrics"]["acc_norm"]
    assert 0.0 <= acc["value"] <= 1.0 and 0.0 <= norm["value"] <= 1.0
    assert acc["value"] == pytest.approx(RIGHT / LIMIT) == pytest.approx(acc_r[:LIMIT].mean())
    assert norm["value"] == pytest.approx(norm_r[:LIMIT].mean())
    for m, per_item in ((acc, acc_r), (norm, norm_r)):  # lm-eval's stderr of a mean: sample std / sqrt(n)
        assert m["stderr"] == pytest.approx(float(np.std(per_item[:LIMIT], ddof=1) / np.sqrt(LIMIT)))
    assert seen == [("json", "1", "1", True, True)]  # lm-eval read the local file, offline
    assert no_network == []
    assert {v: os.environ.get(v) for v in before} == before


@needs_lm_eval
def test_tasks_table_batches_and_hellaswag(art, data, expected, run_cli, no_network):
    """The plain table: one row per task and metric; --batch-size 4 gives the same accuracy; hellaswag's
    process_docs (a function next to lm-eval's YAML) runs on the local rows."""
    _, (acc_r, _), _ = expected
    r = run_cli("eval", art, "--tasks", "arc_easy,hellaswag", "--tasks-data", data, "--limit", LIMIT,
                "--batch-size", "4")
    assert r.code == 0, r.err
    rows = {tuple(ln.split()[:2]): ln.split()[2:] for ln in r.out.splitlines() if ln.startswith(("arc", "hella"))}
    assert set(rows) == {("arc_easy", "acc"), ("arc_easy", "acc_norm"), ("hellaswag", "acc"),
                         ("hellaswag", "acc_norm")}
    assert float(rows[("arc_easy", "acc")][0]) == pytest.approx(acc_r[:LIMIT].mean(), abs=1e-4)
    assert rows[("hellaswag", "acc")][-1] == "6"  # the file's 6 rows, under --limit 12
    assert all(0.0 <= float(v[0]) <= 1.0 for v in rows.values())
    assert no_network == []


@needs_lm_eval
def test_the_sample_task_data_of_the_docs_fits_the_tasks(no_network, tmp_path, monkeypatch):
    """examples/tasks-data (docs/cli.md's worked example) is in the layout and columns lm-eval's tasks read:
    every row renders to the task's prompt, target and choices (the checks eval makes before the model)."""
    import datasets.config
    from unionsparse.compressor.evaluate import tasks

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    sample = Path(__file__).resolve().parents[1] / "examples" / "tasks-data"
    with tasks.offline():
        _, loaded = tasks.load_tasks(tasks.task_plan(["arc_easy", "hellaswag"], sample), limit=None)
    assert [len(t.eval_docs) for t in loaded] == [16, 8]
    assert no_network == []


@needs_lm_eval
@pytest.mark.parametrize("present,task,missing", [
    (None, "hellaswag", "hellaswag/validation.jsonl"),  # no folder for the task
    ("validation.jsonl", "arc_easy", "arc_easy/test.jsonl"),  # a folder without the split the task scores
])
def test_missing_task_data_is_one_line_before_the_model(present, task, missing, tmp_path, art, run_cli, no_rebuild,
                                                        no_network):
    d = tmp_path / "task-data"
    d.mkdir()
    if present:
        write_arc(d / task / present, [0] * len(QUESTIONS))
    line = refused(run_cli("eval", art, "--tasks", task, "--tasks-data", d), f"--tasks {task}", "no local data",
                   str(d / missing))
    assert "is missing" in line
    assert no_network == []


@needs_lm_eval
@pytest.mark.parametrize("broken,needle", [
    ("not json", "cannot use"),  # datasets cannot read the file
    ("row 3 without choices", "row 3 of"),  # a later row does not render (lm-eval itself tries only the first)
])
def test_unreadable_task_data_is_one_line_before_the_model(broken, needle, tmp_path, art, run_cli, no_rebuild,
                                                           monkeypatch):
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    bad = tmp_path / "task-data" / "arc_easy" / "test.jsonl"
    write_arc(bad, [0] * len(QUESTIONS))
    if broken == "not json":
        bad.write_text("this is not json\n")
    else:
        rows = [json.loads(ln) for ln in bad.read_text().splitlines()]
        rows[2]["choices"] = {"text": [], "label": []}  # its answer key is not among its labels
        bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused(run_cli("eval", art, "--tasks", "arc_easy", "--tasks-data", bad.parents[1]), "--tasks arc_easy",
            needle, str(bad))


@pytest.mark.parametrize("args,needle", [
    (("--tasks", "arc_easy"), "--tasks-data"),
    (("--tasks", "arc_easy", "--tasks-data", "{tmp}/nowhere"), "does not exist"),
    (("--tasks", "arc_easy", "--tasks-data", "{tmp}", "--limit", "0"), "--limit"),
    (("--tasks", "arc_easy", "--tasks-data", "{tmp}", "--batch-size", "0"), "--batch-size"),
    (("--tasks", " , ", "--tasks-data", "{tmp}"), "--tasks"),
    (("--tasks", "arc_*", "--tasks-data", "{tmp}"), "not a task name"),
    (("--tasks", "arc_easy,arc_easy", "--tasks-data", "{tmp}"), "named twice"),
    (("--tasks", "arc_easy", "--tasks-data", "{tmp}", "--text", "{tmp}/t.txt"), "--text and --tasks"),
    (("--tasks", "arc_easy", "--tasks-data", "{tmp}", "--max-windows", "2"), "--max-windows"),
    (("--text", "{tmp}/t.txt", "--limit", "5"), "--limit applies to --tasks"),
    ((), "--text FILE"),
])
def test_eval_task_arguments_are_checked_first(args, needle, tmp_path, art, run_cli, no_rebuild):
    """Checked before lm_eval is even needed: these hold whether or not it is installed."""
    (tmp_path / "t.txt").write_text("some words\n" * 50)
    refused(run_cli("eval", art, *[a.format(tmp=tmp_path) for a in args]), needle)


@needs_lm_eval
@pytest.mark.parametrize("task,needle", [("no_such_task_xyz", "no such task"), ("mmlu", "groups and tags")])
def test_unknown_tasks_are_refused_before_the_model(task, needle, tmp_path, art, run_cli, no_rebuild):
    refused(run_cli("eval", art, "--tasks", task, "--tasks-data", tmp_path), f"--tasks {task}", needle)


def test_missing_lm_eval_names_the_extra(tmp_path, art, run_cli, no_rebuild, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    refused(run_cli("eval", art, "--tasks", "arc_easy", "--tasks-data", tmp_path),
            "pip install 'unionsparse[tasks]'")
