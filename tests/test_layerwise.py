"""Layer-wise engine on tiny LLaMA / Qwen2 / OPT models built from configs (no hub)."""

from __future__ import annotations

import copy

import pytest
import torch
from unionsparse.compressor.calibrate import layerwise
from unionsparse.compressor.errors import UserError
from unionsparse.compressor.pruning import methods as pruning

transformers = pytest.importorskip("transformers")
from conftest import tiny_model  # noqa: E402


def _llama(seed: int = 0):
    return tiny_model("llama", hidden=64, vocab=128, seed=seed)


def _opt(seed: int = 0):
    return tiny_model("opt", hidden=64, vocab=128, seed=seed)


def _qwen2(seed: int = 0):
    return tiny_model("qwen2", hidden=64, vocab=128, seed=seed)


def _samples(n=4, seqlen=16, seed=1):
    return torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "build,final_norm",
    [(_llama, "model.norm"), (_qwen2, "model.norm"), (_opt, "model.decoder.final_layer_norm")],
)
def test_capture_and_forward_reproduce_hidden_states(build, final_norm):
    model = build()
    x = _samples()
    inps, kwargs = layerwise.capture_block_inputs(model, x)
    assert inps.shape == (4, 16, 64)
    with torch.no_grad():
        hs = model(x, output_hidden_states=True).hidden_states  # embeddings, block 0 out, final (normed)
    torch.testing.assert_close(inps, hs[0], rtol=0, atol=0)
    blocks, _ = layerwise.find_blocks(model)
    h = inps
    for i, block in enumerate(blocks):
        h = layerwise.forward_block(block, h, kwargs)
        if i + 1 < len(blocks):
            torch.testing.assert_close(h, hs[i + 1], rtol=1e-5, atol=1e-5)
    norm = model.get_submodule(final_norm)
    with torch.no_grad():
        torch.testing.assert_close(norm(h), hs[-1], rtol=1e-5, atol=1e-5)
    assert blocks[0].__class__.__name__.endswith("DecoderLayer")  # the catcher was removed


def test_collect_block_stats_match_direct_computation():
    model = _llama()
    x = _samples(n=3)
    inps, kwargs = layerwise.capture_block_inputs(model, x)
    block = layerwise.find_blocks(model)[0][0]
    outs = torch.empty_like(inps)
    stats = layerwise.collect_block_stats(block, None, inps, kwargs, kind="both", outs=outs)
    assert set(stats) == {n for n, _ in layerwise.block_linears(block)}
    with torch.no_grad():
        q_in = block.input_layernorm(inps).double()  # q/k/v share this input
    want_sq = (q_in**2).sum(1).mean(0)
    want_h = 2.0 / 3 * sum(s.T @ s for s in q_in)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        torch.testing.assert_close(stats[name].x_sq_norm.double(), want_sq, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stats[name].H.double(), want_h, rtol=1e-4, atol=1e-5)
    assert stats["mlp.down_proj"].x_sq_norm.shape == (128,) and stats["mlp.down_proj"].H.shape == (128, 128)
    torch.testing.assert_close(outs, layerwise.forward_block(block, inps, kwargs))
    assert not block._forward_hooks and not any(m._forward_hooks for m in block.modules())


