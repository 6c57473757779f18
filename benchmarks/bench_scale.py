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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
        if now - last >= 5:
            try:
                status_text = Path(f"/proc/{p.pid}/status").read_text()
                rss = int(next(ln.split()[1] for ln in status_text.splitlines() if ln.startswith("VmRSS")))
            except (OSError, StopIteration):
                rss = 0
            timeline.append({"t": round(now, 1), "rss_gib": round(rss / 2**20, 3),
                             "layers_done": completed_layers(partial) if partial else None})
            last = now
        time.sleep(1)
    p.returncode = os.waitstatus_to_exitcode(status)
    if partial is not None and partial.exists():
        timeline.append({"t": round(time.perf_counter() - t0, 1), "rss_gib": 0.0,
                         "layers_done": completed_layers(partial)})
    out, err = (f.seek(0) or f.read() for f in logs)
    return {"seconds": time.perf_counter() - t0, "peak_rss_gib": ru.ru_maxrss / 2**20,
            "exit": p.returncode, "stopped_at_budget": stopped, "timeline": timeline,
            "stdout_tail": out[-400:], "stderr_tail": err[-400:]}


def part_big(a) -> dict:
    model = Path(a.model)
    size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    out = Path(a.out)
    for p in (out, out.with_name(out.name + ".partial")):
        shutil.rmtree(p, ignore_errors=True)
    cmd = [CLI, "compress", str(model), "-o", str(out), "--prune", "magnitude", "--sparsity", "0.5",
           "--quant", "w4a4", "--format", "ie-bme", "--reorder", a.reorder, "--quiet"]
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
    from unionsparse.compressor.artifact import Artifact

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
        common = ["--prune", "magnitude", "--quant", "w4a4", "--reorder", "dp", "--quiet"]
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
        common = ["--prune", "magnitude", "--quant", "w4a4", "--reorder", "dp", "--quiet"]
        res = {"model": {"hidden": a.hidden, "layers": a.layers}}
        res["inline_s"] = cli("compress", model, "-o", root / "inline.zarr", *common)
        for n in (1, 2):
            res[f"workers_{n}_s"] = cli("compress", model, "-o", root / f"w{n}.zarr", *common, "--workers", n)
            res[f"workers_{n}_identical"] = arrays_equal(root / "inline.zarr", root / f"w{n}.zarr")
        res["speedup_2_vs_1"] = res["workers_1_s"] / res["workers_2_s"]
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def write_md(data: dict) -> None:
    lines = ["# Scale and reliability", "", f"Machine: {data.get('machine')}", ""]
    b = data.get("big")
    if b:
        lines += ["## Streaming a model larger than RAM", "",
                  f"`{b['command']}`", "",
                  f"- checkpoint: {b['model_gib']:.1f} GiB fp16 safetensors "
                  f"({b['config']['num_hidden_layers']} blocks, hidden {b['config']['hidden_size']}, "
                  f"intermediate {b['config']['intermediate_size']}); RAM {data['machine']['ram_gib']} GiB",
                  f"- peak RSS: **{b['peak_rss_gib']:.2f} GiB** (kernel ru_maxrss)",
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
    d = data.get("dask")
    if d:
        lines += ["## Dask", "",
                  f"- model hidden {d['model']['hidden']}, {d['model']['layers']} blocks, --reorder dp: "
                  f"inline {d['inline_s']:.1f} s, 1 worker {d['workers_1_s']:.1f} s, "
                  f"2 workers {d['workers_2_s']:.1f} s: "
                  f"speedup 2 vs 1 workers **{d['speedup_2_vs_1']:.2f}x**; identical arrays: "
                  f"{d['workers_1_identical'] and d['workers_2_identical']}", ""]
    (RESULTS / "scale.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    b = sub.add_parser("big")
    b.add_argument("--model", required=True)
    b.add_argument("--out", default="/tmp/h8/synth_out.zarr")
    b.add_argument("--reorder", default="dp")
    b.add_argument("--budget-s", type=float, default=2400)
    for name in ("resume", "dask"):
        s = sub.add_parser(name)
        s.add_argument("--hidden", type=int, default=1024)
        s.add_argument("--layers", type=int, default=2)
    a = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "scale.json"
    t0 = time.perf_counter()
    result = {"big": part_big, "resume": part_resume, "dask": part_dask}[a.part](a)
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
