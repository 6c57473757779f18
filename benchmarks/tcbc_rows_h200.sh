#!/usr/bin/env bash
# The 2026-12-07 GPU work in ONE device call (under 9 minutes): Tiled-CBC decode at batch > 1 (issue 38, item 2),
# o_proj's quantized input from the attention launch (issue 36), and the untimed IE-BME kinds:
#   (1) GPU tests: the several-row spMspV against its CPU reference (2 to 11 rows, every launch path, fp16 / int4 /
#       int2 values), the verify check with several rows, the runtime's op-by-op agreement with the CPU path for
#       Tiled-CBC with thresholds (tiny and SmolLM2-shaped models; the padded batch of 3 runs the several-row
#       kernel); attention.cu writing o_proj's input bit for bit as act_quant.cu, and the runtime's agreement with it
#       (head-128 model, W4A8 and W4A4);
#   (2) bench --e2e, LLaMA-2-7B, context 512, batch 1, 4 and 8: fp16, W4A16, Tiled-CBC fp16 (30, 30) and (50, 30),
#       int4 (50, 30) and (50, 50), IE-BME W4A8 50% (o_proj's input from attention), IE-BME W4A4 50% with 128
#       outliers with and without the exact-DP row reorder.
#   device tool:  run(command="bash benchmarks/tcbc_rows_h200.sh", carry=[".whl"], timeout_s=600)
#   any CUDA machine with the package installed:  bash benchmarks/tcbc_rows_h200.sh   (writes benchmarks/results/)
# .whl: bash benchmarks/h200_wheels.sh, once, here (the image lacks zarr and its codecs).
set -o pipefail
source benchmarks/device_env.sh || exit 1
timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
  tests/test_kernels_tiled_cbc.py -k "rows or quantized_layer or fp16_layer or agrees or attention" \
  "tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op[cbc-dp-fused]" \
  "tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op[cbc4-dp-separate]" \
  "tests/test_runtime_agreement.py::test_gpu_agrees_on_smollm2_shapes[cbc-dp]" \
  "tests/test_runtime_agreement.py::test_gpu_agrees_on_smollm2_shapes[cbc4-dp]" \
  "tests/test_runtime_agreement.py::test_gpu_agrees_with_attention_writing_o_proj_input" \
  tests/test_attention_kernel.py \
  2>&1 | tee "$DEST/tcbc_rows_gpu_tests.log" | tail -4
E2E_BUDGET="${E2E_BUDGET:-230}" E2E_TIMEOUT="${E2E_TIMEOUT:-300}" OUT="$DEST" bash benchmarks/e2e_h200.sh \
  --spec llama2-7b --batch 1,4,8 --context 512 \
  --kinds fp16,w4a16,tcbc-fp16-30+30,tcbc-int4-50+30,iebme-w4a8-50,tcbc-int4-50+50,tcbc-fp16-50+30,iebme-w4a4-50-o128,iebme-w4a4-50-o128-dp \
  > "$DEST/tcbc_rows_e2e.log" 2>&1
for f in "$DEST"/e2e-*.md; do sed -n '/^spec/,/^linears/p' "$f"; grep -A30 "^targets" "$f" | grep -i "tcbc\|dp" | head -20; done
