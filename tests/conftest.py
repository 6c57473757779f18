"""Shared fixtures: tiny real Hugging Face models written to disk, and a CLI runner."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def tiny_model(arch: str):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        OPTConfig,
        OPTForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
        return LlamaForCausalLM(cfg)
    if arch == "qwen2":
        cfg = Qwen2Config(hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)
        return Qwen2ForCausalLM(cfg)
    if arch == "opt":
        cfg = OPTConfig(hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                        max_position_embeddings=256, word_embed_proj_dim=128)
        return OPTForCausalLM(cfg)
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
