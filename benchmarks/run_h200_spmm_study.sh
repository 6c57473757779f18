#!/usr/bin/env bash
# On the H200 (device tool, carrying .whl): the SpMM wgmma kernels' GPU tests, where v5's time goes
# (benchmarks/study_spmm_v5_parts.py), then the same-run study beside cuBLAS (benchmarks/study_spmm_wgmma.py).
# Results under $OUT: pytest_v5.log, tiled_cbc_spmm_v5_parts.json, spmm_v5_study.json, study.log.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/shim/unionsparse && for d in compressor solvers formats kernels; do ln -sfn "$PWD/$d" /tmp/shim/unionsparse/$d; done
export PYTHONPATH=/tmp/shim:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 240 python3 -m pytest tests/test_kernels_tiled_cbc.py -m gpu -p no:cacheprovider -x -k "wgmma or names" \
        2>&1 | tee "$OUT/pytest_v5.log" | tail -25
    [ "${PIPESTATUS[0]}" = 0 ] || exit 1
fi
[ -z "${PARTS:-}" ] || timeout 200 python3 benchmarks/study_spmm_v5_parts.py --out "$OUT" --skips "$PARTS" 2>&1 | tail -8
timeout 300 python3 benchmarks/study_spmm_wgmma.py --out "$OUT" --name spmm_v5_study.json 2>&1 | tee "$OUT/study.log" \
    | grep -E "GEOMEAN|Error|error|Traceback" | cut -c1-300
