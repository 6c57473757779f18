# Sourced by the device scripts (benchmarks/*_h200.sh) from the repo root: DEST (the results folder: $OUT on the
# device tool, else benchmarks/results), the carried wheels installed into /tmp/site (.whl: bash
# benchmarks/h200_wheels.sh, here, once), the package importable as `unionsparse` through a folder of links (no
# install), the environment (tests importable, hub offline), and carried SmolLM2 GGUF halves left in /tmp.
DEST="${OUT:-benchmarks/results}"
mkdir -p "$DEST"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || return 1
fi
mkdir -p /tmp/shim/unionsparse && for d in compressor solvers formats kernels; do ln -sfn "$PWD/$d" /tmp/shim/unionsparse/$d; done
export PYTHONPATH=/tmp/shim:/tmp/site:$PWD/tests PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
for part in part00 part01; do if [ -f .gguf/$part ]; then cp .gguf/$part /tmp/gguf-$part; fi; done
return 0
