"""Load-time cost of fusing Q/K/V and gate/up (compressor/runtime/fused.py) on this machine's CPU: stacking the
stored encodings, scales (and outlier sides) of one block by rows, against the decode-and-re-encode route.

    .venv/bin/python benchmarks/bench_stack.py [--repeat 3] [--only smollm2,llama7b]

Per model shape, one block's two groups (q/k/v_proj, gate/up_proj), random codes at 50% sparsity, 4-bit:
IE-BME with per-tile row permutations (W4A4 records: scales, activation record, 8 outlier channels), Tiled-CBC
int4 codes (scales) and Tiled-CBC fp16 values. ``stack`` is :func:`stack_records` (array concatenation plus the
format's structural validation: what ``build_model(fuse=True)`` adds per group); ``re-encode`` decodes every member,
pads and stacks the codes and encodes them again (the simple route, same bytes). Whole-model figures are the block
figure times the number of blocks. Writes benchmarks/results/stack.json and stack.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np
from unionsparse.compressor.artifact.store import LayerRecord
from unionsparse.compressor.runtime.fused import stack_records
from unionsparse.formats import iebme, tiled_cbc
from unionsparse.formats.arithmetic.outlier_side import OutlierSide, column_permutation

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_encode import median_time  # noqa: E402 - beside this script

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {  # name: (hidden K, q rows, k/v rows, gate/up rows, blocks)
    "smollm2": ("SmolLM2-135M", 576, 576, 192, 1536, 30),
    "llama7b": ("LLaMA-2-7B", 4096, 4096, 4096, 11008, 32),
}
GROUP, OUTLIERS = 128, 8


def member(rng, name: str, m: int, k: int, fmt: str, channels: np.ndarray) -> LayerRecord:
    codes = rng.integers(-8, 8, (m, k)).astype(np.int8)
    codes[rng.random((m, k)) < 0.5] = 0
    scales = (rng.random((m, -(-k // GROUP))) * 0.1 + 0.01).astype(np.float16)
    attrs = {"bits": 4, "group_size": GROUP}
    if fmt == "ie-bme w4a4":
        codes[:, k - OUTLIERS:] = 0  # the main matrix's outlier columns (the side holds them)
        g = iebme.Geometry((m, k), iebme.DEFAULT_TILE, iebme.DEFAULT_AREAS, 4)
        perm = np.stack([rng.permutation(16) for _ in range(g.n_tiles)]).astype(np.uint8)
        side = OutlierSide(channels, column_permutation(k, channels),
                           rng.integers(-128, 128, (m, OUTLIERS)).astype(np.int8),
                           (rng.random((m, 1)) * 0.01 + 1e-3).astype(np.float16))
        attrs["activations"] = {"bits": 4, "group_size": GROUP, "clip": 0.9, "outlier_channels": channels.tolist()}
        return LayerRecord(name, iebme.encode(codes, 4, perm=perm), scales, attrs, side)
    if fmt == "tiled-cbc int4":
        return LayerRecord(name, tiled_cbc.encode(codes, bits=4), scales, attrs)
    values = (rng.standard_normal((m, k)) * (codes != 0)).astype(np.float16)
    return LayerRecord(name, tiled_cbc.encode(values), None, {"bits": None, "dp_threshold": 0.1})


def reencode(records: list[LayerRecord]) -> None:
    parts = []
    for i, r in enumerate(records):
        dec = r.encoding.decode()
        tm = r.encoding.tile[0]
        rows = dec.shape[0] if i == len(records) - 1 else -(-dec.shape[0] // tm) * tm
        pad = np.zeros((rows, dec.shape[1]), dec.dtype)
        pad[: dec.shape[0]] = dec
        parts.append(pad)
    big = np.concatenate(parts)
    e = records[0].encoding
    if isinstance(e, iebme.IEBMEMatrix):
        iebme.encode(big, 4, e.tile, e.areas, np.concatenate([r.encoding.perm for r in records]))
    else:
        tiled_cbc.encode(big, e.tile, e.bits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default=",".join(SHAPES))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for key in args.only.split(","):
        label, k, q, kv, ff, blocks = SHAPES[key]
        for fmt in ("ie-bme w4a4", "tiled-cbc int4", "tiled-cbc fp16"):
            ch = [np.sort(rng.choice(k, OUTLIERS, replace=False)).astype(np.int64) for _ in range(2)]  # per input
            groups = [[member(rng, f"b.self_attn.{p}", m, k, fmt, ch[0]) for p, m in
                       (("q_proj", q), ("k_proj", kv), ("v_proj", kv))],
                      [member(rng, f"b.mlp.{p}", ff, k, fmt, ch[1]) for p in ("gate_proj", "up_proj")]]
            for g in groups:
                why = stack_records(g)
                assert not isinstance(why, str), why
            t_stack = median_time(lambda gs=groups: [stack_records(g) for g in gs], args.repeat)
            t_re = median_time(lambda gs=groups: [reencode(g) for g in gs], max(1, args.repeat // 2))
            nbytes = sum(a.nbytes for g in groups for r in g for a in r.arrays().values())
            rows.append({"model": label, "format": fmt, "blocks": blocks, "block_bytes": nbytes,
                         "stack_block_s": t_stack, "stack_model_s": t_stack * blocks,
                         "reencode_block_s": t_re, "reencode_model_s": t_re * blocks})
            print(rows[-1], flush=True)
    meta = {"machine": platform.node(), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": sys.version.split()[0], "numpy": np.__version__,
            "command": "python benchmarks/bench_stack.py " + " ".join(sys.argv[1:]), "median_of": args.repeat}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "stack.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["# Stacking Q/K/V and gate/up at load, one block, 50% sparsity, 4-bit codes, one process", "",
             f"`{meta['command']}` on {meta['machine']} ({meta['cores']} cores, Python {meta['python']}, numpy "
             f"{meta['numpy']}); median of {args.repeat} (re-encode: of {max(1, args.repeat // 2)}).", "",
             "| model | format | block MB | stack s / block | stack s / model | re-encode s / block | "
             "re-encode s / model |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['blocks']} blocks) | {r['format']} | {r['block_bytes'] / 1e6:.1f} | "
                     f"{r['stack_block_s']:.3f} | {r['stack_model_s']:.1f} | {r['reencode_block_s']:.2f} | "
                     f"{r['reencode_model_s']:.0f} |")
    (RESULTS / "stack.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
