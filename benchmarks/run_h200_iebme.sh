#!/usr/bin/env bash
# One device call (device tool, carrying .whl): wheels + import shim, then
#   (no flag)  correctness sweep + full benchmark (SpInfer and UnionSparse corpora, perms, W2)
#   --tune     pipeline variants (ring depth, warps per CTA, tiles decoded back to back) on four large shapes
#   --quick    correctness sweep + the first 6 SpInfer shapes
# Results land in $OUT (through the device tool) or benchmarks/results.
set -o pipefail
source benchmarks/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
case "$1" in
  --tune)
    for v in "2 4 1" "2 4 2" "2 4 4" "2 8 2" "3 4 2"; do
      set -- $v
      UNIONSPARSE_IEBME_NSTAGE=$1 UNIONSPARSE_IEBME_WARPS=$2 UNIONSPARSE_IEBME_ILP=$3 \
        python3 benchmarks/bench_iebme.py --tune 2>&1 | grep -E "TUNE|Error|error"
    done | tee "$DEST/iebme_tune.txt" ;;
  --quick) python3 benchmarks/bench_iebme.py --quick --out "$DEST" 2>&1 | tee "$DEST/iebme_log.txt" ;;
  *) python3 benchmarks/bench_iebme.py --out "$DEST" 2>&1 | tee "$DEST/iebme_log.txt" ;;
esac
