"""Where an IE-BME launch spends its time, from per-CTA %globaltimer stamps (a GPU study, not a benchmark).

    python benchmarks/trace_iebme.py [--out DIR] [--ns 1,8] [--shapes 4096x4096,8192x8192,...]
        [--variants "SOURCE=old.cu;;CLUSTER=0"]  # launch_variants.py overrides, "" = as shipped

The kernel is a study build with IEBME_TRACE=1 (kernels/study.py): thread 0 of every CTA records the time at
entry, after the prologue (the CTA barrier passed, X staged), after warp 0's loop and at exit, and its SM. A CUDA
graph of R launches (weights rotated beyond L2, as ``bench``), each with its own trace buffer, is replayed;
per launch: span (first entry to last exit), the gap to the next launch's first entry, and over CTAs the
median prologue, loop and exit (split-K reduction) times and how late the last CTA starts and ends.
Writes DIR/iebme_trace_h200.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_variants import apply_overrides, parse_overrides  # noqa: E402 - beside this script

apply_overrides({"TRACE": "1"})  # every variant is built with per-CTA timestamps

SHAPES = "4096x4096,8192x8192,8192x29568,28672x8192,12288x49152"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--ns", default="1,8", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--launches", type=int, default=8)
    ap.add_argument("--variants", default=[{}], type=parse_overrides,
                    help="';'-separated KEY=VALUE[,KEY=VALUE] overrides")
    args = ap.parse_args()
    if args.launches < 3:
        ap.error("--launches must be at least 3 (gaps are measured between launches 1..R-1)")

    import cupy as cp
    import numpy as np
    from unionsparse.compressor.bench.kernels import n_copies, synth_layer
    from unionsparse.kernels import iebme_spmm as ks

    med = statistics.median
    rows = []
    for spec in args.shapes.split(","):
        m, k = (int(v) for v in spec.split("x"))
        one = synth_layer(m, k, 4, 0.5, "none", 128, 0)
        nb = int(one.values.nbytes + one.bitmaps.nbytes)
        layers = [one] + [synth_layer(m, k, 4, 0.5, "none", 128, i) for i in range(1, n_copies(nb))]
        for n, var in ((n, v) for n in args.ns for v in args.variants):
            tag = apply_overrides(var, keep=("TRACE",))
            p = ks.plan(one, n)
            chunk, grid = p.chunk, p.grid
            ctas = grid[0] * grid[1]
            r = args.launches
            x = cp.asarray(np.random.default_rng(n).integers(-8, 8, (n, one.tc * 64), dtype=np.int8))
            xs = cp.asarray(np.random.default_rng(n).random((n, one.n_groups), dtype=np.float32) + 0.5)
            y = cp.empty((n, m), dtype=cp.uint16)
            tr = cp.zeros((r, ctas, 5), dtype=cp.uint64)
            s = cp.cuda.Stream(non_blocking=True)
            # the trace build writes to the partial slot, which holds layer.dummy outside debug launches (perm-free
            # layers without a side product read no other pointer that holds it)
            ks.launch(replace(one, dummy=tr[0]), x, xs, y, stream=s)  # compile and warm outside the graph
            s.synchronize()
            with s:
                s.begin_capture()
                for i in range(r):
                    ks.launch(replace(layers[i % len(layers)], dummy=tr[i]), x, xs, y, stream=s)
                graph = s.end_capture()
            for _ in range(3):
                graph.launch(s)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(s)
            graph.launch(s)
            e1.record(s)
            e1.synchronize()
            per_launch_us = cp.cuda.get_elapsed_time(e0, e1) * 1e3 / r
            t = tr.get().astype(np.int64)
            spans, gaps, pro, loop, ext, late_start, tail = [], [], [], [], [], [], []
            for i in range(1, r):
                a = t[i]
                t0 = a[:, 0].min()
                spans.append((a[:, 3].max() - t0) / 1e3)
                if i + 1 < r:
                    gaps.append((t[i + 1][:, 0].min() - a[:, 3].max()) / 1e3)
                pro.append(med(a[:, 1] - a[:, 0]) / 1e3)
                loop.append(med(a[:, 2] - a[:, 1]) / 1e3)
                ext.append(med(a[:, 3] - a[:, 2]) / 1e3)
                late_start.append((a[:, 0].max() - t0) / 1e3)
                tail.append((a[:, 3].max() - np.median(a[:, 3])) / 1e3)
            row = {"M": m, "K": k, "N": n, "variant": tag, "grid": list(grid), "chunk": chunk, "ctas": ctas,
                   "per_launch_us": per_launch_us, "span_us": med(spans), "gap_us": med(gaps) if gaps else None,
                   "prologue_us": med(pro), "loop_us": med(loop), "exit_us": med(ext),
                   "last_entry_us": med(late_start), "tail_us": med(tail),
                   "sms_used": int(len(np.unique(t[1][:, 4])))}
            rows.append(row)
            print(f"{m}x{k} N={n} {tag} grid={grid} chunk={chunk}: {per_launch_us:.1f} us/launch, "
                  + ", ".join(f"{key[:-3]} {row[key]:.2f}" for key in ("span_us", "gap_us", "prologue_us", "loop_us",
                                                                       "exit_us", "last_entry_us", "tail_us")),
                  flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = cp.cuda.runtime.getDeviceProperties(0)
    opts = " ".join(f"--{name} {val}" for name, val in vars(args).items() if name != "out")
    meta = {"gpu": dev["name"].decode(), "cupy": cp.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": f"benchmarks/trace_iebme.py {opts}"}
    (out / "iebme_trace_h200.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
