#!/usr/bin/env bash
# On the H200 (device tool, carrying .whl): measured ceilings of the kernel targets (benchmarks/bench_ceilings.py),
# after the Tiled-CBC GPU tests. Results under $OUT (default /tmp/out): ceilings_h200.{json,md}, logs.
#   bash benchmarks/run_h200_ceilings.sh [--only iebme,cbc,spmm] [--quick]
set -u
source benchmarks/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 240 python3 -m pytest tests/test_kernels_tiled_cbc.py -q -m gpu -p no:cacheprovider -x 2>&1 | tee "$OUT/pytest_gpu.log" | tail -4
fi
timeout 420 python3 benchmarks/bench_ceilings.py --out "$OUT" "$@" 2>&1 | tee "$OUT/ceilings.log" | grep -E "SUMMARY|tensor rate|Error|error|Traceback" | tail -40
