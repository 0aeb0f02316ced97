# `make test` and `make demo` build .venv from nothing; nothing installed by hand counts.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of torch, pinned here (pyproject.toml keeps a normal lower bound for users).
TORCH_PIN := torch==2.13.0

.PHONY: venv test lint typecheck unit demo bench clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_PIN)"
	$(BIN)/pip install --quiet -e ".[test,demo]" "$(TORCH_PIN)"
	touch $@

venv: $(BIN)/.installed

lint: venv
	$(BIN)/ruff check lightning_iocatch tests examples benchmarks
	$(BIN)/ruff format --check lightning_iocatch tests examples benchmarks README.md

typecheck: venv
	$(BIN)/mypy lightning_iocatch

unit: venv
	$(BIN)/pytest -q

test: lint typecheck unit

demo: venv
	$(BIN)/python examples/demo.py

bench: venv
	$(BIN)/python benchmarks/report.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
