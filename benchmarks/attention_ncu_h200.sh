#!/usr/bin/env bash
# Nsight Compute on one decode-attention launch per case (benchmarks/ncu_attention.py), in ONE device call (about a
# minute; three cases took 33 s on an H100): where attention's time goes against the copy bandwidth (throughput,
# occupancy, warp stalls), and at batch 8, context 512 why the cluster form lost to the split form on the step.
# One text report a case to $OUT (device tool: carry [".whl"]).
#   device tool:  run(command="bash benchmarks/attention_ncu_h200.sh", carry=[".whl"], timeout_s=600)
set -o pipefail
source benchmarks/device_env.sh || exit 1
NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
for c in "b8-ctx2048 split" "b8-ctx512 split" "b8-ctx512 cluster" "b1-ctx512 split" "llama3-b1 cluster"; do
  set -- $c
  timeout 150 "$NCU" --clock-control none --kernel-name regex:attention_decode --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats \
    python3 benchmarks/ncu_attention.py "$1" "$2" > "$DEST/attention_ncu_$1_$2.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|No Eligible|Issued Warp" \
    "$DEST/attention_ncu_$1_$2.txt" | head -30
  echo "== $c"
done
