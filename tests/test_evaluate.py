"""Perplexity (WikiText-2 style) and the calibrated compress path end to end on a tiny model folder."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
from unionsparse.compressor.errors import UserError
from unionsparse.compressor.evaluate import perplexity as evaluate

transformers = pytest.importorskip("transformers")
from conftest import tiny_model  # noqa: E402

WORDS = [f"w{i}" for i in range(120)]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def _model():
    return tiny_model("llama", hidden=64, vocab=128)


def test_eval_text_rows_joined_like_the_reference(tmp_path):
    p = tmp_path / "t.raw"
    p.write_bytes(b" = Title = \r\n first row .\r\n\r\n second row\r\n")
    assert evaluate.load_eval_text(p) == " = Title = \n\n\n first row .\n\n\n second row\n"
    q = tmp_path / "lf.raw"
    q.write_text(" = Title = \n first row .\n\n second row")  # LF, no final newline: same rows
    assert evaluate.load_eval_text(q) == evaluate.load_eval_text(p)


def test_perplexity_matches_manual_windows(tmp_path):
    r = random.Random(0)
    p = tmp_path / "t.raw"
    p.write_text("\n".join(" ".join(r.choice(WORDS) for _ in range(30)) for _ in range(10)) + "\n")
    tok, model = _tokenizer(), _model()
    ids = tok(evaluate.load_eval_text(p))["input_ids"]
    seqlen = 32
    n = len(ids) // seqlen
    with torch.no_grad():
        losses = []
        for i in range(n):
            x = torch.tensor([ids[i * seqlen : (i + 1) * seqlen]])
            logp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
            losses.append(-logp.gather(1, x[0, 1:, None]).mean().item())
    want = math.exp(sum(losses) / n)
    assert evaluate.perplexity(model, tok, p, seqlen=seqlen) == pytest.approx(want, rel=1e-5)
    want2 = math.exp(sum(losses[:2]) / 2)
    assert evaluate.perplexity(model, tok, p, seqlen=seqlen, max_windows=2) == pytest.approx(want2, rel=1e-5)
    with pytest.raises(UserError, match="fewer than --seqlen"):
        evaluate.perplexity(model, tok, p, seqlen=100_000)


def test_eval_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        evaluate.load_eval_text(tmp_path / "missing.raw")
    (tmp_path / "blank.raw").write_text("\n \r\n")
    with pytest.raises(UserError, match="no text"):
        evaluate.load_eval_text(tmp_path / "blank.raw")
    (tmp_path / "bin.raw").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(UserError, match="UTF-8"):
        evaluate.load_eval_text(tmp_path / "bin.raw")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    _model().save_pretrained(d / "model")
    _tokenizer().save_pretrained(d / "model")
    r = random.Random(0)
    lines = "".join(
        json.dumps({"text": " ".join(r.choice(WORDS) for _ in range(50))}) + "\n" for _ in range(20)
    )
    (d / "calib.jsonl").write_text(lines)
    (d / "eval.raw").write_text("\n".join(" ".join(r.choice(WORDS) for _ in range(40)) for _ in range(20)))
    return d


@pytest.mark.parametrize(
    "extra",
    [
        ["--prune", "wanda"],
        ["--prune", "sparsegpt", "--nm", "2:4"],
        ["--prune", "wanda", "--sparsity-profile", "owl"],
    ],
)
def test_compress_with_calibration_end_to_end(model_dir, tmp_path, extra, run_cli):
    from unionsparse.compressor.artifact.store import Artifact

    out = tmp_path / "o.zarr"
    r = run_cli("compress", model_dir / "model", "-o", out, "--calib", model_dir / "calib.jsonl", "--nsamples", "4",
                "--seqlen", "16", "--reorder", "none", "--quiet", *extra)
    assert r.code == 0
    attrs = Artifact(out).attrs
    assert attrs["calibration"]["mode"] == "documents" and attrs["calibration"]["documents"] == 20
    bs = attrs["block_sparsity"]
    assert sum(bs) / len(bs) == pytest.approx(0.5)
    if "owl" in extra:
        assert len(attrs["calibration"]["owl_outlier_ratios"]) == 2
    assert 0.45 < attrs["summary"]["sparsity"] < 0.56


def test_compress_bad_calib_file_exit_2(model_dir, tmp_path, run_cli):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    out = tmp_path / "o.zarr"
    r = run_cli("compress", model_dir / "model", "-o", out, "--prune", "wanda", "--calib", bad, "--nsamples", "2",
                "--seqlen", "8", "--quiet")
    assert r.code == 2
    assert "bad.jsonl" in r.err and "'text'" in r.err and "Traceback" not in r.err
    assert not out.exists()


def test_eval_cli_on_model_folder(model_dir, run_cli):
    r = run_cli("eval", model_dir / "model", "--text", model_dir / "eval.raw", "--seqlen", "32", "--json")
    assert r.code == 0
    res = json.loads(r.out)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "model").eval()
    want = evaluate.perplexity(model, _tokenizer(), model_dir / "eval.raw", seqlen=32)
    assert res["ppl"] == pytest.approx(want, rel=1e-5) and res["windows"] >= 1
    # the time split: loading (and tokenizing) apart from the forwards, together the whole
    assert res["load_seconds"] > 0 and res["windows_seconds"] > 0
    assert res["load_seconds"] + res["windows_seconds"] == pytest.approx(res["seconds"], abs=0.05)


def test_eval_times_the_first_window_apart(model_dir, monkeypatch):
    """first_window_seconds (a GPU compiles its kernels there) and the steady time per later window, from windows
    paced at 0.4 s then 0.05 s each (the real forwards are replaced; only the timing is under test; the bounds
    leave a loaded machine's sleeps room and still fail on the first window's end taken from the last)."""
    import time

    from unionsparse.compressor.evaluate import perplexity as ppl_mod

    def paced(model, ids, seqlen, max_windows, device, progress):
        pauses = (0.4, 0.05, 0.05, 0.05, 0.05)
        progress(len(pauses))
        for pause in pauses:
            time.sleep(pause)
            progress(0)
        return [1.0] * len(pauses)

    monkeypatch.setattr(ppl_mod, "window_nlls", paced)
    res = ppl_mod.evaluate_source(model_dir / "model", model_dir / "eval.raw", seqlen=32, quiet=True)
    assert res["first_window_seconds"] == pytest.approx(0.4, abs=0.08)
    assert res["later_window_seconds"] == pytest.approx(0.05, abs=0.04)
    assert res["windows_seconds"] == pytest.approx(0.6, abs=0.15)


@pytest.mark.parametrize("quant", ["none", "w4a16", "w4a4"])
def test_eval_on_artifact_rebuilds_stored_weights(model_dir, tmp_path, quant, run_cli):
    from unionsparse.compressor.calibrate import layerwise
    from unionsparse.formats.arithmetic import weights as q

    out = tmp_path / f"{quant}.zarr"
    fmt = ["--format", "tiled-cbc"] if quant == "none" else []
    r = run_cli("compress", model_dir / "model", "-o", out, "--prune", "magnitude", "--quant", quant, "--reorder",
                "none", "--quiet", *fmt)
    assert r.code == 0
    res = evaluate.evaluate_source(out, model_dir / "eval.raw", seqlen=32, tokenizer=model_dir / "model")
    assert res["kind"] == "artifact"
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "model").eval()
    layerwise.prune_model(ref, None, "magnitude", 0.5)
    if quant == "w4a16":  # the rebuilt weights are the stored code * scale
        for block in layerwise.find_blocks(ref)[0]:
            for _, lin in layerwise.block_linears(block):
                lin.weight.data = torch.from_numpy(
                    q.rtn(lin.weight.data, 4, min(128, lin.in_features)).dequantize()
                )
    want = evaluate.perplexity(ref, _tokenizer(), model_dir / "eval.raw", seqlen=32)
    # fp16 storage (none) and fp16 output rounding: close; W4A4 also quantizes activations
    assert res["ppl"] == pytest.approx(want, rel=1e-3 if quant != "w4a4" else 0.05)


def test_compress_tiled_cbc_dynamic_pruning_thresholds(model_dir, tmp_path, run_cli):
    """--dp-sparsity stores per layer tau = the |x| quantile of that layer's calibration inputs."""
    from unionsparse.compressor.artifact.store import Artifact
    from unionsparse.kernels.tiled_cbc_reference import spmspv_reference

    out = tmp_path / "dp.zarr"
    r = run_cli("compress", model_dir / "model", "-o", out, "--calib", model_dir / "calib.jsonl", "--nsamples", "4",
                "--seqlen", "16", "--prune", "wanda", "--format", "tiled-cbc", "--quant", "none", "--dp-sparsity",
                "0.3", "--dp-calib", model_dir / "calib.jsonl", "--quiet")
    assert r.code == 0
    art = Artifact(out)
    taus = [art.layer_attrs(n)["dp_threshold"] for n in art.layer_names]
    assert all(isinstance(t, float) and t > 0 for t in taus)
    assert len(set(taus)) > 1  # per layer, not one global value
    # tau prunes the stated fraction of a layer's input distribution: check on the first layer's own inputs
    rec = art.read_layer(art.layer_names[0])
    x = np.random.default_rng(0).standard_normal(rec.encoding.shape[1]).astype(np.float16)
    y_all = spmspv_reference(rec.encoding, x, None)
    y_dp = spmspv_reference(rec.encoding, x, taus[0])
    assert not np.array_equal(y_all, y_dp)  # the threshold really skips columns

