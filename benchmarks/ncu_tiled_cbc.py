"""Tiled-CBC SpMM v3 (warp-streamed) launches on a large synthetic layer, for Nsight Compute stall analysis.

    ncu --clock-control none --kernel-name regex:tcbc_spmm3 --launch-skip 2 --launch-count 2 \\
        --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python3 benchmarks/ncu_tiled_cbc.py [M K N]

Per config (NT, NST, MINB) in argv order after M K N (default (1,4,4) and (8,4,2)): one warm-up launch
(compile, skipped), one profiled launch.
"""

from __future__ import annotations

import sys

import cupy as cp
from unionsparse.kernels.tiled_cbc_bench import random_weights
from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC, encode_on_device
from unionsparse.kernels.tiled_cbc_spmm import spmm

m, k, n = (int(v) for v in (sys.argv[1:4] if len(sys.argv) > 3 else (28672, 8192, 8)))
cfgs = [tuple(int(c) for c in a.split(",")) for a in sys.argv[4:]] or [(1, 4, 4), (8, 4, 2)]
dev = DeviceTiledCBC(arrays=encode_on_device(random_weights(cp, m, k, 0.5, 0)))
X = cp.random.RandomState(0).standard_normal((n, k), dtype=cp.float32).astype(cp.float16)
out = cp.empty((n, m), dtype=cp.float16)
for cfg in cfgs:
    spmm(dev, X, out=out, config=cfg, method="warp")
    spmm(dev, X, out=out, config=cfg, method="warp")
cp.cuda.Device().synchronize()
