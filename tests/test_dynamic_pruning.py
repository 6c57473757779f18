"""Tiled-CBC dynamic pruning end to end: thresholds in compress (any pruning, uniform and greedy), and
eval applying them token by token exactly as the spMspV kernel (checked against its CPU reference)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from unionsparse.compressor.evaluate import perplexity as evaluate
from unionsparse.kernels import available

transformers = pytest.importorskip("transformers")
from conftest import tiny_model  # noqa: E402

WORDS = [f"w{i}" for i in range(120)]
CALIB = ("--nsamples", "4", "--seqlen", "16")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny matmuls: with 2 shared cores, torch's thread pool costs ~1 ms a call; one thread ~40 us."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    tiny_model("llama", hidden=64, vocab=128, seed=1).save_pretrained(d / "model")
    _tokenizer().save_pretrained(d / "model")
    r = random.Random(1)
    calib = "".join(json.dumps({"text": " ".join(r.choice(WORDS) for _ in range(50))}) + "\n" for _ in range(20))
    (d / "calib.jsonl").write_text(calib)
    (d / "eval.raw").write_text("\n".join(" ".join(r.choice(WORDS) for _ in range(40)) for _ in range(10)))
    return d


def _compress(model_dir, out, *flags) -> None:
    from unionsparse.compressor.cli import main

    with pytest.raises(SystemExit) as e:
        main(["compress", str(model_dir / "model"), "-o", str(out), "--format", "tiled-cbc", "--quiet",
              "--dp-calib", str(model_dir / "calib.jsonl"), *CALIB, *flags])
    assert e.value.code == 0


@pytest.fixture(scope="module")
def magnitude_dp(model_dir, tmp_path_factory):
    """Magnitude 50% + uniform dynamic 30%, fp16 values."""
    out = tmp_path_factory.mktemp("art") / "mag_dp.zarr"
    _compress(model_dir, out, "--prune", "magnitude", "--quant", "none", "--dp-sparsity", "0.3")
    return out


def _layer_inputs(model, samples) -> dict[str, list[torch.Tensor]]:
    xs: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda _m, a, _o, n=n: xs.setdefault(n, []).append(a[0].detach().clone()))
             for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    with torch.no_grad():
        for j in range(samples.shape[0]):
            model(samples[j : j + 1], use_cache=False)
    for h in hooks:
        h.remove()
    return xs


def test_magnitude_dp_thresholds_are_quantiles_of_the_pruned_models_inputs(model_dir, magnitude_dp):
    """--dp-sparsity works without Wanda/SparseGPT; tau = the |fp16 x| quantile through the pruned model."""
    from unionsparse.compressor.activation_sparsity.thresholds import tau_from_samples
    from unionsparse.compressor.artifact.store import Artifact
    from unionsparse.compressor.calibrate import layerwise
    from unionsparse.compressor.calibrate import samples as calibration

    art = Artifact(magnitude_dp)
    assert art.attrs["dynamic_pruning"]["dp_profile"] == "uniform"
    samples = calibration.load_calibration(str(model_dir / "calib.jsonl"), _tokenizer(), 4, 16, 0)
    dense = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "model").eval()
    dense_x = _layer_inputs(dense, samples)
    layerwise.prune_model(dense, None, "magnitude", 0.5)  # the same masks as compress
    pruned_x = _layer_inputs(dense, samples)
    moved = 0
    for name in art.layer_names:
        a = art.layer_attrs(name)
        assert a["dp_sparsity"] == 0.3 and a["dp_profile"] == "uniform"
        x16 = torch.cat(pruned_x[name]).to(torch.float16).float().numpy()
        want = tau_from_samples(x16, 0.3)
        assert a["dp_threshold"] == pytest.approx(want, rel=2e-3), name  # one fp16 step of slack
        assert a["dp_calib_sparsity"] == pytest.approx(0.3, abs=0.02)
        dense_tau = tau_from_samples(torch.cat(dense_x[name]).to(torch.float16).float().numpy(), 0.3)
        moved += abs(dense_tau - want) > 0.01 * want
    assert moved > 0  # pruning changes later layers' inputs: thresholds must come from the pruned model


def test_greedy_profile_is_wired_and_stored_per_layer(model_dir, tmp_path):
    from unionsparse.compressor.artifact.store import Artifact

    out = tmp_path / "greedy.zarr"
    _compress(model_dir, out, "--prune", "none", "--quant", "w4a16", "--group-size", "64", "--nsamples", "2",
              "--dp-sparsity", "0.25", "--dp-profile", "greedy")
    art = Artifact(out)
    assert art.attrs["dynamic_pruning"]["dp_profile"] == "greedy"
    assert art.attrs["config"]["act_sparsity_profile"] == "greedy"
    blocks: dict[str, list[tuple[float, int]]] = {}
    for name in art.layer_names:
        a = art.layer_attrs(name)
        assert a["dp_profile"] == "greedy" and isinstance(a["dp_threshold"], float) and a["dp_threshold"] >= 0
        assert 0.0 <= a["dp_sparsity"] <= 0.95
        assert a["dp_calib_sparsity"] >= a["dp_sparsity"] - 1e-12  # ceil(p n) of the calibration values
        m, k = a["shape"]
        blocks.setdefault(name.rsplit(".", 2)[0], []).append((a["dp_sparsity"], m * k))
    assert len(blocks) == 2
    for prof in blocks.values():  # TEAL's block average (parameter-weighted) lands on the target
        assert sum(s * w for s, w in prof) / sum(w for _, w in prof) == pytest.approx(0.25, abs=1e-9)
        assert len({round(s, 9) for s, _ in prof}) > 1  # not uniform


def _tiled_cbc_case(bits: int | None, seed: int = 0):
    from unionsparse.formats import tiled_cbc

    rng = np.random.default_rng(seed)
    M, K, g = 300, 40, 8  # padded in both directions
    if bits is None:
        w = (rng.standard_normal((M, K)) * (rng.random((M, K)) < 0.5)).astype(np.float16)
        return tiled_cbc.encode(w), w.astype(np.float32), None, None
    codes = (rng.integers(-7, 8, (M, K)) * (rng.random((M, K)) < 0.5)).astype(np.int8)
    scales = (rng.random((M, K // g)) + 0.5).astype(np.float16)
    w = codes.astype(np.float32) * np.repeat(scales.astype(np.float32), g, axis=1)
    return tiled_cbc.encode(codes, bits=4), w, scales, g


@pytest.mark.parametrize("bits", [None, 4])
def test_eval_layer_matches_the_spmspv_reference_token_by_token(bits):
    """The eval layer's active set is the kernel's (fp16 rounding, then |x| > tau in fp32), and its output
    is the reference's to float32 rounding, then fp16."""
    from unionsparse.formats.arithmetic.sparse_inputs import TiledCBCLinear
    from unionsparse.kernels.tiled_cbc_check import tolerance
    from unionsparse.kernels.tiled_cbc_reference import spmspv_reference

    m, w, scales, g = _tiled_cbc_case(bits)
    tau = 0.5
    rng = np.random.default_rng(1)
    X = rng.standard_normal((6, w.shape[1])).astype(np.float32)
    # at the threshold: 0.5 + 2^-14 rounds to 0.5 in fp16 (inactive in the kernel, active in a naive fp32
    # test); 0.5 + 2^-11 is the next fp16 value (active); -0.5 inactive
    X[0, :4] = [0.5 + 2.0**-14, 0.5 + 2.0**-11, -0.5, 0.5]
    X[1, :] = 0.5 + 2.0**-14
    layer = TiledCBCLinear(torch.from_numpy(w), tau)
    with torch.no_grad():
        got = layer(torch.from_numpy(X)).numpy()
    assert got.dtype == np.float32  # fp16-rounded values in the caller's dtype
    for t in range(X.shape[0]):
        ref = spmspv_reference(m, X[t], tau, scales, g).astype(np.float16).astype(np.float32)
        x16 = X[t].astype(np.float16).astype(np.float64)
        xa = np.where(np.abs(x16) > tau, x16, 0.0)
        tol = tolerance(w.astype(np.float64), xa[None, :], fp16_out=True)[0] * 2
        assert np.all(np.abs(got[t] - ref) <= tol), t
    assert np.array_equal(got[1], np.zeros(w.shape[0], dtype=np.float32))  # every input pruned
    # discriminating: one wrongly active column moves outputs far beyond the tolerance
    off = spmspv_reference(m, np.where(np.arange(w.shape[1]) == 0, 0.5, X[0]), -1.0, scales, g)
    assert np.abs(off - spmspv_reference(m, X[0], tau, scales, g)).max() > 0.05
    assert layer.measured_sparsity() == pytest.approx(
        float((np.abs(X.astype(np.float16).astype(np.float32)) <= tau).mean()))


