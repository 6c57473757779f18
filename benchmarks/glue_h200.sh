#!/usr/bin/env bash
# Issue 36 (the decode step's glue) in ONE device call (about 6 minutes after the start):
#   (1) the GPU tests of the glue kernels (norms with the residual add, producers, rotary, decode attention, the
#       profiler seeing CuPy launches) and of the runtime (op-by-op agreement with the CPU path, graph replay,
#       eval on the GPU): the step must stay right before its time counts;
#   (2) bench --e2e on LLaMA-2-7B and Llama-3-8B (GQA) at batch 1, context 512, then LLaMA-2-7B at batch 8,
#       context 2048 (into $OUT/b8): time per token, the part outside the linears, and the launches outside the
#       linears per layer and per kind (profiler).
# With .gguf/part00 carried it also leaves SmolLM2's first half in /tmp for a `gpu_check_h200.sh smollm2` call
# right after it (carry [.whl, .gguf/part01, .gpudata]).
#   device tool:  run(command="bash benchmarks/glue_h200.sh", carry=[".whl"], timeout_s=600)
#   any CUDA machine with the package installed:  bash benchmarks/glue_h200.sh   (writes benchmarks/results/)
# .whl: bash benchmarks/h200_wheels.sh, once, here (the image lacks zarr and its codecs).
# `bash benchmarks/glue_h200.sh quick` (about 4 minutes): the glue, attention and outlier-side GPU tests (the side
# product in the IE-BME epilogue too, and the runtime's agreement with outliers), then LLaMA-2-7B at batch 1,
# context 512 only, fp16, W4A16, IE-BME W4A4 with and without 128 outlier channels and W4A8, with the step kernels'
# programmatic dependent launch off and on (benchmarks/step_ab.py --switch pdl).
# `bash benchmarks/glue_h200.sh rope` (about 4 minutes): rotary + KV write inside the attention launch
# (StaticDecoder.ROPE_IN_ATTENTION): its GPU tests (bit for bit against rotary_cache then attention, graph replay
# with o_proj's quantized input), then bench --e2e with it off and on in one process (benchmarks/step_ab.py --switch
# rope), LLaMA-2-7B and Llama-3-8B (GQA), batch 1, context 512 (on by default since 2026-12-07: the same values, one
# launch a layer fewer, the same step time).
# `bash benchmarks/glue_h200.sh knockout` (about 4 minutes): the step with attention, the norms, SiLU·mul, or all
# three replaced by views of their inputs, against the intact step (benchmarks/step_knockout.py): what each op
# costs inside the graph, where the profiler's eager times overlap.
# `bash benchmarks/glue_h200.sh compile` (about 5 minutes, most of it Inductor compiling): the glue three ways on the
# same linears, LLaMA-2-7B batch 1 context 512, fp16 and IE-BME W4A16 50% (benchmarks/glue_compile.py): the
# hand-written kernels, transformers' modules eager, and each glue op through torch.compile.
# `bash benchmarks/glue_h200.sh head` (about 4 minutes): lm_head and the greedy choice in one launch
# (kernels/lm_head.cu, StaticDecoder.HEAD_KERNEL): its GPU tests and the glue's,
# then bench --e2e with it off and on in one process (benchmarks/step_ab.py --switch head), LLaMA-2-7B at
# batch 1, context 512 and batch 8, context 2048, Llama-3-8B (a 128256-token vocabulary) at batch 1.
# `bash benchmarks/glue_h200.sh early` (about 3 minutes): the IE-BME kernel letting the next kernel start only at its
# end, then once its weights landed, then with decode attention's cache loads before its wait (benchmarks/step_ab.py
# --switch early; the last is the default), LLaMA-2-7B batch 1 context 512 (fp16, W4A16, IE-BME W4A16 50%, IE-BME
# W4A4 50% with 128 outlier channels) and batch 8 context 2048 (fp16).
# `bash benchmarks/glue_h200.sh norms` (about 4 minutes): the norms and the quantizing SiLU·mul copying their weight
# and channel permutation into shared memory before their wait (kernels/pdl.cuh, early_copy; NORM_EARLY, on since
# 2026-12-07) or reading them after it (NORM_EARLY=0): the glue GPU tests with each, then the step both ways in one
# process (benchmarks/step_ab.py --switch norms), LLaMA-2-7B batch 1, context 512: fp16, IE-BME W4A16 50%, IE-BME
# W4A4 50% with 128 outlier channels.
set -o pipefail
MODE="${1:-full}"
source benchmarks/device_env.sh || exit 1
if [ "$MODE" = early ]; then
  SKIP="^launches\\|^linears:\\|^floor"
  timeout 260 python3 benchmarks/step_ab.py --switch early --kinds fp16,w4a16,iebme-w4a16-50,iebme-w4a4-50-o128 \
    --out "$DEST" 2>&1 | tee "$DEST/step_ab_early.log" | grep -v "$SKIP"
  mkdir -p "$DEST/b8"
  timeout 100 python3 benchmarks/step_ab.py --switch early --batch 8 --context 2048 --kinds fp16 --out "$DEST/b8" \
    2>&1 | tee "$DEST/b8/step_ab_early.log" | grep -v "$SKIP"
  exit 0
fi
if [ "$MODE" = norms ]; then
  for early in 1 0; do
    echo "== glue GPU tests, NORM_EARLY=$early" | tee -a "$DEST/norms_gpu_tests.log"
    timeout 70 python3 -c "
import sys, pytest
from unionsparse.kernels import study
for k in ('glue', 'norm_quant'):
    study.use_build(k, study.Build(defines=(('NORM_EARLY', $early),)))
