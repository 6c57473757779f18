#!/usr/bin/env bash
# The outlier side product in the IE-BME epilogue (issue 37: "with the outlier side product inside it"), in ONE
# device call of about 8 minutes, with the side's activation codes and scales staged in shared memory with X
# (study build IEBME_SIDE_STAGE=1) against the shipped epilogue that reads them from global memory per column:
#   (0) the shipped build's GPU tests of the kernels that write an IE-BME input with kernels/act_rule.cuh (decode
#       attention in every form with o_proj's quantized input, the glue and quantizing producers, act_quant);
#   (1) GPU tests with the staged build: the kernel against the reference with the side (one group of 16 / 128 /
#       272 channels, several groups; 1-3 splits; N = 1, 5, 8, 40; both builds), the ring variants, the outlier
#       GPU check, the runtime's side kernels, the runtime's op-by-op agreement with the CPU path for every case
#       with outliers (W4A4, W2A4; tiny and SmolLM2-shaped; prompts of 1 and 200 tokens, a padded batch of 3);
#   (2) the decode step both ways side by side in one process (benchmarks/step_ab.py --switch side): LLaMA-2-7B,
#       context 512, IE-BME W4A4 50% with 128 outlier channels at batch 1 and 8, and at batch 1, as the control the
#       change must not move, W4A8 50% without outliers.
#   device tool:  run(command="bash benchmarks/side_h200.sh", carry=[".whl"], timeout_s=600)
# `bash benchmarks/side_h200.sh tests` runs (0) and (1) alone (about 4 minutes).
set -o pipefail
source benchmarks/device_env.sh || exit 1
PYTEST=(-p no:cacheprovider -q -rs -W ignore::DeprecationWarning)
timeout 150 python3 -m pytest "${PYTEST[@]}" -m gpu tests/test_attention_kernel.py tests/test_glue_kernels.py \
  tests/test_act_quant_kernel.py 2>&1 | tee "$DEST/act_rule_gpu_tests.log" | tail -3
staged() {  # pytest under the staged build
  python3 -c "
import sys, pytest
from unionsparse.kernels import study
study.use_build('iebme_spmm', study.Build(defines=(('IEBME_SIDE_STAGE', 1),)))
sys.exit(pytest.main(sys.argv[1:]))" "${PYTEST[@]}" "$@"
}
timeout 120 staged -m gpu -k "outlier or ring_variants or side" tests/test_kernels_iebme.py tests/test_outliers.py \
  tests/test_runtime.py 2>&1 | tee "$DEST/side_gpu_tests.log" | tail -3
timeout 120 staged -m "gpu and not slow" -k outliers tests/test_runtime_agreement.py 2>&1 \
  | tee -a "$DEST/side_gpu_tests.log" | tail -3
[ "${1:-}" = tests ] && exit 0
ab() {  # BATCH KINDS
  mkdir -p "$DEST/b$1"
  timeout 110 python3 benchmarks/step_ab.py --switch side --batch "$1" --kinds "$2" --out "$DEST/b$1" 2>&1 \
    | grep -v "^launches\|^  not measured"
}
ab 1 iebme-w4a4-50-o128,iebme-w4a8-50
ab 8 iebme-w4a4-50-o128
