#!/usr/bin/env bash
# Which kernel a batched Tiled-CBC decode step of fp16 values should run (issue 38, item 2), in ONE device call
# (about 5 minutes): the several-row spMspV (KernelOp.SPMSPV_ROWS = 8, the default) against the SpMM of the rows'
# masked inputs (SPMSPV_ROWS = 1), LLaMA-2-7B steps at batch 4 and 8, context 512, beside dense fp16, each setting
# its own bench --e2e run (results in $OUT/rows and $OUT/spmm). First the GPU tests of eval on the GPU (float32 dense
# parts: the CPU path's perplexity to 1e-3).
#   device tool:  run(command="bash benchmarks/tcbc_batch_ab_h200.sh", carry=[".whl"], timeout_s=600)
source benchmarks/device_env.sh || exit 1
timeout 120 python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
  tests/test_runtime_agreement.py -k "gpu_eval_runs" 2>&1 | tee "$DEST/eval_gpu_tests.log" | tail -3
ARGS=(bench --e2e --time-budget 100 --spec llama2-7b --batch 4,8 --context 512
      --kinds fp16,tcbc-fp16-30+30,tcbc-fp16-50+30)
for setting in rows spmm; do
  mkdir -p "$DEST/$setting"
  ROWS=$([ "$setting" = rows ] && echo 8 || echo 1)
  timeout 200 python3 -c "
import sys
from unionsparse.compressor.runtime.kernel_op import KernelOp
from unionsparse.compressor.cli import main
KernelOp.SPMSPV_ROWS = $ROWS
main(sys.argv[1:])" "${ARGS[@]}" --out "$DEST/$setting" > "$DEST/$setting/log.txt" 2>&1
  echo "== $setting (SPMSPV_ROWS=$ROWS)"
  sed -n '/^spec/,/^linears/p' "$DEST"/$setting/e2e-*.md
done
