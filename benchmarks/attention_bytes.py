"""Decode attention alone against its byte floor: 32 launches, each over its own layer's K/V cache (cold in L2,
as in a step), in one CUDA graph, for the split and the cluster form (``attention.CLUSTER``) side by side.

    python benchmarks/attention_bytes.py --out DIR [--baseline .ab/attention.cu]
    (a CUDA machine; attention_h200.sh runs it)

Per case: microseconds per launch, the K/V bytes it must read (valid length only), the floor of those bytes at
the machine's measured copy bandwidth, and the fraction of that floor reached. The query sits where a step's
first token does (`bench --e2e` at context C decodes at slot C, seeing C + 1 slots) in a cache allocated as the
step's (C + 20 slots). What a launch costs inside the step beyond this (its wait for the Q/K/V product, o_proj's
wait for it) is the knockout's figure less this one.

A second table sweeps the position of LLaMA-2-7B batch 1 over the split form's wave boundary (its blocks of 32
slots a head all resident at once or not), both forms; with ``--baseline`` also the split form compiled from that
other revision of attention.cu (same launch arguments), side by side.
"""

from __future__ import annotations

import argparse
import platform

import torch
from unionsparse.compressor.bench.e2e import copy_bandwidth, write_table
from unionsparse.compressor.bench.tiled_cbc import time_graph_torch
from unionsparse.kernels import attention, study

LAYERS = 32
# name: batch, query heads, KV heads, head dim, context
CASES = {
    "llama2-7b B1 ctx512": (1, 32, 32, 128, 512),
    "llama2-7b B1 ctx2048": (1, 32, 32, 128, 2048),
    "llama2-7b B8 ctx2048": (8, 32, 32, 128, 2048),
    "llama3-8b B1 ctx512": (1, 32, 8, 128, 512),
    "llama3-8b B8 ctx2048": (8, 32, 8, 128, 2048),
}
SWEEP = (255, 480, 511, 512, 527, 543, 575, 639, 767, 1023)  # positions, LLaMA-2-7B batch 1
FORMS = (("split", False), ("cluster", True))  # key, attention.CLUSTER


def layers_of(b: int, h: int, hkv: int, d: int, alloc: int, dev) -> list:
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for _ in range(LAYERS):
        q = torch.randn(b, h, 1, d, device=dev, dtype=torch.float16, generator=gen)
        kc = torch.randn(b, hkv, alloc, d, device=dev, dtype=torch.float16, generator=gen)
        vc = torch.randn(b, hkv, alloc, d, device=dev, dtype=torch.float16, generator=gen)
        out.append((q, kc, vc))
    return out


def timed(layers: list, pos: int, forms, dev) -> dict:
    """µs per launch of each (key, CLUSTER, study build) in ``forms``, and each output's largest difference from
    the first's."""
    b, d = layers[0][0].shape[0], layers[0][0].shape[3]
    p = torch.full((b,), pos, device=dev)
    off = torch.zeros(b, dtype=torch.long, device=dev)
    fns = [lambda t=t: attention.decode_attention(*t, p, off, d ** -0.5) for t in layers]
    row, ref, default = {}, None, attention.CLUSTER
    for key, cluster, build in forms:
        attention.CLUSTER = cluster
        with study.building("attention", build):
            out = fns[0]()
            ref = out if ref is None else ref
            row[f"{key}_us"] = time_graph_torch(torch, lambda i: fns[i](), LAYERS, reps=21) * 1e6
        row[f"{key}_max_diff"] = float((out.float() - ref.float()).abs().max())
    attention.CLUSTER = default
    return row


def case(name: str, b: int, h: int, hkv: int, d: int, ctx: int, bw: float, dev) -> dict:
    kv_bytes = 2 * b * hkv * (ctx + 1) * d * 2
    floor_us = kv_bytes / bw * 1e6
    row = {"case": name, "kv_mb": kv_bytes / 1e6, "floor_us": floor_us}
    row.update(timed(layers_of(b, h, hkv, d, ctx + 20, dev), ctx, [(k, c, None) for k, c in FORMS], dev))
    for key, _ in FORMS:
        row[f"{key}_of_floor"] = floor_us / row[f"{key}_us"]
    return row


def sweep(baseline: str | None, bw: float, dev) -> list[dict]:
    forms = [(k, c, None) for k, c in FORMS]
    if baseline:
        forms.append(("split_baseline", False, study.Build(source=baseline)))
    layers = layers_of(1, 32, 32, 128, SWEEP[-1] + 20, dev)
    rows = []
    for pos in SWEEP:
        floor_us = 2 * 32 * (pos + 1) * 128 * 2 / bw * 1e6
        rows.append({"pos": pos, "chunks": pos // attention.CHUNK + 1, "floor_us": floor_us,
                     **timed(layers, pos, forms, dev)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--baseline", help="another revision of kernels/attention.cu: its split form in the sweep")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    rows = [case(n, *c, bw, dev) for n, c in CASES.items()]
    swept = sweep(args.baseline, bw, dev)
    head = (f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {platform.python_version()}; "
            f"copy bandwidth {bw / 1e12:.2f} TB/s; {LAYERS} layers' caches, one graph; the query at slot C")
    lines = [head, "", "| case | K/V read (MB) | floor (µs) | split (µs) | of floor | cluster (µs) | of floor |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['kv_mb']:.1f} | {r['floor_us']:.2f} | "
                     + " | ".join(f"{r[f'{k}_us']:.2f} | {r[f'{k}_of_floor']:.0%}" for k, _ in FORMS) + " |")
    base = bool(args.baseline)
    lines += ["", "LLaMA-2-7B batch 1, µs per launch by position" + (f" (baseline: {args.baseline})" if base else ""),
              "", "| pos | chunks a head | floor (µs) | split | cluster |" + (" split, baseline |" if base else ""),
              "|---|---|---|---|---|" + ("---|" if base else "")]
    for r in swept:
        lines.append(f"| {r['pos']} | {r['chunks']} | {r['floor_us']:.2f} | {r['split_us']:.2f} | "
                     f"{r['cluster_us']:.2f} |" + (f" {r['split_baseline_us']:.2f} |" if base else ""))
    text = "\n".join(lines) + "\n"
    print(text)
    write_table(args.out, "attention_bytes", text, {"machine": head, "rows": rows, "sweep": swept,
                                                    "baseline": args.baseline})


if __name__ == "__main__":
    main()
