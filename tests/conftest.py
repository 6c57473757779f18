"""Shared fixtures: tiny real Hugging Face models written to disk, and a CLI runner."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("NUMBA_NUM_THREADS", "2")
# The suite's tiny random models have no tokenizer to calibrate with, and most tests are about other things than
# outlier channels: their CLI compresses keep none, as before `--keep-outliers auto` became the default (a flag
# or test_default_outliers.py, which clears this, overrides it). CompressConfig built in Python is not affected.
os.environ.setdefault("UNIONSPARSE_COMPRESS_KEEP_OUTLIERS", "0")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def tiny_model(arch: str, hidden: int = 128, vocab: int = 256, seed: int = 0):
    """A randomly initialised 2-block causal LM of a real architecture (llama, qwen2 or opt), in eval mode."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        OPTConfig,
        OPTForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, vocab_size=vocab,
                  max_position_embeddings=256)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(intermediate_size=2 * hidden, num_key_value_heads=2, **common)).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(intermediate_size=2 * hidden, num_key_value_heads=2, **common)).eval()
    if arch == "opt":
        return OPTForCausalLM(OPTConfig(ffn_dim=2 * hidden, word_embed_proj_dim=hidden, **common)).eval()
    raise ValueError(arch)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for arch in ("llama", "qwen2", "opt"):
        m = tiny_model(arch)
        m.save_pretrained(root / arch)
        out[arch] = root / arch
    return out


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(capsys):
    """Run the CLI in-process: returns (exit code, stdout, stderr)."""
    from unionsparse.compressor.cli import main

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        cap = capsys.readouterr()
        return Result(code, cap.out, cap.err)

    return run


def load_json(text: str) -> dict:
    return json.loads(text)


REFERENCE_FLAGS = ("--quiet", "--prune", "magnitude", "--quant", "w4a4", "--reorder", "dp")


def second_best_head(x, weight, tokens):
    """A planted fault for the lm_head op (``lm_head_greedy``): the right logits, each row's second-best token."""
    from unionsparse.kernels import lm_head

    logits = lm_head.lm_head_greedy_reference(x, weight, None)
    if tokens is not None:
        tokens.copy_(logits.topk(2, dim=-1).indices[:, 1])
    return logits


def assert_same_artifacts(a_path, b_path) -> None:
    """Two artifacts hold the same layers, dense tensors and index: every array equal, dtype included."""
    import numpy as np
    from unionsparse.compressor.artifact.store import Artifact

    a, b = Artifact(a_path), Artifact(b_path)
    assert a.layer_names == b.layer_names  # layer order in the index is the submission order
    for name in a.layer_names:
        ra, rb = a.read_layer(name).arrays(), b.read_layer(name).arrays()
        assert ra.keys() == rb.keys(), name
        for k in ra:
            assert ra[k].dtype == rb[k].dtype and np.array_equal(ra[k], rb[k]), (name, k)
    assert a.dense_names == b.dense_names
    for name in a.dense_names:
        x, y = a.read_dense(name), b.read_dense(name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    for key in ("layers", "dense", "tied", "config"):
        assert a.attrs[key] == b.attrs[key], key


@pytest.fixture(scope="session")
def reference_artifact(tmp_path_factory, model_dirs) -> Path:
    """The tiny LLaMA compressed single-process with REFERENCE_FLAGS (what other runs must equal)."""
    from unionsparse.compressor.cli import main

    out = tmp_path_factory.mktemp("reference") / "ref.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(model_dirs["llama"]), "-o", str(out), *REFERENCE_FLAGS])
    assert e.value.code == 0
    return out


@pytest.fixture(scope="session")
def llama_with_tokenizer(tmp_path_factory, model_dirs):
    """The tiny llama folder plus a byte-level tokenizer (256 tokens), so calibration can run."""
    import shutil

    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("llama_tok") / "llama"
    shutil.copytree(model_dirs["llama"], root)
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(root)
    rng = np.random.default_rng(0)
    words = ["the", "model", "weights", "sparse", "kernel", "tensor", "quantized", "layer", "input", "of"]
    calib = root.parent / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 200))}) + "\n" for _ in range(8)))
    return root, calib
