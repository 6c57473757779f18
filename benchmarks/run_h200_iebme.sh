#!/bin/bash
# One device call: import shim, correctness sweep + benchmarks (+ pipeline-variant timings with --tune-variants).
# Results land in $OUT (when run through the device tool) or benchmarks/results.
set -o pipefail
mkdir -p /tmp/shim/unionsparse && for d in compressor solvers formats kernels; do ln -sfn "$PWD/$d" /tmp/shim/unionsparse/$d; done
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1
DEST="${OUT:-benchmarks/results}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
[ -f benchmarks/build/iebme_spmm_sm90.cubin ] && export UNIONSPARSE_IEBME_CUBIN=$PWD/benchmarks/build/iebme_spmm_sm90.cubin
if [ "$1" != "--tune-only" ]; then
  python3 benchmarks/bench_iebme.py --out "$DEST" 2>&1 | tee "$DEST/log.txt"
fi
if [ "$1" = "--tune-variants" ] || [ "$1" = "--tune-only" ]; then
  python3 benchmarks/bench_iebme.py --tune 2>&1 | grep -E "TUNE|Error"
  for f in benchmarks/build/tune_s*_st*.cubin; do
    s=$(basename "$f" .cubin | sed 's/tune_s\([0-9]*\)_st\([0-9]*\)/\1 \2/')
    set -- $s
    UNIONSPARSE_IEBME_CUBIN=$PWD/$f UNIONSPARSE_IEBME_S=$1 UNIONSPARSE_IEBME_STAGES=$2 \
      python3 benchmarks/bench_iebme.py --tune 2>&1 | grep -E "TUNE|Error"
  done | tee "$DEST/tune.txt"
fi
