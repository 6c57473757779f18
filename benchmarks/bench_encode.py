"""Encode/decode throughput of IE-BME and Tiled-CBC on a 4096x4096 layer (single process, this machine).

    .venv/bin/python benchmarks/bench_encode.py [--size 4096] [--repeat 5]

Writes benchmarks/results/encode.json and encode.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from unionsparse.formats import iebme, tiled_cbc

RESULTS = Path(__file__).resolve().parent / "results"


def median_time(fn: Callable[[], object], repeat: int) -> float:
    """Median wall-clock seconds of ``repeat`` calls of ``fn`` (also ``bench_stack``'s timer)."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--sparsity", type=float, default=0.5)
    args = ap.parse_args()
    n = args.size
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, (n, n)).astype(np.int8)
    codes[rng.random((n, n)) < args.sparsity] = 0
    fp16 = (rng.standard_normal((n, n)) * (codes != 0)).astype(np.float16)
    perm = np.array([rng.permutation(16) for _ in range((n // 16) * (n // 64))])
    cases = {
        "ie-bme w4 (identity)": lambda: iebme.encode(codes, 4),
        "ie-bme w4 (per-tile perms)": lambda: iebme.encode(codes, 4, perm=perm),
        "tiled-cbc fp16": lambda: tiled_cbc.encode(fp16),
        "tiled-cbc w4": lambda: tiled_cbc.encode(codes, bits=4),
    }
    rows = []
    for name, enc in cases.items():
        m = enc()
        t_enc = median_time(enc, args.repeat)
        t_dec = median_time(m.decode, args.repeat)
        rows.append({"case": name, "encode_s": t_enc, "decode_s": t_dec,
                     "encode_weights_per_s": n * n / t_enc, "decode_weights_per_s": n * n / t_dec})
    meta = {"machine": platform.node(), "cpu": platform.processor() or platform.machine(),
            "python": sys.version.split()[0], "numpy": np.__version__,
            "command": "python benchmarks/bench_encode.py " + " ".join(sys.argv[1:]),
            "shape": [n, n], "sparsity": args.sparsity, "median_of": args.repeat}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "encode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# Encode throughput, {n}x{n}, {100 * args.sparsity:.0f}% sparsity, one process", "",
             f"`{meta['command']}` on {meta['machine']} (Python {meta['python']}, numpy {meta['numpy']}); "
             f"median of {args.repeat}.", "",
             "| case | encode s | encode Mweights/s | decode s | decode Mweights/s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['encode_s']:.3f} | {r['encode_weights_per_s'] / 1e6:.1f} | "
                     f"{r['decode_s']:.3f} | {r['decode_weights_per_s'] / 1e6:.1f} |")
    (RESULTS / "encode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
