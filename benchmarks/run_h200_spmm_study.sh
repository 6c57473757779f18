#!/usr/bin/env bash
# On the H200 (device tool, carrying .whl): the SpMM wgmma kernel's GPU tests, then the same-run study beside
# cuBLAS (benchmarks/study_spmm_wgmma.py). Results under $OUT: pytest_wgmma.log, spmm_wgmma_study.json, study.log.
# (v5 and its parts study are gone from the tree; their results stay in benchmarks/results/.)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/shim/unionsparse && for d in compressor solvers formats kernels; do ln -sfn "$PWD/$d" /tmp/shim/unionsparse/$d; done
export PYTHONPATH=/tmp/shim:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 240 python3 -m pytest tests/test_kernels_tiled_cbc.py -m gpu -p no:cacheprovider -x -k "wgmma or names" \
        2>&1 | tee "$OUT/pytest_wgmma.log" | tail -25
    [ "${PIPESTATUS[0]}" = 0 ] || exit 1
fi
timeout 300 python3 benchmarks/study_spmm_wgmma.py --out "$OUT" --name spmm_wgmma_study.json 2>&1 | tee "$OUT/study.log" \
    | grep -E "GEOMEAN|Error|error|Traceback" | cut -c1-300
