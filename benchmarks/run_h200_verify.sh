#!/usr/bin/env bash
# On the H200 (device tool, carrying .whl): end-to-end GPU verify, then the full Tiled-CBC spMspV corpus.
set -u
source benchmarks/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
python3 benchmarks/gpu_verify_e2e.py /tmp/e2e 2>&1 | tee "$OUT/gpu_verify.log"
cp /tmp/e2e/gpu_verify.json "$OUT/" 2>/dev/null
timeout 230 python3 benchmarks/bench_tiled_cbc.py --out "$OUT" --no-spmm --spmspv-seconds 150 2>&1 | tail -40
