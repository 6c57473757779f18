"""Write a synthetic LLaMA-shaped checkpoint (random weights) as sharded safetensors, one shard per block.

Used by ``bench_scale.py`` to compress a model larger than this machine's RAM. The weights are
N(0, 0.02) in float16; the folder holds ``config.json``, ``model-XXXXX-of-YYYYY.safetensors`` and
``model.safetensors.index.json`` exactly as ``save_pretrained`` would lay them out, so transformers and
the streaming loader both read it.

    python benchmarks/make_synthetic_checkpoint.py /tmp/synth --layers 24 --hidden 8192 --intermediate 28672
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float16",
        "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
    }


def block_shapes(i: int, hidden: int, intermediate: int, heads: int, kv_heads: int) -> dict[str, tuple]:
    hd = hidden // heads
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (hidden,),
        p + "post_attention_layernorm.weight": (hidden,),
        p + "self_attn.q_proj.weight": (hidden, hidden),
        p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
        p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
        p + "self_attn.o_proj.weight": (hidden, hidden),
        p + "mlp.gate_proj.weight": (intermediate, hidden),
        p + "mlp.up_proj.weight": (intermediate, hidden),
        p + "mlp.down_proj.weight": (hidden, intermediate),
    }


def random_tensor(shape: tuple, gen: torch.Generator, norm: bool) -> torch.Tensor:
    if norm:
        return torch.ones(shape, dtype=torch.float16)
    out = torch.empty(shape, dtype=torch.float16)
    flat = out.view(-1)
    step = 1 << 24  # fp32 scratch of 64 MiB at a time
    for s in range(0, flat.numel(), step):
        n = min(step, flat.numel() - s)
        flat[s : s + n] = torch.randn(n, generator=gen).mul_(0.02).half()
    return out


def write_checkpoint(folder: Path, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                     vocab: int, seed: int = 0) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    (folder / "config.json").write_text(json.dumps(llama_config(hidden, intermediate, layers, heads, kv_heads,
                                                                vocab), indent=2))
    shards: list[dict[str, tuple]] = [{"model.embed_tokens.weight": (vocab, hidden)}]
    shards += [block_shapes(i, hidden, intermediate, heads, kv_heads) for i in range(layers)]
    shards.append({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    n = len(shards)
    weight_map, total = {}, 0
    for j, spec in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{n:05d}.safetensors"
        tensors = {k: random_tensor(s, gen, norm=k.endswith("norm.weight")) for k, s in spec.items()}
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * 2
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return {"bytes": total, "shards": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--intermediate", type=int, default=28672)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.perf_counter()
    info = write_checkpoint(a.folder, a.layers, a.hidden, a.intermediate, a.heads, a.kv_heads, a.vocab,
                            a.seed)
    print(json.dumps({**info, "gib": info["bytes"] / 2**30, "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
