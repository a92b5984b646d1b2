# lmforge: every target sets up .venv first (torch==2.13.0, then the package with its dev extras).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OUT ?= runs/speedrun

.PHONY: eval-interop setup speedrun test test-fast sandbox interop test-browser test-ray bench gpu-check clean help

help:
	@echo "make speedrun   train tokenizer, prepare, pretrain and sample on the Python standard library ($(OUT))"
	@echo "make test       run the test suite"
	@echo "make sandbox    install bubblewrap (apt), the boundary RL's generated code runs inside"
	@echo "make interop    build llama.cpp (llama-cpp-python, several minutes once) and prove the GGUF export in it"
	@echo "make test-browser  install Chromium (apt) and Playwright, run the chat-page tests"
	@echo "make test-ray   install Ray, run lmforge prepare on a local Ray cluster against the local executor"
	@echo "make bench      run the benchmarks in bench/ and append to bench/RESULTS.md"
	@echo "make gpu-check  the CUDA path in one table on one H100/H200, under 8 minutes (bench/gpu_check.py)"

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

speedrun: $(STAMP)
	$(VENV)/bin/lmforge speedrun --config configs/stdlib-tiny.toml --out $(OUT) $(if $(wildcard $(OUT)),--resume,)

test: $(STAMP)
	$(PY) -m pytest -q -n auto  # pytest-xdist: a worker per core (tests are independent; each worker one torch thread)

test-fast: $(STAMP)
	$(PY) -m pytest -q -n auto -m "not slow"

# The sandbox's boundary (RL rewards run generated code inside it): Debian's bubblewrap. Without
# it the code runs under the Python-level guard only, and the suite's bubblewrap tests skip.
sandbox:
	command -v bwrap >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) \
		|| (sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap)
	bwrap --version

# llama.cpp is built from source by pip (several minutes, once); tests/interop/ skip without it.
interop: $(STAMP)
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PY) -m pip install -q -e ".[interop]"
	$(PY) -m pytest -q -rs tests/interop
# lm-evaluation-harness against lmforge: the adapter and local-completions -> lmforge serve, beside HFLM.
eval-interop: $(STAMP)
	$(PY) -c "import lm_eval, tenacity" 2>/dev/null || $(PY) -m pip install -q -e ".[eval]"
	$(PY) -m pytest -q -rs tests/test_lm_eval.py
# The chat page in a real browser: Debian's chromium (Playwright's own download is not used).
test-browser: $(STAMP)
	command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) \
		|| (sudo apt-get update && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	$(PY) -m pip install -q -e ".[dev,browser]"
	$(PY) -m pytest -q tests/test_serve_browser.py

# lmforge prepare on a real local Ray cluster (ray.init here, 2 workers): the shards of the local executor.
test-ray: $(STAMP)
	$(PY) -c "import ray" 2>/dev/null || $(PY) -m pip install -q -e ".[ray]"
	$(PY) -m pytest -q -rs tests/test_prepare_ray.py

bench: $(STAMP)
	$(PY) -c "import trl, peft" 2>/dev/null || $(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/run_all.py

# CUDA tests, compiled = eager gradients, flex = sdpa, the step vs transformers, a 60 s speedrun (bench/README.md)
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py $(if $(JSON),--json $(JSON),)

clean:
	rm -rf runs .pytest_cache
