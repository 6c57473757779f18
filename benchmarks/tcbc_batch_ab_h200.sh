#!/usr/bin/env bash
# Tiled-CBC batches and prompts (issue 38, items 2 and 3), in ONE device call (about 6 minutes).
# (1) GPU tests: int-code decode to dense (4-bit as exact float16 halves) and the dense product, against their
#     references; op-by-op agreement of Tiled-CBC int4 (a 200-token prompt takes decode-then-GEMM); eval on the GPU
#     (float32 dense parts: the CPU path's perplexity to 1e-3; int4 thresholds on every row of 64-token windows).
# (2) int4 prefill: the several-row spMspV in launches of 8 rows against decode + cuBLAS (benchmarks/prefill_decode_gemm.py --format tcbc).
# (3) which kernel a batched decode step of fp16 values should run: the several-row spMspV (KernelOp.SPMSPV_ROWS =
#     8, the default) against the SpMM of the rows' masked inputs (SPMSPV_ROWS = 1), LLaMA-2-7B steps at batch 4
#     and 8, context 512, beside dense fp16, each setting its own bench --e2e run (results in $OUT/rows, $OUT/spmm).
#   device tool:  run(command="bash benchmarks/tcbc_batch_ab_h200.sh", carry=[".whl"], timeout_s=600)
source benchmarks/device_env.sh || exit 1
timeout 150 python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
  tests/test_kernels_tiled_cbc.py tests/test_runtime_agreement.py -k "decode_dense or dense_path or gpu_eval_runs or cbc4" \
  2>&1 | tee "$DEST/tcbc_gpu_tests.log" | tail -3
timeout 150 python3 benchmarks/prefill_decode_gemm.py --format tcbc --out "$DEST" 2>&1 | tail -5
ARGS=(bench --e2e --time-budget 80 --spec llama2-7b --batch 4,8 --context 512
      --kinds fp16,tcbc-fp16-30+30,tcbc-fp16-50+30)
for setting in rows spmm; do
  mkdir -p "$DEST/$setting"
  ROWS=$([ "$setting" = rows ] && echo 8 || echo 1)
  timeout 150 python3 -c "
import sys
from unionsparse.compressor.runtime.kernel_op import KernelOp
from unionsparse.compressor.cli import main
KernelOp.SPMSPV_ROWS = $ROWS
main(sys.argv[1:])" "${ARGS[@]}" --out "$DEST/$setting" > "$DEST/$setting/log.txt" 2>&1
  echo "== $setting (SPMSPV_ROWS=$ROWS)"
  sed -n '/^spec/,/^linears/p' "$DEST"/$setting/e2e-*.md
done