def _reference_model(artifact):
    """The artifact's model with every linear replaced by per-token calls of the CPU spMspV reference."""
    from unionsparse.compressor.artifact.store import Artifact
    from unionsparse.compressor.model.modules import replace_linear
    from unionsparse.compressor.model.rebuild import rebuild_model
    from unionsparse.kernels.tiled_cbc_reference import spmspv_reference

    class RefLinear(torch.nn.Module):
        def __init__(self, rec):
            super().__init__()
            self.m, self.tau = rec.encoding, rec.attrs["dp_threshold"]
            self.k = rec.encoding.shape[1]

        def forward(self, x):
            rows = x.reshape(-1, self.k).double().numpy()
            y = np.stack([spmspv_reference(self.m, r, self.tau) for r in rows]).astype(np.float16)
            return torch.from_numpy(y.astype(np.float32)).reshape(*x.shape[:-1], -1)

    art = Artifact(artifact)
    model = rebuild_model(artifact, act_quant=False)  # plain linears, replaced below
    for name in art.layer_names:
        replace_linear(model, name, RefLinear(art.read_layer(name)))
    return model


def test_eval_with_dynamic_pruning_equals_the_reference_spmspv(model_dir, magnitude_dp, run_cli):
    """`eval` on a DP artifact = the model whose every layer is the kernel reference, token by token."""
    text = model_dir / "eval.raw"
    tok_dir = model_dir / "model"
    res = run_cli("eval", magnitude_dp, "--text", text, "--seqlen", "32", "--max-windows", "2", "--json",
                  "--tokenizer", tok_dir)
    assert res.code == 0, res.err
    got = json.loads(res.out)
    assert got["dynamic_pruning"]["layers"] == 14
    assert 0.1 < got["dynamic_pruning"]["measured_sparsity"] < 0.6  # calibrated at 0.3 on other text
    tok = _tokenizer()
    ref = evaluate.perplexity(_reference_model(magnitude_dp), tok, text, seqlen=32, max_windows=2)
    assert got["ppl"] == pytest.approx(ref, rel=1e-5)
    off = run_cli("eval", magnitude_dp, "--text", text, "--seqlen", "32", "--max-windows", "2", "--json",
                  "--no-dp", "--tokenizer", tok_dir)
    assert off.code == 0, off.err
    no_dp = json.loads(off.out)
    assert no_dp["dynamic_pruning"] is None
    assert abs(no_dp["ppl"] - got["ppl"]) > 100 * abs(got["ppl"] - ref)  # the check above discriminates


