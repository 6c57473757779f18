#!/usr/bin/env bash
# The outlier side product in the IE-BME epilogue (its activation codes and scales staged with X; issue 37: "with
# the outlier side product inside it") against the revision before (1774c49: the codes read from global memory per
# output column), in ONE device call of about 6 minutes:
#   (1) GPU tests: the kernel's side product against the reference (one group of 16 / 128 / 272 channels, several
#       groups; 1-3 splits; N = 1, 5, 8, 40), the ring variants, the outlier GPU check, the runtime's side kernels,
#       the runtime's op-by-op agreement with the CPU path for every case with outliers (W4A4, W2A4; tiny and
#       SmolLM2-shaped; prompts of 1 and 200 tokens, a padded batch of 3);
#   (2) the decode step both ways side by side in one process (benchmarks/step_ab.py --switch source): LLaMA-2-7B,
#       context 512, IE-BME W4A4 50% with 128 outlier channels at batch 1 and 8, and at batch 1, as the control the
#       change must not move, W4A8 50% without outliers.
# The baseline, made here first:
#   mkdir -p .ab && git show 1774c49:kernels/iebme_spmm.cu > .ab/iebme_spmm.cu
#   device tool:  run(command="bash benchmarks/side_h200.sh", carry=[".whl", ".ab"], timeout_s=600)
# `bash benchmarks/side_h200.sh tests` runs (1) alone (about 2 minutes; no baseline needed).
# `bash benchmarks/side_h200.sh last` (about 5 minutes, no baseline): the side added by the last K chunk's CTA (study
# build IEBME_SIDE_LAST=1; often the shortest chunk, so the side may hide behind its partners' longer loops): (1) with
# that build, then the step with the first and the last chunk's CTA side by side (benchmarks/step_ab.py --switch
# side-cta), batch 1 (and the W4A8 control) and 8.
set -o pipefail
source benchmarks/device_env.sh || exit 1
MODE="${1:-all}"
DEFS="()"  # the study build's macros: none (the shipped kernel), or the last K chunk's CTA adding the side
[ "$MODE" = last ] && DEFS="(('IEBME_SIDE_LAST', 1),)"
PYTEST=(python3 -c "import sys, pytest; from unionsparse.kernels import study
study.use_build('iebme_spmm', study.Build(defines=$DEFS)); sys.exit(pytest.main(sys.argv[1:]))"
  -p no:cacheprovider -q -rs -W ignore::DeprecationWarning)
LOG="$DEST/side_gpu_tests_$MODE.log"
timeout 120 "${PYTEST[@]}" -m gpu -k "outlier or ring_variants or side" tests/test_kernels_iebme.py \
  tests/test_outliers.py tests/test_runtime.py 2>&1 | tee "$LOG" | tail -3
timeout 120 "${PYTEST[@]}" -m "gpu and not slow" -k outliers tests/test_runtime_agreement.py 2>&1 | tee -a "$LOG" | tail -3
[ "$MODE" = tests ] && exit 0
BASE=.ab/iebme_spmm.cu
if [ "$MODE" = last ]; then
  SWITCH=(--switch side-cta)
else
  [ -f "$BASE" ] || { echo "no $BASE: make it first (this script's header)"; exit 2; }
  SWITCH=(--switch source --baseline "iebme_spmm=$BASE")
fi
ab() {  # BATCH KINDS
  mkdir -p "$DEST/b$1"
  timeout 110 python3 benchmarks/step_ab.py "${SWITCH[@]}" --batch "$1" --kinds "$2" --out "$DEST/b$1" 2>&1 \
    | grep -v "^launches\|^  not measured"
}
ab 1 iebme-w4a4-50-o128,iebme-w4a8-50
ab 8 iebme-w4a4-50-o128
