"""Tiled-CBC launches on a large synthetic layer, for Nsight Compute stall analysis.

SpMM v3 (warp-streamed), per config (NT, NST, MINB) after M K N (default (1,4,4) and (8,4,2)):

    ncu --clock-control none --kernel-name regex:tcbc_spmm3 --launch-skip 2 --launch-count 2 \\
        --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python3 benchmarks/ncu_tiled_cbc.py [M K N [NT,NST,MINB ...]]

spMspV v2 at static 50% + dynamic 30% (tau = the input's 30% quantile), per fp16 decode mode after M K
(default modes 0 and 1, the full decode and the data movement alone), default warps, stages and chunk;
all modes are launched once as warm-ups, then once each to be profiled:

    ncu --clock-control none --kernel-name regex:tcbc_spmspv2 --launch-skip 2 --launch-count 2 ... \\
        python3 benchmarks/ncu_tiled_cbc.py spmspv [M K [MODE ...]]

``spmspv4`` / ``spmspv2`` instead of ``spmspv``: the same on random nonzero int4 / int2 codes with fp16 scales per
128 inputs (default modes 0 and 1, as for fp16).

SpMM: each config one warm-up launch (compile, skipped), then one profiled launch.
"""

from __future__ import annotations

import sys

import cupy as cp
import numpy as np
from unionsparse.compressor.bench.tiled_cbc import random_weights
from unionsparse.kernels.tiled_cbc_device import DeviceTiledCBC, encode_on_device

args = sys.argv[1:]
if args[:1] in (["spmspv"], ["spmspv4"], ["spmspv2"]):
    from unionsparse.compressor.activation_sparsity.thresholds import tau_from_samples
    from unionsparse.compressor.bench.tiled_cbc import random_codes
    from unionsparse.kernels.tiled_cbc_spmspv import spmspv

    m, k = (int(v) for v in (args[1:3] if len(args) > 2 else (28672, 8192)))
    if args[0] == "spmspv":
        modes = [int(a) for a in args[3:]] or [0, 1]
        dev = DeviceTiledCBC(arrays=encode_on_device(random_weights(cp, m, k, 0.5, 0)))
    else:
        bits, modes = int(args[0][-1]), [int(a) for a in args[3:]] or [0, 1]
        q, sc = random_codes(cp, m, k, 0.5, bits, 128, 0)
        dev = DeviceTiledCBC(arrays=encode_on_device(q, bits=bits), w_scales=sc, group_size=128)
    xh = np.random.default_rng(0).standard_normal(k).astype(np.float16)
    tau = tau_from_samples(np.abs(xh), 0.3)
    x, out = cp.asarray(xh), cp.empty(m, dtype=cp.float16)
    for mode in modes + modes:  # warm-ups first: --launch-skip and --launch-count = the number of modes
        spmspv(dev, x, tau, out=out, mode=mode)
else:
    from unionsparse.kernels.tiled_cbc_spmm import spmm

    m, k, n = (int(v) for v in (args[0:3] if len(args) > 2 else (28672, 8192, 8)))
    cfgs = [tuple(int(c) for c in a.split(",")) for a in args[3:]] or [(1, 4, 4), (8, 4, 2)]
    dev = DeviceTiledCBC(arrays=encode_on_device(random_weights(cp, m, k, 0.5, 0)))
    X = cp.random.RandomState(0).standard_normal((n, k), dtype=cp.float32).astype(cp.float16)
    out = cp.empty((n, m), dtype=cp.float16)
    for cfg in cfgs:
        spmm(dev, X, out=out, config=cfg, method="warp")
        spmm(dev, X, out=out, config=cfg, method="warp")
cp.cuda.Device().synchronize()