@pytest.mark.parametrize("flags, needle", [
    (["--format", "ie-bme", "--quant", "w4a4", "--dp-sparsity", "0.3"], "--format tiled-cbc"),
    (["--format", "tiled-cbc", "--quant", "w4a4", "--dp-sparsity", "0.3"], "--quant none or w4a16"),
    (["--format", "tiled-cbc", "--quant", "none", "--dp-profile", "greedy"], "--act-sparsity > 0"),
    (["--format", "tiled-cbc", "--quant", "none", "--dp-sparsity", "0.97", "--dp-profile", "greedy"], "0.95"),
    (["--format", "tiled-cbc", "--quant", "none", "--dp-sparsity", "0.3", "--dp-calib", "nope.jsonl"],
     "--act-sparsity-calib: file"),
    (["--format", "tiled-cbc", "--quant", "none", "--dp-sparsity", "1.5"], "--act-sparsity must lie"),
    (["--format", "tiled-cbc", "--quant", "none", "--dp-profile", "teal"], "--dp-profile"),
])
def test_bad_dynamic_pruning_combinations_exit_2(model_dir, tmp_path, run_cli, flags, needle):
    out = tmp_path / "x.zarr"
    res = run_cli("compress", model_dir / "model", "-o", out, "--prune", "magnitude", *flags)
    assert res.code == 2
    lines = res.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.err, res.err
    assert not out.exists() and not (tmp_path / "x.zarr.partial").exists()


def test_dp_calib_bad_file_content_names_the_flag(model_dir, tmp_path, run_cli):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    out = tmp_path / "x.zarr"
    res = run_cli("compress", model_dir / "model", "-o", out, "--format", "tiled-cbc", "--quant", "none",
                  "--prune", "magnitude", "--dp-sparsity", "0.3", "--dp-calib", bad, *CALIB, "--quiet")
    assert res.code == 2 and res.err.startswith("unionsparse: error: --act-sparsity-calib "), res.err
    assert not out.exists() and not (tmp_path / "x.zarr.partial").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not available(), reason="needs CuPy and a CUDA device")
def test_bench_times_a_tiled_cbc_artifacts_own_layers(magnitude_dp, run_cli):
    """`bench ARTIFACT` on Tiled-CBC: every layer, spMspV at N = 1 with the layer's calibrated dynamic
    sparsity and the SpMM above, beside cuBLAS."""
    from unionsparse.compressor.artifact.store import Artifact

    r = run_cli("bench", magnitude_dp, "--n", "1,16", "--json")
    assert r.code == 0, r.err
    data = json.loads(r.out)
    names = set(Artifact(str(magnitude_dp)).layer_names)
    assert {row["shape"] for row in data["rows"]} == names
    assert sorted({(row["N"], row["kernel"]) for row in data["rows"]}) == [(1, "spmspv"), (16, "spmm")]
    for row in data["rows"]:
        assert row["format"] == "tiled-cbc" and row["bits"] == 16
        assert row["tiled_cbc_us"] > 0 and row["cublas_us"] > 0 and row["speedup_vs_cublas"] > 0
        if row["N"] == 1:
            assert row["dp_sparsity"] == pytest.approx(0.3) and row["tiled_cbc_GBps"] > 0
    assert {int(n) for n in data["summary"]} == {1, 16}
    assert all(s["cases"] == len(names) for s in data["summary"].values())
