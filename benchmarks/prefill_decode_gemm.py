"""Prefill through decode once + one cuBLAS GEMM against each format's own multi-row kernel, beside cuBLAS fp16 on
the dense weight, over the seven linears of a LLaMA-2-7B block (issues 37 and 38):

* ``--format tcbc``: Tiled-CBC int codes, the several-row spMspV in launches of 8 rows (the runtime's path before
  decode-then-GEMM) against ``tiled_cbc_spmm.spmm`` (method "dense");
* ``--format iebme``: IE-BME W4A16, the float16-activation kernel 32 tokens a launch against
  ``iebme_decode.spmm_dense16``;
* ``--format iebme-int``: IE-BME W4A4 (the inputs quantized once, outside the timing), the kernel 32 tokens a
  launch against ``iebme_decode.spmm_dense_int`` (the decoded weight's exact halves times the inputs' exact
  halves, two GEMMs into float32).

    python benchmarks/prefill_decode_gemm.py --format tcbc|iebme|iebme-int [--rows 8,32,128,512] [--sparsity 0.5]
        [--out DIR]

Writes ``prefill_<format>.{md,json}`` (machine, versions, command, figures) under --out ($OUT on the device tool,
else benchmarks/results). The two paths' outputs are checked against each other first.
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

SHAPES = [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]  # q k v o, gate up, down


def tcbc_layers(sparsity: float, bits: int = 4):
    """(label of the own kernel, its product, the dense product, layers, dense float16 weights) for Tiled-CBC."""
    from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC, encode_on_device
    from unionsparse.kernels.tiled_cbc_spmm import spmm
    from unionsparse.kernels.tiled_cbc_spmspv import spmspv

    rng = cp.random.default_rng(0)
    layers, dense = [], []
    for m, k in SHAPES:
        q = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (m, k), dtype=cp.int8)
        q[rng.random((m, k)) < sparsity] = 0
        s = (rng.random((m, k // 128), dtype=cp.float32) * 0.02 + 0.001).astype(cp.float16)
        layers.append(DeviceTiledCBC(arrays=encode_on_device(q, bits), w_scales=s, group_size=128))
        dense.append((q.astype(cp.float16) * cp.repeat(s, 128, axis=1)).astype(cp.float16))
    return (f"Tiled-CBC int{bits}", "spMspV, launches of 8 rows", lambda d, x: spmspv(d, x, None),
            lambda d, x: spmm(d, x), layers, dense, None)


def iebme_layers(sparsity: float):
    """The same for IE-BME W4A16 (random codes, as ``bench --e2e`` makes them)."""
    from unionsparse.kernels.iebme_decode import spmm_dense16
    from unionsparse.kernels.iebme_spmm import prepare_layer, spmm_iebme16

    rng = np.random.default_rng(0)
    recs = [iebme_record(f"l{i}", m, k, sparsity, rng, act_bits=16) for i, (m, k) in enumerate(SHAPES)]
    dense = [cp.asarray((r.encoding.decode().astype(np.float32)
                         * np.repeat(r.scales.astype(np.float32), 128, axis=1)).astype(np.float16)) for r in recs]
    return ("IE-BME W4A16", "the kernel, 32 tokens a launch", lambda d, x: spmm_iebme16(d, x, poison=False),
            spmm_dense16, [prepare_layer(r.encoding, r.scales, 128) for r in recs], dense, None)


def iebme_int_layers(sparsity: float):
    """The same for IE-BME W4A4: each product takes (float16 x, its codes, its scales), quantized once (``prep``)."""
    from unionsparse.kernels.act_quant import quantize_inputs
    from unionsparse.kernels.iebme_decode import spmm_dense_int
    from unionsparse.kernels.iebme_spmm import prepare_layer, spmm_iebme

    rng = np.random.default_rng(0)
    recs = [iebme_record(f"l{i}", m, k, sparsity, rng, act_bits=4) for i, (m, k) in enumerate(SHAPES)]
    dense = [cp.asarray((r.encoding.decode().astype(np.float32)
                         * np.repeat(r.scales.astype(np.float32), 128, axis=1)).astype(np.float16)) for r in recs]

    def prep(x):
        xq, sx, _, _ = quantize_inputs(x, 4, 128, 1.0, -(-x.shape[1] // 64) * 64)
        return x, xq, sx

    def own(d, x):
        return spmm_iebme(d, x[1], x[2], poison=False)

    def decoded(d, x):
        return cp.from_dlpack(spmm_dense_int(d, torch.from_dlpack(x[1]), torch.from_dlpack(x[2])))

    return ("IE-BME W4A4", "the kernel, 32 tokens a launch", own, decoded,
            [prepare_layer(r.encoding, r.scales, 128) for r in recs], dense, prep)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", choices=("tcbc", "iebme", "iebme-int"), required=True)
    ap.add_argument("--rows", default="8,32,128,512")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    a = ap.parse_args(argv)
    build = {"tcbc": tcbc_layers, "iebme": iebme_layers, "iebme-int": iebme_int_layers}[a.format]
    what, own_label, own, decoded, layers, dense, prep = build(a.sparsity)
    dev, rng = torch.device("cuda"), np.random.default_rng(1)
    res = {"command": " ".join(["python", *sys.argv]), "machine": machine_info(cp, torch), "format": what,
           "sparsity": a.sparsity, "rows": []}
    for n in (int(v) for v in a.rows.split(",")):
        xs = [cp.asarray(rng.standard_normal((n, k), dtype=np.float32).astype(np.float16)) for _, k in SHAPES]
        args = xs if prep is None else [prep(x) for x in xs]
        pairs, wx = list(zip(layers, args, strict=True)), list(zip(dense, xs, strict=True))
        for layer, x in pairs:  # both paths agree before either is timed
            y1, y2 = own(layer, x).astype(cp.float32), decoded(layer, x).astype(cp.float32)
            err = float(cp.abs(y1 - y2).max() / cp.abs(y1).max())
            if err > 2e-3:
                raise SystemExit(f"paths disagree at N = {n}: relative error {err:.3g}")
        row = {"n": n, "own_ms": time_calls(lambda ps=pairs: [own(d, x) for d, x in ps], 3, 5, dev),
               "decode_gemm_ms": time_calls(lambda ps=pairs: [decoded(d, x) for d, x in ps], 3, 5, dev),
               "cublas_fp16_ms": time_calls(lambda ps=wx: [x @ w.T for w, x in ps], 3, 5, dev)}
        res["rows"].append(row)
        print(f"N={n}: {own_label} {row['own_ms']:.3f} ms, decode+GEMM {row['decode_gemm_ms']:.3f} ms, "
              f"cuBLAS fp16 {row['cublas_fp16_ms']:.3f} ms", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"prefill_{a.format}.json").write_text(json.dumps(res, indent=1))
    mi = res["machine"]
    lines = [f"# {what} prefill, {a.sparsity:.0%} sparse, LLaMA-2-7B block linears, {mi['gpu']}", "",
             f"Command: `{res['command']}`; CuPy {mi['cupy']}, torch {mi['torch']}", "",
             f"| rows | {own_label} (ms) | decode + cuBLAS (ms) | cuBLAS fp16 dense (ms) |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['n']} | {r['own_ms']:.3f} | {r['decode_gemm_ms']:.3f} | {r['cublas_fp16_ms']:.3f} |"
              for r in res["rows"]]
    (out / f"prefill_{a.format}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
