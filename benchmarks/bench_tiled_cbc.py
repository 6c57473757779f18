"""Tiled-CBC spMspV / SpMM beside cuBLAS fp16 on the H200 (the harness: ``unionsparse.compressor.bench.tiled_cbc``).

    python benchmarks/bench_tiled_cbc.py [--quick] [--no-spmm] [--no-spmspv] [--spmspv-bits 16,4]
        [--out benchmarks/results]

writes ``tiled_cbc_h200.json`` and ``tiled_cbc_h200.md`` under --out (--no-spmm: spMspV only, --no-spmspv:
SpMM only; --spmspv-bits: spMspV value types, fp16 and int4 by default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from unionsparse.compressor.bench.tiled_cbc import (
    SPINFER,
    SPMM_NS,
    SPMM_SHAPES,
    bench_spmm,
    bench_spmspv,
    copy_bandwidth,
    geomean,
    machine_info,
)


def write_md(res, path):
    L = [
        f"# Tiled-CBC kernels on {res['machine']['gpu']}",
        "",
        f"Command: `{res['command']}`  ",
        f"Machine: {res['machine']['nvidia_smi']}; CuPy {res['machine']['cupy']}, "
        f"torch {res['machine']['torch']}, CUDA runtime {res['machine']['cuda_runtime']}  ",
        f"Measured device-to-device copy: {res['copy_gbps']:.0f} GB/s (read + write).",
    ]
    if res.get("spmspv"):
        L += ["", "## spMspV (N = 1) vs cuBLAS fp16 GEMV (torch.matmul)", ""]
        for key, g in res["geomean_spmspv"].items():
            L.append(
                f"- {key}: geomean speedup **{g['best']:.2f}x** (v2, best of the tried launch settings), "
                f"{g['default']:.2f}x v2 default settings, {g['dp_off']:.2f}x v2 with dynamic pruning off"
                f"; median v2 bandwidth {g['median_gbps']:.0f} GB/s on the bytes it must read (n = {g['n_shapes']})"
            )
        L += [
            "",
            "| M | K | values | static | cuBLAS us | v2 best us | speedup | v2 default us | DP off us | "
            "v2 GB/s | cuBLAS GB/s | best w/d/chunk (sk: stream-K)/mode |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["spmspv"]:
            b = r.get("bits", 16)
            vals = "fp16" if b == 16 else f"int{b} (g{r.get('group')})"
            L.append(
                f"| {r['M']} | {r['K']} | {vals} | "
                f"{r['static']:.0%} | {r['t_cublas_us']:.1f} | {r['t_spmspv_us']:.1f} | "
                f"{r['speedup']:.2f} | {r['t_default_us']:.1f} | "
                f"{r['t_spmspv_dp_off_us']:.1f} | {r['gbps_spmspv']:.0f} | {r['gbps_cublas']:.0f} | "
                f"{r['best_warps']}/{r['best_stages']}/"
                f"{'sk' if r.get('best_streamk') else r['best_chunk']}/m{r['best_mode']} |"
            )
    if res.get("spmm"):
        L += [
            "",
            f"## SpMM (prefill, static {res['spmm'][0]['static']:.0%}) vs cuBLAS fp16 GEMM (F.linear)",
            "",
            f"`speedup` is the default method (`auto`: the warp-streamed kernel v3 up to N = "
            f"{res.get('warp_up_to_n', 0)}, on compute capability 9.0 the wgmma kernel v4 up to N = "
            f"{res.get('wgmma_up_to_n', 0)}, the fused v2 kernel below N = {res.get('dense_from_n', 128)} elsewhere, "
            "decode-once + cuBLAS from there on; the `auto` column names the method). v3 and v4 are timed with "
            "their default config for N (other v3 configs in the JSON).",
            "",
            "| M | K | N | cuBLAS us | warp v3 us | warp speedup | wgmma v4 us | wgmma speedup | fused v2 us | "
            "fused speedup | dense-path us | dense-path speedup | auto | speedup (auto) | "
            "cuBLAS TFLOP/s | fused TFLOP/s (dense-equiv.) | fused config |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in res["spmm"]:
            L.append(
                f"| {r['M']} | {r['K']} | {r['N']} | {r['t_cublas_us']:.1f} | {r.get('t_warp_us', float('nan')):.1f} | "
                f"{r.get('speedup_warp', float('nan')):.2f} | {r.get('t_wgmma_us', float('nan')):.1f} | "
                f"{r.get('speedup_wgmma', float('nan')):.2f} | {r['t_spmm_us']:.1f} | "
                f"{r['speedup_fused']:.2f} | {r['t_dense_path_us']:.1f} | {r['speedup_dense_path']:.2f} | "
                f"{r.get('auto_method', '')} | {r['speedup']:.2f} | "
                f"{r['tflops_cublas']:.0f} | {r['tflops_fused_dense_equiv']:.0f} | {tuple(r['best_config'])} |"
            )
        L += [
            "",
            "Geomean SpMM speedup by N (auto): "
            + ", ".join(f"N={n}: {g:.2f}x" for n, g in res["geomean_spmm"].items()),
        ]
        for label, key in (("Warp-streamed kernel (v3) alone", "geomean_spmm_warp"),
                           ("wgmma kernel (v4) alone", "geomean_spmm_wgmma"),
                           ("Fused kernel alone", "geomean_spmm_fused"),
                           ("Decode once + cuBLAS alone", "geomean_spmm_dense_path")):
            L += ["", f"{label}: " + ", ".join(f"N={n}: {g:.2f}x" for n, g in res.get(key, {}).items())]
    path.write_text("\n".join(L) + "\n")



def _log_spmspv_geomeans(res, log) -> None:
    for k, g in res["geomean_spmspv"].items():
        log(f"GEOMEAN spMspV {k}: {g['best']:.2f}x (default {g['default']:.2f}x, "
            f"dp-off {g['dp_off']:.2f}x, median {g['median_gbps']:.0f} GB/s, n={g['n_shapes']})")


def value_bits(text: str) -> list[int]:
    """argparse type for --spmspv-bits: 16, 4 or 2, separated by commas."""
    try:
        bits = [int(v) for v in text.split(",")]
    except ValueError:
        bits = []
    if not bits or any(b not in (16, 4, 2) for b in bits):
        raise argparse.ArgumentTypeError(f"expected 16, 4 or 2 separated by commas, got {text!r}")
    return bits


def token_counts(text: str) -> list[int]:
    """argparse type for --spmm-ns: positive integers separated by commas."""
    try:
        ns = [int(v) for v in text.split(",")]
    except ValueError:
        ns = []
    if not ns or min(ns) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return ns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 spMspV shapes, 2 SpMM shapes")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--no-spmm", action="store_true", help="skip the SpMM part (spMspV only)")
    ap.add_argument("--no-spmspv", action="store_true", help="skip the spMspV part (SpMM only)")
    ap.add_argument(
        "--spmspv-seconds", type=float, default=float("inf"), help="stop adding spMspV shapes after"
    )
    ap.add_argument("--spmm-seconds", type=float, default=float("inf"), help="stop adding SpMM shapes after")
    ap.add_argument("--spmm-ns", default=None, type=token_counts,
                    help="comma-separated token counts (default: all of SPMM_NS)")
    ap.add_argument("--spmspv-bits", default=[16, 4], type=value_bits,
                    help="spMspV value types, comma-separated: 16 (fp16), 4, 2 (codes, group 128); default 16,4")
    args = ap.parse_args(argv)
    import cupy as cp
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    res = dict(
        command="python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])), machine=machine_info(cp, torch)
    )
    res["copy_gbps"] = copy_bandwidth(cp)
    log(f"copy {res['copy_gbps']:.0f} GB/s")
    shapes = SPINFER[:4] if args.quick else SPINFER
    res["spmspv"] = []
    for b in [] if args.no_spmspv else args.spmspv_bits:
        res["spmspv"] += bench_spmspv(cp, torch, shapes, (0.5, 0.3), 0.3, log, deadline=t0 + args.spmspv_seconds,
                                      bits=b)
    res["geomean_spmspv"] = {}
    for b, s in [(b, s) for b in args.spmspv_bits for s in (0.5, 0.3)]:
        rr = [r for r in res["spmspv"] if r["static"] == s and r["bits"] == b]
        if rr:
            values = "" if b == 16 else f", int{b} values (group 128)"
            res["geomean_spmspv"][f"static {s:.0%} + dynamic 30%{values}"] = dict(
                best=geomean([r["speedup"] for r in rr]),
                default=geomean([r["speedup_default"] for r in rr]),
                dp_off=geomean([r["speedup_dp_off"] for r in rr]),
                median_gbps=float(np.median([r["gbps_spmspv"] for r in rr])),
                n_shapes=len(rr),
            )
    (out / "tiled_cbc_h200.json").write_text(json.dumps(res, indent=1))
    write_md(res, out / "tiled_cbc_h200.md")  # again below with the SpMM figures
    _log_spmspv_geomeans(res, log)
    if not args.no_spmm:
        sh = SPMM_SHAPES[:2] if args.quick else SPMM_SHAPES
        from unionsparse.kernels.tiled_cbc_spmm import DENSE_FROM_N, V3_MAX_N, WARP_UP_TO_N, WGMMA_UP_TO_N

        res["dense_from_n"] = DENSE_FROM_N
        res["warp_up_to_n"] = WARP_UP_TO_N
        res["wgmma_up_to_n"] = WGMMA_UP_TO_N
        ns = args.spmm_ns or SPMM_NS
        res["spmm"] = bench_spmm(cp, torch, sh, ns, 0.5, log, deadline=t0 + args.spmm_seconds)
        res["geomean_spmm"] = {
            str(n): geomean([r["speedup"] for r in res["spmm"] if r["N"] == n]) for n in ns
        }
        res["geomean_spmm_warp"] = {
            str(n): geomean([r["speedup_warp"] for r in res["spmm"] if r["N"] == n]) for n in ns if n <= V3_MAX_N
        }
        res["geomean_spmm_wgmma"] = {
            str(n): geomean([r["speedup_wgmma"] for r in res["spmm"] if r["N"] == n]) for n in ns
        }
        res["geomean_spmm_fused"] = {
            str(n): geomean([r["speedup_fused"] for r in res["spmm"] if r["N"] == n]) for n in ns
        }
        res["geomean_spmm_dense_path"] = {
            str(n): geomean([r["speedup_dense_path"] for r in res["spmm"] if r["N"] == n]) for n in ns
        }
    res["wall_s"] = time.time() - t0
    (out / "tiled_cbc_h200.json").write_text(json.dumps(res, indent=1))
    write_md(res, out / "tiled_cbc_h200.md")
    _log_spmspv_geomeans(res, log)
    for n, g in res.get("geomean_spmm", {}).items():
        log(f"GEOMEAN SpMM N={n}: auto {g:.2f}x (warp {res['geomean_spmm_warp'].get(n, float('nan')):.2f}x, "
            f"wgmma {res['geomean_spmm_wgmma'][n]:.2f}x, "
            f"fused {res['geomean_spmm_fused'][n]:.2f}x, dense-path "
            f"{res['geomean_spmm_dense_path'][n]:.2f}x)")


if __name__ == "__main__":
    main()
