#!/usr/bin/env bash
# On the H200 (device tool, carrying .whl): end-to-end GPU verify, then the full Tiled-CBC spMspV corpus.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/shim/unionsparse && for d in compressor solvers formats kernels; do ln -sfn "$PWD/$d" /tmp/shim/unionsparse/$d; done
export PYTHONPATH=/tmp/shim:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
python3 benchmarks/gpu_verify_e2e.py /tmp/e2e 2>&1 | tee "$OUT/gpu_verify.log"
cp /tmp/e2e/gpu_verify.json "$OUT/" 2>/dev/null
timeout 230 python3 benchmarks/bench_tiled_cbc.py --out "$OUT" --no-spmm --spmspv-seconds 150 2>&1 | tail -40
