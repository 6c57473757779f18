"""On a GPU machine: compress a LLaMA-shaped model three ways and run `verify --backend cupy` on each.

    python benchmarks/gpu_verify_e2e.py OUTDIR

Proves the whole path (compress -> artifact -> GPU kernels against the CPU references) end to end;
writes OUTDIR/gpu_verify.json with each artifact's verify result and timings.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from unionsparse.compressor.verify.checks import verify

RUNS = {
    # the random model has no tokenizer to calibrate outlier channels with (--keep-outliers auto, the default)
    "iebme-w4a4": ["--format", "ie-bme", "--quant", "w4a4", "--reorder", "dp", "--keep-outliers", "0"],
    "iebme-w2a4": ["--format", "ie-bme", "--quant", "w2a4", "--reorder", "dp", "--keep-outliers", "0"],
    "cbc-fp16": ["--format", "tiled-cbc", "--quant", "none"],
    "cbc-w4a16": ["--format", "tiled-cbc", "--quant", "w4a16"],
}


def main() -> None:
    from unionsparse.compressor.cli import main as cli

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=512, max_position_embeddings=256)
    model_dir = out / "model"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    results = {}
    only = os.environ.get("VERIFY_ONLY")
    for name, flags in RUNS.items():
        if only and not name.startswith(only):
            continue
        art = out / f"{name}.zarr"
        t = time.perf_counter()
        try:
            cli(["compress", str(model_dir), "-o", str(art), "--quiet", "--overwrite", *flags])
        except SystemExit as e:
            assert e.code == 0, f"compress {name} exited {e.code}"
        t_c = time.perf_counter() - t
        t = time.perf_counter()
        res = verify(str(art), backend=os.environ.get("VERIFY_BACKEND", "cupy"), ns=[1, 8, 32])
        results[name] = {"ok": res.ok, "backend": res.backend, "layers": res.checked_layers,
                         "failures": res.failures[:20], "compress_s": t_c, "verify_s": time.perf_counter() - t}
        print(name, "OK" if res.ok else "FAILED", res.backend, res.checked_layers, res.failures[:3], flush=True)
    (out / "gpu_verify.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
