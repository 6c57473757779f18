#!/usr/bin/env bash
# On the H200 (device tool, carrying .whl): perplexity runs for SmolLM2-135M that need a GPU to finish in
# minutes, side by side in one call, then the GPU-marked pytest tests (IE-BME, Tiled-CBC, outliers).
#   MODEL=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf DATA=/root/m/data \
#   QUANT_ONLY=w2a4-rtn,... DP_CONFIGS=30:30,40:30 bash benchmarks/run_h200_quality.sh
# The GGUF (~94 MiB) is larger than the device tool's 64 MiB tree limit: copy it over in two calls
# (`split -b 49181216` here, `cat` there), see BENCHMARKS.md. Results go straight to $OUT as each
# configuration finishes (quant.{json,md}, dp_quality.{json,md}), so a call cut short keeps them.
set -u
source benchmarks/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/logs
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
pids=()
if [ -n "${QUANT_ONLY:-}" ]; then
    timeout 540 python3 benchmarks/bench_quant.py --device cuda --parallel 6 --nsamples 128 --seqlen 512 \
        --data-dir "$DATA" --model "$MODEL" --out "$OUT" --only "$QUANT_ONLY" > /tmp/logs/quant.log 2>&1 &
    pids+=($!)
fi
if [ -n "${DP_CONFIGS:-}" ]; then
    timeout 540 python3 benchmarks/bench_dp_quality.py --device cuda --out "$OUT" --model "$MODEL" \
        --data-dir "$DATA" --configs "$DP_CONFIGS" --no-dense --work /tmp/dpwork > /tmp/logs/dp.log 2>&1 &
    pids+=($!)
fi
if [ -n "${GPU_TESTS:-}" ] && python3 -c "import pytest" 2>/dev/null; then
    timeout 300 python3 -m pytest tests -q -m gpu -p no:cacheprovider > /tmp/logs/pytest_gpu.log 2>&1
    tail -5 /tmp/logs/pytest_gpu.log
fi
for p in "${pids[@]}"; do wait "$p"; echo "job $p exit $?"; done
tail -3 /tmp/logs/*.log
tar czf "$OUT/logs.tgz" -C /tmp logs
