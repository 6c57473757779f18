#!/usr/bin/env bash
# On the H200/H100 (device tool, carrying .whl): Tiled-CBC GPU correctness sweep, then the benchmark
# (full 31-shape SpInfer corpus for spMspV at static 50%/30% + dynamic 30%, SpMM N = 16..4096) beside
# cuBLAS. Results under $OUT (default /tmp/out): tiled_cbc_gpu_check.json, tiled_cbc_h200.{json,md}, logs.
#   bash benchmarks/run_h200_tiled_cbc.sh [SPMSPV_SECONDS] [SPMM_SECONDS]
set -u
source benchmarks/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
T1=${1:-90}
T2=${2:-150}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if python3 -c "import pytest" 2>/dev/null; then
    timeout 90 python3 -m pytest tests/test_kernels_tiled_cbc.py -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -3
fi
timeout 150 python3 benchmarks/gpu_check_tiled_cbc.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log" | tail -45
timeout 400 python3 benchmarks/bench_tiled_cbc.py --out "$OUT" --spmspv-seconds "$T1" --spmm-seconds "$T2" \
    2>&1 | tee "$OUT/bench.log" | grep -E "GEOMEAN|copy|Error|error|Traceback|limit" | tail -30
