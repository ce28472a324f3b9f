# Set-up and the two everyday jobs. Every target installs what it needs into .venv first.
#   make demo   - the whole pipeline on the embedded default model and corpus (CPU, a few minutes)
#   make test   - the test suite (CPU, gloo; GPU tests skip without a GPU): the fast tier, then the slow one
#   make test-fast - the fast tier alone (no multi-process or training runs; a few minutes on 2 cores)
#   make lint   - ruff check + ruff format --check + codespell + mypy occult_ft (CI runs it before the tests)
#   make docs   - the documentation site into site/ (mkdocs build --strict: a broken link or reference fails)
#   make style  - fix what make lint checks (ruff format + ruff check --fix)
#   make test-gpu / make bench-gpu - the CUDA tests and the one-GPU layer benchmark (on a GPU machine)
# Override TORCH to pick another torch build, e.g. make test TORCH="torch==2.11.0".
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
export HF_HUB_OFFLINE ?= 1
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-all test-fast test-gpu bench-gpu lint style docs clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/occult-ft demo

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow"
	$(BIN)/python -m pytest -q -m "slow and not extended"

test-all: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow"
	$(BIN)/python -m pytest -q -m slow

test-fast: $(BIN)/.installed
	$(BIN)/python -m pytest -q -m "not slow"

LINT_PATHS = occult_ft tests benchmarks notebooks scripts

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
	rm -rf $(VENV) .cache .pytest_cache site
