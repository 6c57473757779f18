#!/usr/bin/env bash
# On the H200 (device tool, carrying .whl): the SpMM wgmma kernel's GPU tests, then the same-run study beside
# cuBLAS (benchmarks/study_spmm_wgmma.py). Results under $OUT: pytest_wgmma.log, spmm_wgmma_study.json, study.log.
# (v5 and its parts study are gone from the tree; their results stay in benchmarks/results/.)
set -u
source benchmarks/device_env.sh || exit 1
OUT=${OUT:-/tmp/out}
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 240 python3 -m pytest tests/test_kernels_tiled_cbc.py -m gpu -p no:cacheprovider -x -k "wgmma or names" \
        2>&1 | tee "$OUT/pytest_wgmma.log" | tail -25
    [ "${PIPESTATUS[0]}" = 0 ] || exit 1
fi
timeout 300 python3 benchmarks/study_spmm_wgmma.py --out "$OUT" --name spmm_wgmma_study.json 2>&1 | tee "$OUT/study.log" \
    | grep -E "GEOMEAN|Error|error|Traceback" | cut -c1-300
