#!/usr/bin/env bash
# The Tiled-CBC spMspV's 4-bit decode, predicated rows (mode 0, the default) against the byte-permute scatter (mode 4,
# kernels/tiled_cbc_spmspv.cu; issue 38: "a register-level decode of the bitmap instead of per-row predicated slots"),
# in ONE device call of about 7 minutes:
#   (1) GPU tests of the 4-bit spMspV against the float64 product: every mode, split-K chunks and stream-K, full and
#       near-empty bitmap bytes, empty columns; the copy paths; the several-row kernels (mode 0, unchanged);
#   (2) both modes per layer beside cuBLAS fp16 GEMV (benchmarks/study_spmspv_modes.py --bits 4 --quick: 4 corpus
#       shapes at static 50% + 30% activation sparsity, split-K, stream-K and the launch rule each), and mode 0 with
#       each GTile copied whole by one lane (study build TCBC_WHOLE=1, labelled /tcbc_whole);
#   (3) the decode step both ways in one process (benchmarks/step_ab.py --switch int4-decode), LLaMA-2-7B, batch 1,
#       context 512, Tiled-CBC int4 (50, 30) and (50, 50).
#   device tool:  run(command="bash benchmarks/int4_decode_h200.sh", carry=[".whl"], timeout_s=600)
set -o pipefail
source benchmarks/device_env.sh || exit 1
timeout 200 python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
  tests/test_kernels_tiled_cbc.py -k "quantized_spmspv_every_chunk or quantized_layer or copy_paths or rows_every" \
  2>&1 | tee "$DEST/int4_decode_gpu_tests.log" | tail -3
{ echo "#define TCBC_WHOLE 1"; cat kernels/tiled_cbc_spmspv.cu; } > /tmp/tcbc_whole.cu
timeout 170 python3 benchmarks/study_spmspv_modes.py --bits 4 --quick --statics 0.5 --out "$DEST" \
  --name int4_decode_modes.json --baseline /tmp/tcbc_whole.cu 2>&1 | tee "$DEST/int4_decode_modes.log" | grep "SUMMARY"
timeout 200 python3 benchmarks/step_ab.py --switch int4-decode --kinds tcbc-int4-50+30,tcbc-int4-50+50 \
  --out "$DEST" 2>&1 | tee "$DEST/step_ab_int4_decode.log" | grep -v "^launches\|^  not measured"
