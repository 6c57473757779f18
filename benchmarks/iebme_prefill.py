"""Prefill of IE-BME W4A16 (issue 37): the float16-activation kernel, 32 tokens a launch (the runtime's default),
against decode once + cuBLAS (``iebme_decode.spmm_dense16``), beside cuBLAS fp16 on the dense weight, over the seven
linears of a LLaMA-2-7B block at 50% (random codes, as ``bench --e2e`` makes them).

    python benchmarks/iebme_prefill.py [--rows 32,64,128,512] [--sparsity 0.5] [--out DIR]

Writes ``iebme_prefill.{md,json}`` (machine, versions, command, figures) under --out ($OUT on the device tool, else
benchmarks/results). The two paths' outputs are checked against each other first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import cupy as cp
import numpy as np
import torch
from unionsparse.compressor.bench.e2e import time_calls
from unionsparse.compressor.bench.e2e_peers import iebme_record
from unionsparse.compressor.bench.tiled_cbc import machine_info
from unionsparse.kernels.iebme_decode import spmm_dense16
from unionsparse.kernels.iebme_spmm import prepare_layer, spmm_iebme16

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]  # q k v o, gate up, down


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="32,64,128,512")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    recs = [iebme_record(f"l{i}", m, k, a.sparsity, rng, act_bits=16) for i, (m, k) in enumerate(SHAPES)]
    layers = [prepare_layer(r.encoding, r.scales, 128) for r in recs]
    dense = [cp.asarray((r.encoding.decode().astype(np.float32)
                         * np.repeat(r.scales.astype(np.float32), 128, axis=1)).astype(np.float16)) for r in recs]
    dev = torch.device("cuda")
    res = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(cp, torch),
           "sparsity": a.sparsity, "rows": []}
    for n in (int(v) for v in a.rows.split(",")):
        xs = [cp.asarray(rng.standard_normal((n, k), dtype=np.float32).astype(np.float16)) for _, k in SHAPES]
        pairs = list(zip(layers, xs, strict=True))
        for layer, x in pairs:  # both paths agree before either is timed
            y1, y2 = spmm_iebme16(layer, x).astype(cp.float32), spmm_dense16(layer, x).astype(cp.float32)
            err = float(cp.abs(y1 - y2).max() / cp.abs(y1).max())
            if err > 2e-3:
                raise SystemExit(f"paths disagree at N = {n}: relative error {err:.3g}")
        wx = list(zip(dense, xs, strict=True))
        row = {"n": n,
               "kernel_ms": time_calls(lambda ps=pairs: [spmm_iebme16(lay, x, poison=False) for lay, x in ps], 3, 5,
                                       dev),
               "decode_gemm_ms": time_calls(lambda ps=pairs: [spmm_dense16(lay, x) for lay, x in ps], 3, 5, dev),
               "cublas_fp16_ms": time_calls(lambda ps=wx: [x @ w.T for w, x in ps], 3, 5, dev)}
        res["rows"].append(row)
        print(f"N={n}: kernel {row['kernel_ms']:.3f} ms, decode+GEMM {row['decode_gemm_ms']:.3f} ms, "
              f"cuBLAS fp16 {row['cublas_fp16_ms']:.3f} ms", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "iebme_prefill.json").write_text(json.dumps(res, indent=1))
    mi = res["machine"]
    lines = [f"# IE-BME W4A16 prefill, {a.sparsity:.0%}, LLaMA-2-7B block linears, {mi['gpu']}", "",
             f"Command: `{res['command']}`; CuPy {mi['cupy']}, torch {mi['torch']}", "",
             "| rows | kernel, 32 tokens a launch (ms) | decode + cuBLAS (ms) | cuBLAS fp16 dense (ms) |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['n']} | {r['kernel_ms']:.3f} | {r['decode_gemm_ms']:.3f} | {r['cublas_fp16_ms']:.3f} |"
              for r in res["rows"]]
    (out / "iebme_prefill.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
