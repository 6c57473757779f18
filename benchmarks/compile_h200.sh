#!/usr/bin/env bash
# The kernel modules as the runtime now builds them (docs/kernels.md, "Compile time": one head dimension of
# attention, one value type of the Tiled-CBC spMspV, the prompt's decode kernels apart from the SpMM module),
# in ONE device call (about 8 minutes after the start):
#   (1) first-build times on a fresh CuPy cache, beside the whole files (benchmarks/compile_times.py);
#   (2) the GPU tests of those kernels: attention (both forms, its cache loads before the wait or not), lm_head
#       with the greedy choice, the glue, the Tiled-CBC spMspV per value type and the decode to dense; then the
#       runtime's agreement with the CPU path for every configuration (op by op, tiny models; Tiled-CBC with
#       thresholds among them), eval on the GPU against the CPU perplexity, and the step as one graph.
#   device tool:  run(command="bash benchmarks/compile_h200.sh", carry=[".whl"], timeout_s=600)
set -o pipefail
source benchmarks/device_env.sh || exit 1
CUPY_CACHE_DIR="$(mktemp -d)" timeout 150 python3 benchmarks/compile_times.py --out "$DEST" 2>&1 | tail -8
PYTEST=(python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu)
timeout 170 "${PYTEST[@]}" tests/test_attention_kernel.py tests/test_lm_head.py tests/test_glue_kernels.py 2>&1 \
  | tee "$DEST/compile_split_kernel_tests.log" | tail -4
# the Tiled-CBC kernels whose modules were split (26 of the file's 47 GPU tests; all 47 took about 4 minutes, and
# tests/test_dynamic_pruning.py's one GPU test about 6, its fixtures compressing models: H100, 2026-12-07)
timeout 130 "${PYTEST[@]}" tests/test_kernels_tiled_cbc.py -k "decode_dense or quantized_spmspv or spmspv_rows or fp16_layer" 2>&1 \
  | tee "$DEST/compile_split_tcbc_tests.log" | tail -4
timeout 120 "${PYTEST[@]}" \
  "tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op" \
  "tests/test_runtime_agreement.py::test_gpu_eval_runs_the_runtime_and_matches_the_cpu_perplexity" \
  tests/test_runtime.py::test_gpu_decode_step_is_one_graph_without_host_syncs 2>&1 \
  | tee "$DEST/compile_split_runtime_tests.log" | tail -4
