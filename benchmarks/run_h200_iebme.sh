#!/bin/bash
# One device call: import shim, correctness sweep + benchmarks; results under $OUT (and benchmarks/results).
set -o pipefail
mkdir -p /tmp/shim/unionsparse && for d in compressor solvers formats kernels; do ln -sfn "$PWD/$d" /tmp/shim/unionsparse/$d; done
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1
[ -f benchmarks/build/iebme_spmm_sm90.cubin ] && export UNIONSPARSE_IEBME_CUBIN=$PWD/benchmarks/build/iebme_spmm_sm90.cubin
python3 benchmarks/bench_iebme.py --out "${OUT:-benchmarks/results}" "$@" 2>&1 | tee "${OUT:-/tmp}/log.txt"
