#!/usr/bin/env bash
# `unionsparse bench --e2e` on the H200 in ONE device call (issue 28, item 5): time per output token of whole
# CUDA-graph decode steps, synthetic LLaMA-2-7B then Llama-3-8B, batch 1/4/8, context 512/2048, every linear
# kind beside dense fp16 and W4A16, breakdown and byte floor, HF eager generate beside it.
#
#   device tool:  run(command="bash benchmarks/e2e_h200.sh", carry=[".whl"], timeout_s=600)
#   any CUDA machine with the package installed:  bash benchmarks/e2e_h200.sh   (writes benchmarks/results/)
#
# The image has torch, CuPy, transformers and numba but not zarr and its codecs (the runtime imports them): make
# .whl once, here, in the repo root (git-ignored): bash benchmarks/h200_wheels.sh
#
# Order: (1) the GPU checks, in the same process and first: each kind's CUDA linear against the product of its
# own weights, and for every kind the graph replay of a tiny model's step against the eager step; a failure is
# printed as CHECK FAILED and kept in the JSON, and the timings still run. (2) the matrix, LLaMA-2-7B first;
# cases not started within the time budget are listed as skipped. Results: $OUT (device tool) or
# benchmarks/results: e2e-h200-<date>.json (machine, versions, command, every figure) and .md (the table);
# e2e-partial.json holds the rows so far while it runs (a killed run keeps what it measured); e2e_log.txt.
# Afterwards, here: copy the files into benchmarks/results/ and fill BENCHMARKS.md's "Time per output token"
# table from the .md (its targets and "where it loses" lines included).
# Whole call: about 1 minute to start, then at most ~9.5 minutes (E2E_BUDGET=460 s of cases, E2E_TIMEOUT=570 s in
# all). After other work in the same call (benchmarks/run_h200_runtime.sh all: up to 5 minutes of GPU tests first),
# lower both, e.g. E2E_BUDGET=180 E2E_TIMEOUT=260, or run `run_h200_runtime.sh bench` as a call of its own.
set -o pipefail
DEST="${OUT:-benchmarks/results}"
BUDGET="${E2E_BUDGET:-460}"            # seconds of cases started; the last case, analysis and writes follow
LIMIT="${E2E_TIMEOUT:-$((BUDGET + 110))}"  # hard stop (the rows so far stay in e2e-partial.json)
source benchmarks/device_env.sh || exit 1
if ! python3 -c "import zarr, zarr.codecs, numcodecs, crc32c, cupy, transformers" 2>/dev/null; then
  echo "e2e_h200.sh: missing Python packages (carry .whl: see the header of this script)" >&2
  python3 -c "import zarr, zarr.codecs, numcodecs, crc32c, cupy, transformers" 2>&1 | tail -1 >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__)"
timeout "$LIMIT" python3 -m unionsparse.compressor.cli bench --e2e --time-budget "$BUDGET" --out "$DEST" "$@" \
  2>&1 | tee "$DEST/e2e_log.txt"
