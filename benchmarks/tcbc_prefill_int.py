"""Prefill of Tiled-CBC int codes (issue 38, item 3): the several-row spMspV in launches of 8 rows (the runtime's
path for int codes before decode-then-GEMM) against decode once + cuBLAS (``tiled_cbc_spmm.spmm``, method
"dense"), beside cuBLAS fp16 on the dense weight, over the seven linears of a LLaMA-2-7B block.

    python benchmarks/tcbc_prefill_int.py [--rows 8,32,128,512] [--static 0.5] [--bits 4] [--out DIR]

Writes ``tcbc_prefill_int.{md,json}`` (machine, versions, command, figures) under --out ($OUT on the device tool,
else benchmarks/results). Each path's outputs are checked against the other's first (float32 summation of
weights that differ by the float16 rounding of code x scale).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import cupy as cp
import torch
from unionsparse.compressor.bench.e2e import time_calls
from unionsparse.compressor.bench.tiled_cbc import machine_info
from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC, encode_on_device
from unionsparse.kernels.tiled_cbc_spmm import spmm
from unionsparse.kernels.tiled_cbc_spmspv import spmspv

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]  # q k v o, gate up, down


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,32,128,512")
    ap.add_argument("--static", type=float, default=0.5)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args(argv)
    rows = [int(v) for v in a.rows.split(",")]
    rng = cp.random.default_rng(0)
    lo, hi = -(1 << (a.bits - 1)), (1 << (a.bits - 1)) - 1
    layers, dense = [], []
    for m, k in SHAPES:
        q = rng.integers(lo, hi + 1, (m, k), dtype=cp.int8)
        q[rng.random((m, k)) < a.static] = 0
        s = (rng.random((m, k // 128), dtype=cp.float32) * 0.02 + 0.001).astype(cp.float16)
        layers.append(DeviceTiledCBC(arrays=encode_on_device(q, a.bits), w_scales=s, group_size=128))
        dense.append((q.astype(cp.float16) * cp.repeat(s, 128, axis=1)).astype(cp.float16))
        del q
    res = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(cp, torch), "bits": a.bits,
           "static": a.static, "rows": []}
    for n in rows:
        xs = [cp.asarray(rng.standard_normal((n, k), dtype=cp.float32).astype(cp.float16)) for _, k in SHAPES]
        pairs = list(zip(layers, xs, strict=True))
        for dev, x in pairs:  # both paths agree before either is timed
            y1 = spmspv(dev, x, None).astype(cp.float32)
            y2 = spmm(dev, x).astype(cp.float32)
            err = float(cp.abs(y1 - y2).max() / cp.abs(y1).max())
            if err > 2e-3:
                raise SystemExit(f"paths disagree at N = {n}: relative error {err:.3g}")
        dev = torch.device("cuda")
        t_rows = time_calls(lambda ps=pairs: [spmspv(d, x, None) for d, x in ps], 3, 5, dev)
        t_dense = time_calls(lambda ps=pairs: [spmm(d, x) for d, x in ps], 3, 5, dev)
        wx = list(zip(dense, xs, strict=True))
        t_cublas = time_calls(lambda ps=wx: [x @ w.T for w, x in ps], 3, 5, dev)
        res["rows"].append({"n": n, "spmspv_rows_ms": t_rows, "decode_gemm_ms": t_dense, "cublas_fp16_ms": t_cublas})
        print(f"N={n}: spMspV x{-(-n // 8)} launches {t_rows:.3f} ms, decode+GEMM {t_dense:.3f} ms, "
              f"cuBLAS fp16 {t_cublas:.3f} ms", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tcbc_prefill_int.json").write_text(json.dumps(res, indent=1))
    mi = res["machine"]
    lines = [f"# Tiled-CBC int{a.bits} prefill, {a.static:.0%} static, LLaMA-2-7B block linears, {mi['gpu']}", "",
             f"Command: `{res['command']}`; CuPy {mi['cupy']}, torch {mi['torch']}", "",
             "| rows | spMspV, launches of 8 (ms) | decode + cuBLAS (ms) | cuBLAS fp16 dense (ms) |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['n']} | {r['spmspv_rows_ms']:.3f} | {r['decode_gemm_ms']:.3f} | {r['cublas_fp16_ms']:.3f} |"
              for r in res["rows"]]
    (out / "tcbc_prefill_int.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
