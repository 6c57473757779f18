#!/usr/bin/env bash
# The GPU tests of the paths switched on on 2026-12-07, in ONE device call (about 4 minutes):
#   (1) rotary + KV write inside the attention launch (StaticDecoder.ROPE_IN_ATTENTION): bit for bit against
#       rotary_cache then attention, graph replay with o_proj's quantized input, decode steps of a model identical
#       with it off and on;
#   (2) IE-BME prompts decoded once (kernels.iebme_decode.DENSE_PREFILL): the dense weight bit for bit, the W4A16 and
#       W4A4 / W2A4 / W4A8 prompt products, the runtime's op-by-op agreement with them on;
#   (3) Tiled-CBC int codes decoded once (the sign-extension fix): decode-dense tests, int4 agreement, eval on the
#       GPU to the CPU path's perplexity.
# Timings are separate calls: `bash benchmarks/glue_h200.sh rope`, `bash benchmarks/union_h200.sh prefill`,
# `bash benchmarks/tcbc_batch_ab_h200.sh`.
#   device tool:  run(command="bash benchmarks/verify_round_h200.sh", carry=[".whl"], timeout_s=600)
set -o pipefail
source benchmarks/device_env.sh || exit 1
timeout 520 python3 -m pytest -p no:cacheprovider -q -rs -W ignore::DeprecationWarning -m "gpu and not slow" \
  tests/test_attention_kernel.py tests/test_kernels_iebme.py tests/test_kernels_tiled_cbc.py \
  tests/test_runtime_agreement.py \
  -k "rope or decode_dense or dense_int or dense_prefill or dense_path or cbc4 or gpu_eval_runs or graph_replay" \
  2>&1 | tee "$DEST/verify_round_gpu_tests.log" | tail -15