def test_prune_model_wanda_uses_pruned_previous_blocks():
    model = _llama()
    manual = copy.deepcopy(model)
    x = _samples()
    masks = {}
    rep = layerwise.prune_model(
        model, x, "wanda", 0.5, on_layer=lambda p, m, k: masks.__setitem__(p, k.clone())
    )
    # manual sequential reference: block 1's statistics from the pruned block 0's outputs
    inps, kwargs = layerwise.capture_block_inputs(manual, x)
    blocks, prefix = layerwise.find_blocks(manual)
    for bi, block in enumerate(blocks):
        stats = layerwise.collect_block_stats(block, None, inps, kwargs, kind="wanda")
        for name, mod in layerwise.block_linears(block):
            mask = pruning.wanda(mod.weight, stats[name].x_sq_norm, 0.5)
            mod.weight.data[~mask] = 0
            assert torch.equal(mask, masks[f"{prefix}.{bi}.{name}"])
        inps = layerwise.forward_block(block, inps, kwargs)
    for (n, a), (_, b) in zip(model.named_parameters(), manual.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert len(rep.layers) == 14
    for v in rep.layers.values():
        assert v["sparsity"] == pytest.approx(0.5)
    # the dense model would have given block 1 different statistics (the test above is not vacuous)
    dense = _llama()
    d_inps, d_kw = layerwise.capture_block_inputs(dense, x)
    d_blocks = layerwise.find_blocks(dense)[0]
    d_in1 = layerwise.forward_block(d_blocks[0], d_inps, d_kw)
    d_stats = layerwise.collect_block_stats(d_blocks[1], ["mlp.down_proj"], d_in1, d_kw)
    p_stats = layerwise.collect_block_stats(
        blocks[1],
        ["mlp.down_proj"],
        layerwise.forward_block(blocks[0], layerwise.capture_block_inputs(manual, x)[0], kwargs),
        kwargs,
    )
    assert not torch.allclose(d_stats["mlp.down_proj"].x_sq_norm, p_stats["mlp.down_proj"].x_sq_norm)


@pytest.mark.parametrize("build", [_llama, _opt])
def test_prune_model_sparsegpt_and_nm(build):
    model = build()
    x = _samples()
    with torch.no_grad():
        dense_logits = model(x).logits
    rep = layerwise.prune_model(model, x, "sparsegpt", 0.5, blocksize=32)
    for path, v in rep.layers.items():
        W = model.get_submodule(path).weight
        assert v["zeros"] == int((W == 0).sum())
        assert v["sparsity"] >= 0.5 - 1e-9
    with torch.no_grad():
        assert torch.isfinite(model(x).logits).all()
        assert not torch.allclose(model(x).logits, dense_logits)
    m2 = build()
    layerwise.prune_model(m2, x, "wanda", 0.5, nm="2:4")
    for _, block in enumerate(layerwise.find_blocks(m2)[0]):
        for _, mod in layerwise.block_linears(block):
            nz = (mod.weight != 0).reshape(mod.weight.shape[0], -1, 4).sum(2)
            assert torch.all(nz <= 2)


def test_prune_model_owl_and_magnitude():
    model = _llama()
    rep = layerwise.prune_model(model, _samples(), "wanda", 0.5, profile="owl", owl_lambda=0.1)
    assert rep.outlier_ratios is not None and len(rep.block_sparsity) == 2
    assert sum(rep.block_sparsity) / 2 == pytest.approx(0.5)
    if rep.outlier_ratios[0] != rep.outlier_ratios[1]:
        assert max(rep.block_sparsity) - min(rep.block_sparsity) == pytest.approx(0.2)
    m2 = _llama()
    rep2 = layerwise.prune_model(m2, None, "magnitude", 0.25)  # needs no calibration data
    assert all(v["sparsity"] == pytest.approx(0.25, abs=0.02) for v in rep2.layers.values())
    with pytest.raises(UserError, match="calibration"):
        layerwise.prune_model(_llama(), None, "wanda", 0.5)
    with pytest.raises(UserError, match="--prune"):
        layerwise.prune_model(_llama(), None, "gptq", 0.5)


def test_compress_and_prune_model_prune_through_one_dispatch(llama_with_tokenizer, tmp_path, run_cli):
    """`compress --prune sparsegpt` and ``layerwise.prune_model`` on the same windows leave the same weights
    (SparseGPT moves the kept weights too, so the options and statistics must be the same)."""
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from unionsparse.compressor.artifact.store import Artifact
    from unionsparse.compressor.calibrate.samples import load_calibration

    model, calib = llama_with_tokenizer
    out = tmp_path / "s.zarr"
    res = run_cli("compress", model, "-o", out, "--prune", "sparsegpt", "--sparsity", "0.5", "--quant", "none",
                  "--format", "tiled-cbc", "--calib", calib, "--nsamples", "4", "--seqlen", "32", "--quiet")
    assert res.code == 0, res.err
    ref = AutoModelForCausalLM.from_pretrained(model).eval()
    samples = load_calibration(str(calib), AutoTokenizer.from_pretrained(model), 4, 32, 0)
    layerwise.prune_model(ref, samples, "sparsegpt", 0.5)
    art = Artifact(out)
    for name in art.layer_names:
        got = art.read_layer(name).encoding.decode()
        want = ref.get_submodule(name).weight.detach().to(torch.float16).numpy()
        np.testing.assert_array_equal(got, want, err_msg=name)


def _compress_counting_block_calls(monkeypatch, run_cli, model, out, *flags) -> int:
    """Run `compress`; return how many times a decoder block was called."""
    from transformers.models.llama import modeling_llama

    calls = [0]
    orig = modeling_llama.LlamaDecoderLayer.__call__

    def counted(self, *a, **kw):
        calls[0] += 1
        return orig(self, *a, **kw)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "__call__", counted)
    res = run_cli("compress", model, "-o", out, *flags, "--quiet")
    assert res.code == 0, res.err
    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "__call__", orig)
    return calls[0]


