#!/usr/bin/env bash
# IE-BME with float16 activations (W4A16 / W2A16 through the IE-BME kernel; issue 37, item 2) in ONE device call
# (about 5 minutes). The variant is off by default (kernels.iebme_spmm.FLOAT16_ACTIVATIONS) until these tests pass;
# then set it True. (1) GPU tests: the kernel's float16-activation variant against the float64 product of the
# decoded codes (bits 4 / 2, row permutations, N = 1 to 40, split-K and clusters), the runtime's op-by-op agreement
# for W4A16 (tiny and SmolLM2-shaped models), eval on the GPU with float32 dense parts against the CPU path;
# (2) bench --e2e, LLaMA-2-7B, context 512, batch 1 and 8: fp16, dense W4A16 (tinygemm), IE-BME W4A16 50% and its 0%
# control, IE-BME W4A8 50%.
#   device tool:  run(command="bash benchmarks/w4a16_h200.sh", carry=[".whl"], timeout_s=600)
source benchmarks/device_env.sh || exit 1
timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
  tests/test_kernels_iebme.py -k "float16 or w4a16 or gpu_eval_runs" \
  "tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op[w4a16-separate]" \
  "tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op[w4a16-fused]" \
  "tests/test_runtime_agreement.py::test_gpu_agrees_on_smollm2_shapes[w4a16]" \
  tests/test_runtime_agreement.py::test_gpu_float16_activation_kernel_agrees \
  tests/test_runtime_agreement.py::test_gpu_eval_runs_the_runtime_and_matches_the_cpu_perplexity \
  2>&1 | tee "$DEST/w4a16_gpu_tests.log" | tail -4
E2E_BUDGET="${E2E_BUDGET:-110}" E2E_TIMEOUT="${E2E_TIMEOUT:-190}" OUT="$DEST" bash benchmarks/e2e_h200.sh \
  --spec llama2-7b --batch "${BATCHES:-1,8}" --context 512 --kinds "${KINDS:-fp16,w4a16,iebme-w4a16-50,iebme-w4a16-0,iebme-w4a8-50}" \
  > "$DEST/w4a16_e2e.log" 2>&1
for f in "$DEST"/e2e-*.md; do sed -n '/^spec/,/^linears/p' "$f"; done
