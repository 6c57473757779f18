#!/usr/bin/env bash
# The outlier side product in the IE-BME epilogue (issue 37: "with the outlier side product inside it"), in ONE
# device call of about 5 minutes, with the side's activation codes and scales staged in shared memory with X
# (study build IEBME_SIDE_STAGE=1) against the shipped epilogue that reads them from global memory per column:
#   (1) GPU tests with the staged build: the kernel against the reference with the side (one group of 16 / 128 /
#       272 channels, several groups; 1-3 splits; N = 1, 5, 8, 40; both builds), the ring variants, the outlier
#       GPU check, the runtime's side kernels, the runtime's op-by-op agreement with the CPU path (W4A4 and W2A4
#       with outliers among its cases);
#   (2) the decode step both ways side by side in one process (benchmarks/step_ab.py --switch side): LLaMA-2-7B,
#       context 512, batch 1 and 8, IE-BME W4A4 50% with 128 outlier channels and, as the control the change must
#       not move, W4A8 50% without.
#   device tool:  run(command="bash benchmarks/side_h200.sh", carry=[".whl"], timeout_s=600)
# `bash benchmarks/side_h200.sh tests` runs (1) alone (about 2 minutes).
set -o pipefail
source benchmarks/device_env.sh || exit 1
staged() {  # pytest under the staged build
  python3 -c "
import sys, pytest
from unionsparse.kernels import study
study.use_build('iebme_spmm', study.Build(defines=(('IEBME_SIDE_STAGE', 1),)))
sys.exit(pytest.main(sys.argv[1:]))" -p no:cacheprovider -q -rs -W ignore::DeprecationWarning "$@"
}
timeout 200 staged -m gpu -k "outlier or ring_variants or side" tests/test_kernels_iebme.py tests/test_outliers.py \
  tests/test_runtime.py 2>&1 | tee "$DEST/side_gpu_tests.log" | tail -4
timeout 150 staged -m "gpu and not slow" tests/test_runtime_agreement.py::test_gpu_agrees_with_the_cpu_path_op_by_op \
  2>&1 | tee -a "$DEST/side_gpu_tests.log" | tail -3
[ "${1:-}" = tests ] && exit 0
for b in 1 8; do
  mkdir -p "$DEST/b$b"
  timeout 110 python3 benchmarks/step_ab.py --switch side --batch $b --kinds iebme-w4a4-50-o128,iebme-w4a8-50 \
    --out "$DEST/b$b" 2>&1 | grep -v "^launches\|^  not measured"
done