def test_one_forward_per_block_and_pass_serves_every_statistic(llama_with_tokenizer, tmp_path, monkeypatch, run_cli):
    """Wanda's x_sq_norm, the activation clip's token sample and, on the same text, the activation-sparsity
    counts come from one forward of each block per pass: 2 passes x n windows x blocks (the statistics of the
    block before it is compressed, then the compressed block advancing the stream, which the thresholds tap).
    A second copy of the text makes the thresholds' stream its own (n more per block, the last block's advance
    skipped) and gives the same artifact."""
    import shutil

    import numpy as np
    from unionsparse.compressor.artifact.store import Artifact

    model, calib = llama_with_tokenizer
    copy_of_calib = tmp_path / "copy.jsonl"
    shutil.copy(calib, copy_of_calib)
    n, blocks = 4, 2
    flags = ["--prune", "wanda", "--quant", "w4a4", "--format", "ie-bme", "--reorder", "none", "--calib", calib,
             "--nsamples", str(n), "--seqlen", "32"]
    assert _compress_counting_block_calls(monkeypatch, run_cli, model, tmp_path / "q.zarr", *flags) == \
        n * (2 * blocks - 1)  # the last block's outputs feed nothing
    teal = ["--prune", "wanda", "--quant", "w4a16", "--format", "tiled-cbc", "--act-sparsity", "0.3",
            "--calib", calib, "--nsamples", str(n), "--seqlen", "32"]
    shared = _compress_counting_block_calls(monkeypatch, run_cli, model, tmp_path / "s.zarr", *teal,
                                            "--act-sparsity-calib", calib)
    own = _compress_counting_block_calls(monkeypatch, run_cli, model, tmp_path / "o.zarr", *teal,
                                         "--act-sparsity-calib", copy_of_calib)
    assert (shared, own) == (2 * n * blocks, 3 * n * blocks - n)
    a, b = Artifact(tmp_path / "s.zarr"), Artifact(tmp_path / "o.zarr")
    for name in a.layer_names:
        ra, rb = a.read_layer(name), b.read_layer(name)
        assert ra.attrs["dp_threshold"] == rb.attrs["dp_threshold"], name
        for key, arr in ra.arrays().items():
            np.testing.assert_array_equal(arr, rb.arrays()[key], err_msg=f"{name} {key}")


def test_input_taps_feed_every_collector_from_one_hook_and_leave_none_behind():
    """One hook per tapped module feeds all its collectors; ``TokenTap`` (benchmarks) draws the same token
    sample as ``collect_block_stats(tokens=True)``; nothing stays registered."""
    from unionsparse.compressor.calibrate.statistics import InputTaps, TokenSampler
    from unionsparse.compressor.quantize.layer import TokenTap

    model = _llama()
    x = _samples()
    inps, kwargs = layerwise.capture_block_inputs(model, x)
    block = layerwise.find_blocks(model)[0][0]
    stats = layerwise.collect_block_stats(block, None, inps, kwargs, kind="both", tokens=True)
    tap = TokenTap([block], layerwise.block_linears, "b")
    with InputTaps() as taps:
        mod = dict(layerwise.block_linears(block))["mlp.up_proj"]
        s1, s2 = taps.add("up", mod, TokenSampler(4)), taps.add("up", mod, TokenSampler(4))
        assert len(mod._forward_hooks) == 2  # the tap's one hook, and TokenTap's
        layerwise.forward_block(block, inps, kwargs)
    assert torch.equal(s1.tokens(), s2.tokens()) and s1.tokens().shape == (4 * x.shape[0], mod.in_features)
    for name, _ in layerwise.block_linears(block):
        assert torch.equal(tap.pop(f"b.0.{name}"), stats[name].tokens), name
    assert all(not m._forward_hooks for m in block.modules())
