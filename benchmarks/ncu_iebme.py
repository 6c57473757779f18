"""One IE-BME launch per N on a large synthetic layer, for Nsight Compute (``ncu``) stall analysis.

    ncu --clock-control none --kernel-name regex:iebme_spmm --launch-skip 1 --launch-count 2 \\
        --section WarpStateStats --section SchedulerStats --section Occupancy python3 benchmarks/ncu_iebme.py
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np
from unionsparse.compressor.bench.kernels import synth_layer
from unionsparse.kernels.iebme_spmm import launch

m, k = (int(v) for v in (sys.argv[1:3] if len(sys.argv) > 2 else (36864, 12288)))
layer = synth_layer(m, k, 4, 0.5, "none", 128, 0)
for n in (1, 8):
    x = cp.asarray(np.random.default_rng(n).integers(-8, 8, (n, layer.tc * 64), dtype=np.int8))
    xs = cp.asarray(np.random.default_rng(n).random((n, layer.n_groups), dtype=np.float32) + 0.5)
    y = cp.empty((n, m), dtype=cp.uint16)
    launch(layer, x, xs, y)  # warm-up (compile), skipped by --launch-skip
    launch(layer, x, xs, y)
cp.cuda.Device().synchronize()
