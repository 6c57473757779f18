#!/usr/bin/env bash
# Fewer, longer IE-BME CTAs on the decode step (issue 37: the per-launch costs, a 2-4 us prologue and a 1-3 us split-K
# exit a CTA, are half of a mid-size layer's time at batch 1): the launches' K chunks as the chunk rule picks them
# (LLaMA-2-7B: Q/K/V 5, o_proj 11, gate/up 3, down_proj 15) against at most 4 and at most 2
# (LaunchSettings.max_splits; benchmarks/step_ab.py --switch splits), side by side in one process, in ONE device
# call of about 6 minutes: LLaMA-2-7B, context 512, batch 1 (IE-BME W4A4 50% with 128 outlier channels, IE-BME W4A16
# 50%, and fp16, which no setting touches: the run's noise) and batch 8 (W4A4 with outliers). Split-K only reorders
# float32 sums; each setting runs the step checks.
#   device tool:  run(command="bash benchmarks/splits_h200.sh", carry=[".whl"], timeout_s=600)
set -o pipefail
source benchmarks/device_env.sh || exit 1
ab() {  # BATCH KINDS TIMEOUT
  mkdir -p "$DEST/splits-b$1"
  timeout "$3" python3 benchmarks/step_ab.py --switch splits --batch "$1" --kinds "$2" --out "$DEST/splits-b$1" 2>&1 \
    | grep -v "^launches\|^  not measured\|^  missed\|^targets\|^where it loses\|^  iebme"
}
ab 1 fp16,iebme-w4a4-50-o128,iebme-w4a16-50 230
ab 8 iebme-w4a4-50-o128 110
