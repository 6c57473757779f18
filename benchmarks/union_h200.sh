#!/usr/bin/env bash
# IE-BME prompts and union-structured masks (issue 37), in ONE device call (about 5 minutes):
# (1) GPU tests of the IE-BME prompt paths (kernels/iebme_decode.cu: the dense weight bit for bit its reference;
#     W4A16: decode once + cuBLAS; W4A4 / W2A4 / W4A8: the same weight times the inputs' exact halves, two GEMMs into
#     float32; the runtime's op-by-op agreement with them on: kernels.iebme_decode.DENSE_PREFILL, on by default).
# (2) their prefill timing against the kernel's 32-token launches (benchmarks/prefill_decode_gemm.py --format iebme
#     and iebme-int);
# (3) does sparsity buy time when the bytes shrink? bench --e2e, LLaMA-2-7B, context 512, batch 1 and 8, IE-BME W4A16
#     with union-structured masks (--structure union: 50 / 70 / 90%, the union bitmap holding 1 - sparsity of the
#     positions) beside the unstructured 50% (94% of the positions) and the 0% control, fp16 and dense W4A16
#     (tinygemm). Results in $OUT/union.
#   device tool:  run(command="bash benchmarks/union_h200.sh", carry=[".whl"], timeout_s=600)
# `bash benchmarks/union_h200.sh prefill` (about 2 minutes): (1) and (2) only.
source benchmarks/device_env.sh || exit 1
timeout 150 python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m gpu \
  tests/test_kernels_iebme.py tests/test_runtime_agreement.py -k "decode_dense or dense_prefill or dense_int" \
  2>&1 | tee "$DEST/iebme_prefill_gpu_tests.log" | tail -3
timeout 90 python3 benchmarks/prefill_decode_gemm.py --format iebme --rows 32,64,128,512 --out "$DEST" 2>&1 | tail -5
timeout 90 python3 benchmarks/prefill_decode_gemm.py --format iebme-int --rows 32,64,128,512 --out "$DEST" 2>&1 | tail -5
[ "${1:-}" = prefill ] && exit 0
mkdir -p "$DEST/union"
E2E_BUDGET="${E2E_BUDGET:-110}" E2E_TIMEOUT="${E2E_TIMEOUT:-190}" OUT="$DEST/union" bash benchmarks/e2e_h200.sh \
  --spec llama2-7b --batch "${BATCHES:-1,8}" --context 512 \
  --kinds "${KINDS:-fp16,w4a16,iebme-w4a16-0,iebme-w4a16-50,iebme-w4a16-50u,iebme-w4a16-70u,iebme-w4a16-90u}" \
  > "$DEST/union/log.txt" 2>&1
for f in "$DEST"/union/e2e-*.md; do sed -n '/^spec/,/^linears/p' "$f"; grep "sparsity is not turned" "$f"; done
