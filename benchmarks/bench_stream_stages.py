"""A/B of the streaming hot-loop stages changed for the 2x-RAM run: old formula vs new path, one layer.

    python benchmarks/bench_stream_stages.py [M K]     # default 8192 8192; interleaved, median of 2

Asserts that both give the same masks and codes, then prints seconds per stage as JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
import torch
from unionsparse.compressor import pruning
from unionsparse.compressor.pruning.row_select import prune_lowest_mask
from unionsparse.formats import iebme
from unionsparse.formats.arithmetic import weights as quant


def main() -> None:
    m, k = (int(x) for x in sys.argv[1:3]) if len(sys.argv) > 2 else (8192, 8192)
    torch.manual_seed(0)
    w = (torch.randn(m, k) * 0.02).half().float()
    prune_lowest_mask(w[:2].abs().numpy().copy(), 3)  # JIT outside the timing

    def old_prune():
        metric = w.abs().float()
        idx = torch.sort(metric, dim=1, stable=True)[1][:, : k // 2]
        mask = torch.ones(metric.shape, dtype=torch.bool)
        mask.scatter_(1, idx, False)
        return w * mask

    def new_prune():
        return w * pruning.magnitude(w, 0.5)

    wp = new_prune()

    def old_quant():
        x = wp * (wp != 0)  # the mask copy quantize_weight used to make
        g = k // 128
        padded = torch.zeros(m, g * 128)
        padded[:, :k] = x
        s = quant.scales_from_absmax(padded.abs().reshape(m, g, 128).amax(dim=2), 4)
        return torch.clamp(torch.round(x / s.float().repeat_interleave(128, dim=1)[:, :k]), -8, 7).to(torch.int8)

    def new_quant():
        return quant.quantize_with_scales(wp, quant.scales_from_absmax(quant.group_absmax(wp, 128), 4), 4, 128)

    codes = new_quant().numpy()
    enc = iebme.encode(codes, 4)
    stages = {
        "prune": (old_prune, new_prune),
        "quant": (old_quant, new_quant),
        "stats_mask": (lambda: enc.decode() != 0, lambda: codes != 0),
        "finite_check": (lambda: bool(torch.isfinite(w).all()), lambda: bool(torch.isfinite(w.sum()))),
    }
    for old, new in stages.values():
        a, b = old(), new()
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else np.array_equal(a, b)), "paths differ"
    res: dict = {"shape": [m, k], "loadavg_1min": os.getloadavg()[0]}
    for name, (old, new) in stages.items():
        t: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(2):
            for label, f in (("old", old), ("new", new)):
                t0 = time.perf_counter()
                f()
                t[label].append(time.perf_counter() - t0)
        res[name] = {label: round(statistics.median(x), 3) for label, x in t.items()}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