sys.exit(pytest.main(sys.argv[1:]))" -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
      tests/test_glue_kernels.py 2>&1 | tee -a "$DEST/norms_gpu_tests.log" | tail -2
  done
  timeout 220 python3 benchmarks/step_ab.py --switch norms --kinds fp16,iebme-w4a16-50,iebme-w4a4-50-o128 \
    --out "$DEST" 2>&1 | tee "$DEST/step_ab_norms.log" | grep -v "^launches\|^linears:\|^floor\|^  not measured"
  exit 0
fi
if [ "$MODE" = head ]; then
  timeout 120 python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
    tests/test_lm_head.py tests/test_glue_kernels.py 2>&1 | tee "$DEST/head_gpu_tests.log" | tail -3
  timeout 200 python3 benchmarks/step_ab.py --switch head --kinds fp16,w4a16,iebme-w4a16-50 \
    --out "$DEST" 2>&1 | tee "$DEST/step_ab_head.log" | grep -v "^launches\|^linears:\|^floor"
  mkdir -p "$DEST/b8" "$DEST/llama3"
  timeout 120 python3 benchmarks/step_ab.py --switch head --batch 8 --context 2048 --kinds fp16,iebme-w4a16-50 \
    --out "$DEST/b8" 2>&1 | tee "$DEST/b8/step_ab_head.log" | grep -v "^launches\|^linears:\|^floor"
  timeout 120 python3 benchmarks/step_ab.py --switch head --spec llama3-8b --kinds fp16,iebme-w4a16-50 \
    --out "$DEST/llama3" 2>&1 | tee "$DEST/llama3/step_ab_head.log" | grep -v "^launches\|^linears:\|^floor"
  exit 0
fi
if [ "$MODE" = knockout ]; then  # what each glue op costs the graphed step (benchmarks/step_knockout.py)
  timeout 400 python3 benchmarks/step_knockout.py --kinds "${KINDS:-fp16,iebme-w4a16-50}" --out "$DEST" 2>&1 \
    | tee "$DEST/step_knockout.log" | tail -8
  exit 0
fi
if [ "$MODE" = compile ]; then  # issue 36 item 3: hand-written glue, torch eager, torch.compile (Inductor)
  timeout 500 python3 benchmarks/glue_compile.py --kinds "${KINDS:-fp16,iebme-w4a16-50}" --out "$DEST" 2>&1 \
    | tee "$DEST/glue_compile.log" | grep -v "^W1\|^I1" | tail -20
  exit 0
fi
if [ "$MODE" = rope ]; then
  timeout 150 python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
    tests/test_attention_kernel.py tests/test_glue_kernels.py 2>&1 | tee "$DEST/rope_gpu_tests.log" | tail -3
  timeout 200 python3 benchmarks/step_ab.py --switch rope --kinds fp16,w4a16,iebme-w4a16-50,iebme-w4a4-50-o128 \
    --out "$DEST" 2>&1 | tee "$DEST/step_ab_rope.log" | grep -v "^launches\|^linears:\|^floor"
  mkdir -p "$DEST/llama3"
  timeout 150 python3 benchmarks/step_ab.py --switch rope --spec llama3-8b --kinds fp16,iebme-w4a16-50 \
    --out "$DEST/llama3" 2>&1 | tee "$DEST/llama3/step_ab_rope.log" | grep -v "^launches\|^linears:\|^floor"
  exit 0
fi
if [ "$MODE" = quick ]; then
  timeout 300 python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
    tests/test_glue_kernels.py tests/test_attention_kernel.py \
    tests/test_runtime.py::test_gpu_outlier_side_kernel_equals_the_torch_path \
    tests/test_runtime.py::test_gpu_decode_step_is_one_graph_without_host_syncs \
    tests/test_kernels_iebme.py::test_gpu_ring_variants_and_trace \
    tests/test_kernels_iebme.py::test_gpu_outlier_side_product_in_the_epilogue \
    tests/test_kernels_iebme.py::test_gpu_partials_exact_and_output_close \
    "tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op[w4a4-outliers-fused]" \
    "tests/test_runtime_agreement.py::test_gpu_agrees_on_smollm2_shapes[w4a4-outliers]" \
    "tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op[w4a8-fused]" \
    "tests/test_runtime_agreement.py::test_gpu_agrees_on_smollm2_shapes[w4a8]" \
    2>&1 | tee "$DEST/glue_gpu_tests.log" | tail -3
  timeout 300 python3 benchmarks/step_ab.py --switch pdl --out "$DEST" 2>&1 | tee "$DEST/step_ab_pdl.log" \
    | grep -v "^launches\|^linears:\|^floor"
  exit 0
fi
timeout 150 python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m "gpu and not slow" \
  tests/test_glue_kernels.py tests/test_attention_kernel.py tests/test_runtime_agreement.py 2>&1 \
  | tee "$DEST/glue_gpu_tests.log" | tail -8
E2E_BUDGET="${E2E_BUDGET:-170}" E2E_TIMEOUT="${E2E_TIMEOUT:-250}" OUT="$DEST" bash benchmarks/e2e_h200.sh \
  --spec llama2-7b,llama3-8b --batch 1 --context 512 > /dev/null 2>&1
mkdir -p "$DEST/b8"
E2E_BUDGET="${E2E_BUDGET_B8:-80}" E2E_TIMEOUT="${E2E_TIMEOUT_B8:-150}" OUT="$DEST/b8" bash benchmarks/e2e_h200.sh \
  --spec llama2-7b --batch 8 --context 2048 > /dev/null 2>&1
for f in "$DEST"/e2e-*.md "$DEST"/b8/e2e-*.md; do sed -n '/^spec/,/^linears/p' "$f"; grep "launches outside" "$f"; done
