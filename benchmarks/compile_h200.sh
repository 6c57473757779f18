#!/usr/bin/env bash
# The kernel modules as the runtime now builds them (docs/kernels.md, "Compile time": one head dimension of
# attention, one value type of the Tiled-CBC spMspV, the prompt's decode kernels apart from the SpMM module),
# in ONE device call (about 5 minutes after the start):
#   (1) first-build times on a fresh CuPy cache, beside the whole files (benchmarks/compile_times.py);
#   (2) the GPU tests of those kernels: attention (both forms; its cache loads before the wait), lm_head with the
#       greedy choice, the glue, Tiled-CBC (spMspV per value type, SpMM, decode to
#       dense, int codes), dynamic pruning; then the runtime's agreement with the CPU path for every configuration
#       (op by op, tiny models) and eval on the GPU against the CPU perplexity.
#   device tool:  run(command="bash benchmarks/compile_h200.sh", carry=[".whl"], timeout_s=600)
set -o pipefail
source benchmarks/device_env.sh || exit 1
CUPY_CACHE_DIR="$(mktemp -d)" timeout 240 python3 benchmarks/compile_times.py --out "$DEST" 2>&1 | tail -8
PYTEST=(python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu)
timeout 200 "${PYTEST[@]}" tests/test_attention_kernel.py tests/test_kernels_tiled_cbc.py tests/test_dynamic_pruning.py \
  tests/test_lm_head.py tests/test_glue_kernels.py \
  2>&1 | tee "$DEST/compile_split_kernel_tests.log" | tail -4
# the runtime's agreement with attention's early cache loads and the lm_head launch on (off by default until now)
timeout 240 python3 -c "
import sys, pytest
from unionsparse.kernels import attention
from unionsparse.compressor.runtime.decoder import StaticDecoder
attention.EARLY = StaticDecoder.HEAD_KERNEL = True
sys.exit(pytest.main(sys.argv[1:]))" -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
  "tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op" \
  "tests/test_runtime_agreement.py::test_gpu_eval_runs_the_runtime_and_matches_the_cpu_perplexity" \
  tests/test_runtime.py::test_gpu_decode_step_is_one_graph_without_host_syncs 2>&1 \
  | tee "$DEST/compile_split_runtime_tests.log" | tail -4
