"""What ``pdl_enter`` costs or buys per glue kernel: the revision before it, it without the pointer pins, and
today's kernels, each timed in CUDA graphs of 32 launches (a step's worth), with programmatic launch off and on.

    python benchmarks/pdl_kernel_ab.py --before DIR --out DIR
DIR holds attention_before.cu, glue_before.cu, norm_quant_before.cu (``git show REV:kernels/attention.cu`` and so on).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
from unionsparse.compressor.bench.tiled_cbc import time_graph_torch
from unionsparse.kernels import attention, glue, loader, norm_quant, study
from unionsparse.kernels.cluster_launch import programmatic_launches

KERNELS = Path(loader.__file__).parent
NAMES = ("attention", "glue", "norm_quant")


def use_sources(sources: dict[str, str]) -> None:
    """Make the launchers compile ``sources[name]`` (a file) instead of kernels/<name>.cu (study builds,
    kernels/study.py; a name not in ``sources``: the shipped file)."""
    for name in NAMES:
        study.use_build(name, study.Build(source=sources[name]) if name in sources else None)
    for f in (glue._functions, norm_quant._functions):  # attention keys its kernels by the build in force
        f.cache_clear()


def unpinned(tmp: Path) -> dict[str, str]:
    out = {}
    for n in NAMES:
        text = (KERNELS / f"{n}.cu").read_text()
        text = re.sub(r"pdl_enter\([^)]*\);", "allow_dependents(); wait_for_producer();", text)
        (tmp / f"{n}_unpinned.cu").write_text(text)
        out[n] = str(tmp / f"{n}_unpinned.cu")
    return out


def cases(dev):
    torch.manual_seed(0)
    k, h, d, ctx, alloc = 4096, 32, 128, 512, 1024
    x = torch.randn(1, k, device=dev, dtype=torch.float16)
    delta = torch.randn(1, k, device=dev, dtype=torch.float16)
    w = torch.rand(k, device=dev, dtype=torch.float16) + 0.5
    perm = torch.randperm(k, device=dev).to(torch.int32)
    rule = norm_quant.InputRule(4, 128, 0.95, k, perm, 128, 8, 128, 1.0)
    q = torch.randn(1, h, 1, d, device=dev, dtype=torch.float16)
    kc = torch.randn(1, h, alloc, d, device=dev, dtype=torch.float16)
    vc = torch.randn(1, h, alloc, d, device=dev, dtype=torch.float16)
    pos = torch.tensor([ctx - 1], device=dev)
    off = torch.zeros(1, dtype=torch.long, device=dev)
    return {
        "add_rms_norm": lambda: glue.add_rms_norm(x, delta, w, 1e-5),
        "add_rms_norm_quant+o128": lambda: norm_quant.add_rms_norm_quant(x, delta, w, 1e-5, rule),
        "attention ctx512": lambda: attention.decode_attention(q, kc, vc, pos, off, d ** -0.5),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before = {n: str(Path(args.before) / f"{n}_before.cu") for n in NAMES}
    variants = {"before pdl_enter": before, "pdl_enter without pins": unpinned(out), "today": {}}
    dev = torch.device("cuda")
    res = {}
    for label, src in variants.items():
        use_sources(src)
        for pdl in (False, None):
            with programmatic_launches(pdl):
                for name, fn in cases(dev).items():
                    res[f"{label} | pdl {'off' if pdl is False else 'on'} | {name}"] = time_graph_torch(
                        torch, lambda i, fn=fn: fn(), 32, reps=21) * 1e6  # µs a launch, a graph of 32
    for key, us in res.items():
        print(f"{key:70s} {us:7.2f} us")
    (out / "pdl_kernel_ab.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "us": res},
                                                         indent=2) + "\n")


if __name__ == "__main__":
    main()
