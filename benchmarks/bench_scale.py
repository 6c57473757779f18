"""Scale figures: peak RSS and wall time on a model larger than RAM, resume overhead, Dask speedup.

    python benchmarks/bench_scale.py big --model /tmp/h8/synth --budget-s 2400   # 2x-RAM streaming run
    python benchmarks/bench_scale.py resume                                       # resume overhead
    python benchmarks/bench_scale.py dask                                         # 1 vs 2 Dask workers

Each part merges its section into benchmarks/results/scale.json and rewrites scale.md. ``big`` runs the
real CLI in a child process, samples its RSS every second, takes the peak from the kernel (wait4
ru_maxrss, what /usr/bin/time -v reports) and stops it at the budget if it has not finished (the
partial store can be continued with --resume).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from unionsparse.compressor.artifact.ownership import remove_artifact

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CLI = str(Path(sys.executable).parent / "unionsparse")
sys.path.insert(0, str(HERE))


def machine() -> dict:
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"cpus": os.cpu_count(), "ram_gib": round(mem / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}


def completed_layers(partial: Path) -> int:
    n = 0
    for meta in (partial / "layers").glob("**/zarr.json"):
        try:
            attrs = json.loads(meta.read_text()).get("attributes", {})
        except (OSError, ValueError):
            continue
        n += bool(attrs.get("complete")) and "format" in attrs
    return n


def run_measured(args: list[str], budget_s: float, partial: Path | None = None, env=None) -> dict:
    """Run a command; sample RSS and progress; stop it at the budget. Returns time, peak RSS, timeline."""
    t0 = time.perf_counter()
    load0 = os.getloadavg()
    logs = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    p = subprocess.Popen(args, env=env, stdout=logs[0], stderr=logs[1], text=True)
    timeline, stopped = [], False
    last = -1.0
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        now = time.perf_counter() - t0
        if now > budget_s and not stopped:
            p.send_signal(signal.SIGINT)  # KeyboardInterrupt: the partial store stays for --resume
            stopped = True
        if now - last >= 30:
            try:
                status_text = Path(f"/proc/{p.pid}/status").read_text()
                rss = int(next(ln.split()[1] for ln in status_text.splitlines() if ln.startswith("VmRSS")))
            except (OSError, StopIteration):
                rss = 0
            timeline.append({"t": round(now, 1), "rss_gib": round(rss / 2**20, 3), "load1": os.getloadavg()[0],
                             "layers_done": completed_layers(partial) if partial else None})
            last = now
        time.sleep(1)
    p.returncode = os.waitstatus_to_exitcode(status)
    if partial is not None and partial.exists():
        timeline.append({"t": round(time.perf_counter() - t0, 1), "rss_gib": 0.0,
                         "layers_done": completed_layers(partial)})
    out, err = (f.seek(0) or f.read() for f in logs)
    return {"seconds": time.perf_counter() - t0, "peak_rss_gib": ru.ru_maxrss / 2**20,
            "cpu_user_s": ru.ru_utime, "cpu_sys_s": ru.ru_stime, "loadavg_start": load0, "loadavg_end": os.getloadavg(),
            "exit": p.returncode, "stopped_at_budget": stopped, "timeline": timeline,
            "stdout_tail": out[-400:], "stderr_tail": err[-400:]}


def part_big(a) -> dict:
    model = Path(a.model)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    out = Path(a.out)
    for p in (out, out.with_name(out.name + ".partial")):  # --out is the user's: only an artifact goes
        remove_artifact(p)
    cmd = [CLI, "compress", str(model), "-o", str(out), "--prune", "magnitude", "--sparsity", "0.5",
           "--quant", "w4a4", "--format", "ie-bme", "--reorder", a.reorder, "--keep-outliers", "0", "--quiet"]
    r = run_measured(cmd, a.budget_s, out.with_name(out.name + ".partial"))
    cfg = json.loads((model / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"] * 7
    done = n_layers if r["exit"] == 0 else (r["timeline"][-1]["layers_done"] if r["timeline"] else 0)
    res = {"command": " ".join(cmd), "model_bytes": size, "model_gib": size / 2**30, "config": cfg,
           "layers_total": n_layers, "layers_done": done, **r}
    if out.exists():
        res["artifact_bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return res


def tiny_model_dir(root: Path, hidden: int, inter: int, layers: int) -> Path:
    from make_synthetic_checkpoint import write_checkpoint

    d = root / f"synth_{hidden}_{layers}"
    write_checkpoint(d, layers, hidden, inter, max(1, hidden // 128), max(1, hidden // 128), 1024)
    return d


def cli(*args) -> float:
    t = time.perf_counter()
    subprocess.run([CLI, *map(str, args)], check=True, capture_output=True)
    return time.perf_counter() - t


def arrays_equal(a: Path, b: Path) -> bool:
    import numpy as np
    from unionsparse.compressor.artifact.store import Artifact

    x, y = Artifact(a), Artifact(b)
    if x.layer_names != y.layer_names:
        return False
    for n in x.layer_names:
        ra, rb = x.read_layer(n).arrays(), y.read_layer(n).arrays()
        if ra.keys() != rb.keys() or not all(np.array_equal(ra[k], rb[k]) for k in ra):
            return False
    return True


def part_resume(a) -> dict:
    root = Path(tempfile.mkdtemp(prefix="scale_resume_"))
    try:
        model = tiny_model_dir(root, a.hidden, 4 * a.hidden, a.layers)
        common = ["--prune", "magnitude", "--quant", "w4a4", "--reorder", "dp", "--keep-outliers", "0", "--quiet"]
        full = root / "full.zarr"
        t_full = cli("compress", model, "-o", full, *common)
        out = root / "res.zarr"
        partial = out.with_name(out.name + ".partial")
        target = a.layers * 7 // 2
        t0 = time.perf_counter()
        p = subprocess.Popen([CLI, "compress", str(model), "-o", str(out), *common])
        while p.poll() is None and completed_layers(partial) < target:
            time.sleep(0.2)
        p.send_signal(signal.SIGKILL)
        p.wait()
        t_first = time.perf_counter() - t0
        killed_at = completed_layers(partial)
        t_resume = cli("compress", model, "-o", out, *common, "--resume")
        return {"model": {"hidden": a.hidden, "layers": a.layers}, "uninterrupted_s": t_full,
                "killed_after_layers": killed_at, "first_part_s": t_first, "resume_s": t_resume,
                "interrupted_total_s": t_first + t_resume,
                "overhead_s": t_first + t_resume - t_full, "identical_arrays": arrays_equal(full, out)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def part_dask(a) -> dict:
    root = Path(tempfile.mkdtemp(prefix="scale_dask_"))
    try:
        model = tiny_model_dir(root, a.hidden, 4 * a.hidden, a.layers)
        common = ["--prune", "magnitude", "--quant", "w4a4", "--reorder", "dp", "--keep-outliers", "0", "--quiet"]
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        res = {"model": {"hidden": a.hidden, "layers": a.layers, "fp16_mb": size / 1e6}, "repeats": a.repeats,
               "loadavg": [os.getloadavg()]}
        res["inline_s"] = cli("compress", model, "-o", root / "inline.zarr", *common)
        runs: dict[int, list[float]] = {1: [], 2: []}
        for rep in range(a.repeats):  # interleaved, so drifting load from other jobs hits both alike
            for n in (1, 2):
                out = root / f"w{n}_{rep}.zarr"
                runs[n].append(cli("compress", model, "-o", out, *common, "--workers", n))
                res["loadavg"].append(os.getloadavg())
                res[f"workers_{n}_identical"] = (res.get(f"workers_{n}_identical", True)
                                                 and arrays_equal(root / "inline.zarr", out))
                shutil.rmtree(out, ignore_errors=True)
        for n in (1, 2):
            res[f"workers_{n}_runs_s"] = runs[n]
            res[f"workers_{n}_s"] = statistics.median(runs[n])
        res["speedup_2_vs_1"] = res["workers_1_s"] / res["workers_2_s"]
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _byte_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer (256 tokens) in ``folder`` plus a small C4-form calibration file."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    rng = random.Random(0)
    words = ["the", "model", "weights", "sparse", "kernel", "tensor", "quantized", "layer", "input", "of"]
    calib = folder.parent / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": " ".join(rng.choices(words, k=400))}) + "\n" for _ in range(16)))
    return calib


LOADED_COMPRESS = """import sys
from unionsparse.compressor import pipeline
from unionsparse.compressor.cli import main
from unionsparse.compressor.model.loading import load_model
pipeline.open_model = lambda src, streaming=True, **kw: load_model(src)  # the non-streaming path
main(sys.argv[1:])
"""


def part_calib(a) -> dict:
    """Peak RSS of a calibrated (Wanda) run, streamed vs the model loaded fully, same artifact."""
    root = Path(tempfile.mkdtemp(prefix="scale_calib_"))
    try:
        from make_synthetic_checkpoint import write_checkpoint

        model = root / "model"
        write_checkpoint(model, a.layers, a.hidden, 4 * a.hidden, max(1, a.hidden // 128), max(1, a.hidden // 128),
                         256)
        calib = _byte_tokenizer(model)
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        common = ["--prune", "wanda", "--quant", "w4a4", "--reorder", "none", "--calib", str(calib),
                  "--nsamples", str(a.nsamples), "--seqlen", str(a.seqlen), "--quiet"]
        res = {"model": {"hidden": a.hidden, "layers": a.layers, "fp16_mb": size / 1e6},
               "flags": common[:-1], "loadavg_start": os.getloadavg()}
        for label, pre in (("streamed", [CLI]), ("loaded", [sys.executable, "-c", LOADED_COMPRESS])):
            out = root / f"{label}.zarr"
            r = run_measured([*pre, "compress", str(model), "-o", str(out), *common], 1e9)
            if r["exit"] != 0:
                raise RuntimeError(f"{label} run failed: {r['stderr_tail']}")
            res[label] = {k: r[k] for k in ("seconds", "peak_rss_gib", "cpu_user_s", "cpu_sys_s")}
        res["identical_arrays"] = arrays_equal(root / "streamed.zarr", root / "loaded.zarr")
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def write_md(data: dict) -> None:
    lines = ["# Scale and reliability", "", f"Machine: {data.get('machine')}", ""]
    for key in sorted(k for k in data if k.startswith("big")):  # big, plus kept earlier runs (big_*)
        b = data[key]
        lines += [f"## Streaming a model larger than RAM ({key})", "",
                  f"`{b['command']}`", "",
                  f"- checkpoint: {b['model_gib']:.1f} GiB fp16 safetensors "
                  f"({b['config']['num_hidden_layers']} blocks, hidden {b['config']['hidden_size']}, "
                  f"intermediate {b['config']['intermediate_size']}); RAM {data['machine']['ram_gib']} GiB",
                  f"- peak RSS: **{b['peak_rss_gib']:.2f} GiB** (kernel ru_maxrss)",
                  f"- CPU time: {b.get('cpu_user_s', 0):.0f} s user + {b.get('cpu_sys_s', 0):.0f} s system; "
                  f"load average (1 min) {b.get('loadavg_start', ['?'])[0]} at the start, "
                  f"{b.get('loadavg_end', ['?'])[0]} at the end",
                  f"- artifact: {b.get('artifact_bytes', 0) / 2**30:.2f} GiB on disk",
                  f"- wall time: {b['seconds']:.0f} s for {b['layers_done']} of {b['layers_total']} layers"
                  + (" (stopped at the budget; --resume continues)" if b["stopped_at_budget"] else ""),
                  ""]
    r = data.get("resume")
    if r:
        lines += ["## Resume", "",
                  f"- uninterrupted {r['uninterrupted_s']:.1f} s; SIGKILL after "
                  f"{r['killed_after_layers']} layers then --resume: {r['first_part_s']:.1f} + "
                  f"{r['resume_s']:.1f} s = {r['interrupted_total_s']:.1f} s "
                  f"(overhead {r['overhead_s']:.1f} s, mostly process start-up); arrays identical: "
                  f"{r['identical_arrays']}", ""]
    c = data.get("calib")
    if c:
        lines += ["## Calibrated run, streamed vs loaded", "",
                  f"- model hidden {c['model']['hidden']}, {c['model']['layers']} blocks, "
                  f"{c['model']['fp16_mb']:.0f} MB fp16; `{' '.join(c['flags'])}`",
                  f"- streamed: peak RSS **{c['streamed']['peak_rss_gib']:.2f} GiB**, "
                  f"{c['streamed']['seconds']:.1f} s; loaded fully: peak RSS "
                  f"{c['loaded']['peak_rss_gib']:.2f} GiB, {c['loaded']['seconds']:.1f} s; identical arrays: "
                  f"{c['identical_arrays']}", ""]
    for key in sorted(k for k in data if k.startswith("dask")):  # dask, plus kept earlier runs (dask_*)
        d = data[key]
        loads = [round(x[0], 1) for x in d.get("loadavg", [])]
        size = f", {d['model']['fp16_mb']:.0f} MB fp16" if "fp16_mb" in d["model"] else ""
        lines += [f"## Dask ({key})", "",
                  f"- model hidden {d['model']['hidden']}, {d['model']['layers']} blocks{size}, --reorder dp: "
                  f"inline {d['inline_s']:.1f} s, 1 worker {d['workers_1_s']:.1f} s, "
                  f"2 workers {d['workers_2_s']:.1f} s"
                  + (f" (median of {d['repeats']}: {[round(x, 1) for x in d['workers_1_runs_s']]} / "
                     f"{[round(x, 1) for x in d['workers_2_runs_s']]})"
                     if "repeats" in d else "")
                  + f": speedup 2 vs 1 workers **{d['speedup_2_vs_1']:.2f}x**; identical arrays: "
                  f"{d['workers_1_identical'] and d['workers_2_identical']}"
                  + (f"; 1-min load average before each run: {loads}" if loads else ""), ""]
    (RESULTS / "scale.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    b = sub.add_parser("big")
    b.add_argument("--model", required=True)
    b.add_argument("--out", default="/tmp/h8/synth_out.zarr")
    b.add_argument("--reorder", default="dp")
    b.add_argument("--budget-s", type=float, default=2400)
    for name, hidden, layers in (("resume", 1024, 2), ("dask", 2048, 4), ("calib", 2048, 8)):
        s = sub.add_parser(name)
        s.add_argument("--hidden", type=int, default=hidden)
        s.add_argument("--layers", type=int, default=layers)
        s.add_argument("--repeats", type=int, default=2)
        s.add_argument("--nsamples", type=int, default=16)
        s.add_argument("--seqlen", type=int, default=256)
    a = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "scale.json"
    t0 = time.perf_counter()
    result = {"big": part_big, "resume": part_resume, "dask": part_dask, "calib": part_calib}[a.part](a)
    result["argv"] = sys.argv[1:]
    result["bench_seconds"] = time.perf_counter() - t0
    data = json.loads(path.read_text()) if path.exists() else {}  # read late: parts may run side by side
    data["machine"] = machine()
    data[a.part] = result
    path.write_text(json.dumps(data, indent=2))
    write_md(data)
    print(json.dumps(data[a.part], indent=2)[:3000])


if __name__ == "__main__":
    main()
