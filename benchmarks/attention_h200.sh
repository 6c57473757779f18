#!/usr/bin/env bash
# Decode attention (issue 36: attention is half of the step outside the linears), in ONE device call (about 6
# minutes after the start; eight files to $OUT, the device tool's most):
#   (1) GPU tests of decode attention in both forms (split: global partials and a ticket; cluster: a head's chunks
#       combined through distributed shared memory, attention.CLUSTER), each waiting first or loading early, and of
#       the glue kernels;
#   (2) attention alone against its byte floor, both forms, 32 layers' cold caches in one graph, and LLaMA-2-7B
#       batch 1 over a sweep of positions, with the split form of the baseline revision beside them
#       (benchmarks/attention_bytes.py);
#   (3) the decode step with attention.cu from the baseline revision and as shipped, side by side in one process
#       (benchmarks/step_ab.py --switch source): LLaMA-2-7B batch 1 context 512 (fp16, IE-BME W4A16 50%), batch 8
#       context 2048 (fp16), then (4), then Llama-3-8B batch 1 context 512 (fp16, IE-BME W4A16 50%);
#   (4) with the cluster form on: the runtime's agreement with the CPU path (op by op, o_proj's input from
#       attention, graph replay against the eager step, the step in one graph).
# In that order, so that a call cut short keeps what matters most (what finished is in $OUT).
# `bash benchmarks/attention_h200.sh quick` (about 3 minutes): (1) for attention only, (2), and (3) at batch 1 only.
# `bash benchmarks/attention_h200.sh forms` (about 8 minutes): the GPU tests of attention, the glue and the quantizing
# kernels (act_rule.cuh), then which form the step should take for MHA, the split
# form against the cluster form side by side in one process (benchmarks/step_ab.py --switch attention), LLaMA-2-7B
# fp16 and IE-BME W4A16 50%, batch 1 at contexts 1024, 2048 and 4096, batch 8 at contexts 512 and 2048, batch 4 at
# 2048 (attention.CLUSTER_FROM_LEN and the batch rule of attention.cluster_form); `forms quick` (about 5 minutes):
# the same tests, then batch 1 at contexts 1024 and 2048 and batch 8 at 2048.
# The baseline is another revision of kernels/attention.cu in .ab/ (git-ignored), made here first, e.g.
#   mkdir -p .ab && git show e798a77:kernels/attention.cu > .ab/attention.cu
#   device tool:  run(command="bash benchmarks/attention_h200.sh", carry=[".whl", ".ab"], timeout_s=600)
set -o pipefail
source benchmarks/device_env.sh || exit 1
PYTEST=(-p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu)
MODE="${1:-all}"
if [ "$MODE" = forms ]; then
  forms() {  # NAME, then step_ab.py's case options; the table to $DEST/step_ab_attention_NAME.md
    local name="$1"; shift
    timeout "${T:-180}" python3 benchmarks/step_ab.py --switch attention "$@" --out "/tmp/forms-$name" \
      2>&1 | grep -v "^launches\|^linears:\|^floor\|^  not measured"
    cp "/tmp/forms-$name/step_ab_attention.md" "$DEST/step_ab_attention_$name.md"
  }
  # first the GPU tests of every kernel that writes an IE-BME input (act_rule.cuh) and of attention in every form
  timeout 150 python3 -m pytest "${PYTEST[@]}" tests/test_attention_kernel.py tests/test_glue_kernels.py \
    tests/test_act_quant_kernel.py tests/test_runtime.py::test_gpu_one_launch_activation_quantization_equals_the_torch_path \
    2>&1 | tee "$DEST/kernel_gpu_tests.log" | tail -4
  if [ "${2:-}" = quick ]; then  # `forms quick` (about 5 minutes): batch 1 at 1024 and 2048, batch 8 at 2048
    T=120 forms b1 --context 1024,2048 --kinds fp16,iebme-w4a16-50
    T=100 forms b8 --batch 8 --context 2048 --kinds fp16,iebme-w4a16-50
    exit 0
  fi
  forms b1 --context 1024,2048,4096 --kinds fp16,iebme-w4a16-50
  T=150 forms b8 --batch 8 --context 512,2048 --kinds fp16,iebme-w4a16-50
  T=70 forms b4 --batch 4 --context 2048 --kinds fp16
  exit 0
fi
TESTS=(tests/test_attention_kernel.py tests/test_glue_kernels.py)
[ "$MODE" = quick ] && TESTS=(tests/test_attention_kernel.py)
timeout 150 python3 -m pytest "${PYTEST[@]}" "${TESTS[@]}" 2>&1 | tee "$DEST/attention_gpu_tests.log" | tail -4
BASE=.ab/attention.cu
[ -f "$BASE" ] || { echo "no $BASE: make it first (this script's header)"; exit 2; }
timeout 150 python3 benchmarks/attention_bytes.py --baseline "$BASE" --out "$DEST" 2>&1 | tail -22
run_ab() {  # NAME, then step_ab.py's case options; the table to $DEST/step_ab_source_NAME.md
  local name="$1"; shift
  timeout 150 python3 benchmarks/step_ab.py --switch source --baseline "attention=$BASE" "$@" --out "/tmp/ab-$name" \
    2>&1 | grep -v "^launches\|^linears:\|^floor\|^  not measured"
  cp "/tmp/ab-$name/step_ab_source.md" "$DEST/step_ab_source_$name.md"
}
run_ab b1 --kinds fp16,iebme-w4a16-50
[ "$MODE" = quick ] && exit 0
run_ab b8-ctx2048 --batch 8 --context 2048 --kinds fp16
timeout 200 python3 -c "
import sys, pytest
from unionsparse.kernels import attention
attention.CLUSTER = True
sys.exit(pytest.main(sys.argv[1:]))" "${PYTEST[@]}" \
  tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op \
  tests/test_runtime_agreement.py::test_gpu_agrees_with_attention_writing_o_proj_input \
  tests/test_runtime_agreement.py::test_gpu_graph_replay_equals_the_eager_step \
  tests/test_runtime.py::test_gpu_decode_step_is_one_graph_without_host_syncs 2>&1 \
  | tee "$DEST/attention_cluster_runtime_tests.log" | tail -4
run_ab llama3-b1 --spec llama3-8b --kinds fp16,iebme-w4a16-50
