"""Layer-level quantization error on real SmolLM2-135M layers with real calibration activations.

For the linears of a few decoder blocks of the dense model: calibration statistics (x_sq_norm, H, a
token sample) from C4-sample windows, held-out inputs from WikiText-2 windows. Each layer is pruned
with Wanda 50 % and quantized by every configuration; the score is the relative output error
||X W_pᵀ - Y_q||² / ||X W_pᵀ||² on the held-out inputs (W_p the pruned fp32 weight, Y_q the
fake-quant layer's output, i.e. the kernels' arithmetic), so it isolates quantization from pruning.
All configurations see the same layers and inputs in one run.

    .venv/bin/python benchmarks/bench_quant_layers.py [--blocks 0,15,29] [--nsamples 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import DATA, GGUF, RESULTS, configurations, versions  # noqa: E402


def main() -> None:
    from transformers import AutoTokenizer
    from unionsparse.compressor import pruning
    from unionsparse.compressor.calibrate.samples import load_calibration
    from unionsparse.compressor.evaluate.perplexity import load_eval_text, tokenize_eval_text
    from unionsparse.compressor.model.loading import block_linears, find_blocks, load_model
    from unionsparse.compressor.quantize.layer import QuantSpec, TokenSampler, quantize_layer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="0,15,29")
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=2)
    ap.add_argument("--out", default="quant_layers")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(str(GGUF)).model
    tok = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    blocks, prefix = find_blocks(model)
    chosen = [int(b) for b in args.blocks.split(",")]
    layers = {f"{prefix}.{b}.{n}": m for b in chosen for n, m in block_linears(blocks[b])}
    sq = {p: pruning.SqNormAccumulator(m.in_features) for p, m in layers.items()}
    hs = {p: pruning.HessianAccumulator(m.in_features) for p, m in layers.items()}
    samplers = {p: TokenSampler(max(1, 2048 // args.nsamples)) for p in layers}
    held: dict[str, list[torch.Tensor]] = {p: [] for p in layers}
    mode = {"v": "calib"}

    def hook(p):
        def f(_m, a, _o):
            x = a[0].detach()
            if mode["v"] == "calib":
                sq[p].add_batch(x)
                hs[p].add_batch(x)
                samplers[p].add_batch(x)
            else:
                held[p].append(x.reshape(-1, x.shape[-1]).float())
        return f

    handles = [m.register_forward_hook(hook(p)) for p, m in layers.items()]
    samples = load_calibration(str(DATA / "c4_sample.jsonl"), tok, args.nsamples, args.seqlen, seed=0)
    ids = tokenize_eval_text(tok, load_eval_text(DATA / "wikitext2_test.raw"))
    with torch.no_grad():
        for j in range(samples.shape[0]):
            model(samples[j : j + 1], use_cache=False)
        mode["v"] = "held"
        for j in range(args.eval_windows):
            model(ids[:, j * args.seqlen : (j + 1) * args.seqlen], use_cache=False)
    for h in handles:
        h.remove()

    cfgs = {k: v for k, v in configurations().items() if v["mode"]}
    sums = {k: {"num": 0.0, "den": 0.0, "rel": [], "seconds": 0.0} for k in cfgs}
    per_layer = {}
    with torch.no_grad():
        for p, mod in layers.items():
            w = mod.weight.detach().float().clone()
            mask = pruning.wanda(w, sq[p].x_sq_norm, 0.5)
            w = w * mask
            x = torch.cat(held[p])
            ref = x @ w.T
            den = float((ref * ref).sum())
            per_layer[p] = {}
            for name, cfg in cfgs.items():
                kw = {k: cfg[k] for k in ("gptq", "clip_search", "keep_outliers") if k in cfg}
                spec = QuantSpec.from_mode(cfg["mode"], **kw)
                t0 = time.perf_counter()
                ql = quantize_layer(w, spec, mask=mask, h=hs[p].H, x_sq_norm=sq[p].x_sq_norm,
                                    tokens=samplers[p].tokens())
                dt = time.perf_counter() - t0
                y = ql.module()(x).float()
                num = float(((y - ref) ** 2).sum())
                s = sums[name]
                s["num"] += num
                s["den"] += den
                s["rel"].append(num / den)
                s["seconds"] += dt
                per_layer[p][name] = {"rel_err": num / den, "seconds": dt,
                                      "act_clip": ql.activations.get("clip")}
            print(p, {n: round(v["rel_err"], 5) for n, v in per_layer[p].items()}, flush=True)
            write(args, layers, sums, per_layer)  # after every layer, so a cut-short run still leaves figures


def write(args: argparse.Namespace, layers: dict, sums: dict, per_layer: dict) -> None:
    summary = {n: {"rel_err_pooled": s["num"] / s["den"], "rel_err_mean": sum(s["rel"]) / len(s["rel"]),
                   "quant_seconds": s["seconds"]} for n, s in sums.items() if s["rel"]}
    res = {
        "benchmark": "quant_layers", "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": versions(),
        "command": " ".join(["python", "benchmarks/bench_quant_layers.py", *sys.argv[1:]]),
        "args": vars(args), "layers": list(layers), "summary": summary, "per_layer": per_layer,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(res, indent=2))
    lines = [
        "## Layer-level quantization error (SmolLM2-135M, Wanda 50 %)",
        "",
        f"Linears of blocks {args.blocks} ({len(per_layer)} of {len(layers)} layers done) of the dense "
        f"model; calibration {args.nsamples} C4-sample windows of {args.seqlen} tokens; held-out inputs: "
        f"{args.eval_windows} "
        f"WikiText-2 windows. Relative output error against the pruned fp32 layer, pooled over layers "
        f"(Σ‖err‖² / Σ‖ref‖²) and mean of per-layer ratios; quantization time summed over the layers. "
        f"Group size 128, activation clip calibrated per layer. One run, {res['machine']}.",
        "",
        "| configuration | pooled rel. error | mean rel. error | quantize s |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {n} | {v['rel_err_pooled']:.5f} | {v['rel_err_mean']:.5f} | {v['quant_seconds']:.1f} |"
              for n, v in summary.items()]
    lines += ["", f"Command: `{res['command']}`", ""]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
