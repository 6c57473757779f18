"""Decode attention alone against its byte floor: 32 launches, each over its own layer's K/V cache (cold in L2,
as in a step), in one CUDA graph, for the split and the cluster form (``attention.CLUSTER``) side by side.

    python benchmarks/attention_bytes.py --out DIR      (a CUDA machine; attention_h200.sh runs it)

Per case: microseconds per launch, the K/V bytes it must read (valid length only), the floor of those bytes at
the machine's measured copy bandwidth, and the fraction of that floor reached. What a launch costs inside the
step beyond this (its wait for the Q/K/V product, o_proj's wait for it) is the knockout's figure less this one.
"""

from __future__ import annotations

import argparse
import platform

import torch
from unionsparse.compressor.bench.e2e import copy_bandwidth, write_table
from unionsparse.compressor.bench.tiled_cbc import time_graph_torch
from unionsparse.kernels import attention

LAYERS = 32
# name: batch, query heads, KV heads, head dim, context
CASES = {
    "llama2-7b B1 ctx512": (1, 32, 32, 128, 512),
    "llama2-7b B1 ctx2048": (1, 32, 32, 128, 2048),
    "llama2-7b B8 ctx2048": (8, 32, 32, 128, 2048),
    "llama3-8b B1 ctx512": (1, 32, 8, 128, 512),
    "llama3-8b B8 ctx2048": (8, 32, 8, 128, 2048),
}
FORMS = (("split", False), ("cluster", True))  # key, attention.CLUSTER


def case(name: str, b: int, h: int, hkv: int, d: int, ctx: int, bw: float, dev) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    alloc = ctx + 8
    layers = []
    for _ in range(LAYERS):
        q = torch.randn(b, h, 1, d, device=dev, dtype=torch.float16, generator=gen)
        kc = torch.randn(b, hkv, alloc, d, device=dev, dtype=torch.float16, generator=gen)
        vc = torch.randn(b, hkv, alloc, d, device=dev, dtype=torch.float16, generator=gen)
        layers.append((q, kc, vc))
    pos = torch.full((b,), ctx - 1, device=dev)
    off = torch.zeros(b, dtype=torch.long, device=dev)
    fns = [lambda t=t: attention.decode_attention(*t, pos, off, d ** -0.5) for t in layers]
    kv_bytes = 2 * b * hkv * ctx * d * 2
    floor_us = kv_bytes / bw * 1e6
    row = {"case": name, "kv_mb": kv_bytes / 1e6, "floor_us": floor_us}
    ref, default = None, attention.CLUSTER
    for key, cluster in FORMS:
        attention.CLUSTER = cluster
        out = fns[0]()
        ref = out if ref is None else ref
        row[f"{key}_us"] = t = time_graph_torch(torch, lambda i: fns[i](), LAYERS, reps=21) * 1e6
        row[f"{key}_of_floor"] = floor_us / t
        row[f"{key}_max_diff_vs_split"] = float((out.float() - ref.float()).abs().max())
    attention.CLUSTER = default
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    rows = [case(n, *c, bw, dev) for n, c in CASES.items()]
    head = (f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {platform.python_version()}; "
            f"copy bandwidth {bw / 1e12:.2f} TB/s; {LAYERS} layers' caches, one graph")
    lines = [head, "", "| case | K/V read (MB) | floor (µs) | split (µs) | of floor | cluster (µs) | of floor |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['kv_mb']:.1f} | {r['floor_us']:.2f} | "
                     + " | ".join(f"{r[f'{k}_us']:.2f} | {r[f'{k}_of_floor']:.0%}" for k, _ in FORMS) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_table(args.out, "attention_bytes", text, {"machine": head, "rows": rows})


if __name__ == "__main__":
    main()
