#!/usr/bin/env bash
# Does sparsity buy time when the bytes shrink? (issue 37) In ONE device call (about 3 minutes): bench --e2e,
# LLaMA-2-7B, context 512, batch 1 and 8, IE-BME W4A16 with union-structured masks (--structure union: 50 / 70 / 90%,
# the union bitmap holding 1 - sparsity of the positions) beside the unstructured 50% (94% of the positions) and the
# 0% control, fp16 and dense W4A16 (tinygemm). Results in $OUT/union.
#   device tool:  run(command="bash benchmarks/union_h200.sh", carry=[".whl"], timeout_s=600)
source benchmarks/device_env.sh || exit 1
mkdir -p "$DEST/union"
E2E_BUDGET="${E2E_BUDGET:-120}" E2E_TIMEOUT="${E2E_TIMEOUT:-200}" OUT="$DEST/union" bash benchmarks/e2e_h200.sh \
  --spec llama2-7b --batch "${BATCHES:-1,8}" --context 512 \
  --kinds "${KINDS:-fp16,w4a16,iebme-w4a16-0,iebme-w4a16-50,iebme-w4a16-50u,iebme-w4a16-70u,iebme-w4a16-90u}" \
  > "$DEST/union/log.txt" 2>&1
for f in "$DEST"/union/e2e-*.md; do sed -n '/^spec/,/^linears/p' "$f"; grep "sparsity is not turned" "$f"; done
