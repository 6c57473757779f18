#!/usr/bin/env bash
# Fetch, on this machine (PyPI reachable), the wheels a device call needs that the H200 image lacks, into .whl/
# (git-ignored; name it in the device call's `carry`). The image has torch, CuPy, numba, transformers, click, rich,
# safetensors, pyyaml, accelerate; the artifact needs zarr (+ numcodecs, donfig, crc32c, and
# google-crc32c, which zarr.codecs imports) and SmolLM2's GGUF gguf.
# ortools (CP-SAT reordering) and datasets (hub calibration) are imported only when used: the GPU runs do not.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
for spec in zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 crc32c==2.9.post0 google-crc32c==1.9.0 gguf==0.19.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$spec"
done
du -sh .whl
