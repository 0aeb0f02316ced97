# `make test` and `make demo` build .venv from nothing; nothing installed by hand counts.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of torch, pinned here (pyproject.toml keeps a normal lower bound for users).
TORCH_PIN := torch==2.13.0
# pip installs without compiling every module to bytecode (torch alone: 55 s, 7 s without);
# each module is compiled once, when first imported, and cached, which needs Python to
# write bytecode even where the environment says not to (PYTHONDONTWRITEBYTECODE).
PIP_NO_COMPILE := --no-compile
export PYTHONDONTWRITEBYTECODE :=

.PHONY: venv test test-slow lint typecheck docs-check unit demo docs bench bench-tokens bench-units bench-effects bench-sae test-peers bench-atp bench-atp-cost test-peers-atp bench-health bench-compact bench-compact-sae bench-compact-study bench-sharded bench-live clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(PIP_NO_COMPILE) --upgrade pip
	$(BIN)/pip install --quiet $(PIP_NO_COMPILE) "$(TORCH_PIN)"
	$(BIN)/pip install --quiet $(PIP_NO_COMPILE) -e ".[test,demo]" "$(TORCH_PIN)"
	touch $@

venv: $(BIN)/.installed

lint: venv
	$(BIN)/ruff check lightning_iocatch tests examples benchmarks tools
	$(BIN)/ruff format --check lightning_iocatch tests examples benchmarks tools README.md
	$(BIN)/lint-imports  # the layer rules of docs/architecture.md (contracts: pyproject.toml)

typecheck: venv
	$(BIN)/mypy lightning_iocatch

# The documentation site: a broken link, a missing page or a docstring mkdocstrings
# cannot read fails the strict build; tests/test_docs.py checks every public name is in it.
docs-check: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir .site-check

docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site
	@echo "open site/index.html"

# Two test processes (CI has 2 cores), each with one core's torch threads (tests/conftest.py);
# idle workers steal queued tests, so a long test near the end does not leave one core idle.
unit: venv
	$(BIN)/pytest -q -n 2 --dist worksteal -m "not soak"

# Long runs (marker `soak`: runs repeated to catch a rare failure, and the longer
# multi-process cases of a feature whose shorter case `make test` runs): out of `make
# test`'s six minutes, never out of CI (.ci/run runs them after `make test`); only the files
# that hold them are collected, on both cores, a file's tests on one (their module
# fixtures launch processes once).
test-slow: venv
	$(BIN)/pytest -q -n 2 --dist loadfile -m soak $$(grep -rl --include="*.py" "pytest.mark.soak" tests)

# Two pips side by side first, each on one core (CI has 2): the environment and the
# installed wheel's (which needs nothing of .venv); then the checks on .venv two at a time;
# then the suite on both cores.
test:
	$(MAKE) -j2 --output-sync=target venv test-install
	$(MAKE) -j2 --output-sync=target lint typecheck docs-check
	$(MAKE) unit

# The package as a user installs it: `python -m build` (an sdist, and the wheel built from
# it), the wheel installed with the pinned CPU torch (a local wheel) into a fresh virtual
# environment, never .venv, then imported from there with one dump run and read back
# (tests/scripts/installed_wheel.py, run from outside the checkout). Both lie in build/,
# which git ignores. Built from a copy of the checkout's files (those git tracks or does not
# ignore), so that the editable install of .venv, built beside it, never shares its
# egg-info. About a minute, most of it pip unpacking torch.
INSTALL_DIR := build/test-install
.PHONY: test-install
test-install:
	rm -rf $(INSTALL_DIR)
	mkdir -p $(INSTALL_DIR)/source
	git rev-parse --git-dir > /dev/null  # a checkout: its files are what git lists
	git ls-files -z --cached --others --exclude-standard \
		| tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C $(INSTALL_DIR)/source
	$(PYTHON) -m venv $(INSTALL_DIR)/venv
	$(INSTALL_DIR)/venv/bin/pip install --quiet $(PIP_NO_COMPILE) build
	$(INSTALL_DIR)/venv/bin/python -m build --outdir $(INSTALL_DIR)/dist $(INSTALL_DIR)/source \
		> $(INSTALL_DIR)/build.log 2>&1 || (cat $(INSTALL_DIR)/build.log; false)
	$(INSTALL_DIR)/venv/bin/pip install --quiet $(PIP_NO_COMPILE) $(INSTALL_DIR)/dist/*.whl "$(TORCH_PIN)"
	cd $(INSTALL_DIR) && venv/bin/python $(CURDIR)/tests/scripts/installed_wheel.py

demo: venv
	$(BIN)/python examples/demo.py

bench: venv
	$(BIN)/python benchmarks/report.py

# The comparison with SAELens' cache runner needs SAELens, kept out of the test environment.
BENCH_VENV := .venv-bench
$(BENCH_VENV)/bin/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet $(PIP_NO_COMPILE) --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet $(PIP_NO_COMPILE) "$(TORCH_PIN)"
	$(BENCH_VENV)/bin/pip install --quiet $(PIP_NO_COMPILE) -e . "sae-lens>=6" "datasets>=4.0" pytest "$(TORCH_PIN)"
	touch $@

bench-tokens: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/python benchmarks/tokens.py --markdown

# The tests that compare with a peer's own code (SAELens' evaluation of an SAE).
test-peers: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/python -m pytest -q tests/lightning/test_effects_saelens.py tests/peers/test_sae_saelens.py

# SAEModule against SAELens' own trainer (in the SAELens environment): step for step from the
# same weights and batches (SAELens' arithmetic float32 bit for bit, float64 to 1e-12, for
# both arithmetics), then quality over 3 seeds and training throughput as users run each tool,
# the step's speed, and SAELens alone on our reader's order and its own over 6 seeds (about
# an hour; trains the compact study's GPT-2 once, cached in .cache/compact-study/).
bench-sae: $(BENCH_VENV)/bin/.installed
	$(BENCH_VENV)/bin/python benchmarks/sae_parity.py
	cd benchmarks && ../$(BENCH_VENV)/bin/python sae_quality.py
	cd benchmarks && ../$(BENCH_VENV)/bin/python sae_step_speed.py
	cd benchmarks && ../$(BENCH_VENV)/bin/python sae_order.py

# Unit statistics (top-k, density) against delphi's in-memory cache: eai-delphi in an
# environment of its own. eai-delphi brings torchvision and torchaudio built for another
# torch, which transformers then fails to import: they are removed (nothing here uses them).
# It lies inside .venv-bench/ (ignored by git, removed by `make clean`), apart from SAELens.
UNITS_VENV := $(BENCH_VENV)/units
$(UNITS_VENV)/bin/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(UNITS_VENV)
	$(UNITS_VENV)/bin/pip install --quiet $(PIP_NO_COMPILE) --upgrade pip
	$(UNITS_VENV)/bin/pip install --quiet $(PIP_NO_COMPILE) "$(TORCH_PIN)"
	$(UNITS_VENV)/bin/pip install --quiet $(PIP_NO_COMPILE) -e . "eai-delphi==0.1.3" matplotlib "$(TORCH_PIN)"
	$(UNITS_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# About 50 minutes on 2 cores; builds 7 GB of stores once in benchmarks/.stores.
bench-units: $(UNITS_VENV)/bin/.installed
	$(UNITS_VENV)/bin/python benchmarks/units.py --markdown

bench-effects: venv
	$(BIN)/python benchmarks/effects.py

# Attribution patching against TransformerLens' own: transformer-lens in an environment of its
# own (never in the test extra), inside .venv-bench/ like the units one. 3.9.0 is the last
# with HookedTransformer (4.0 removed it) and has attribution_patch, whose node-level code
# 4.3.0 keeps. Torch is installed first at the pin so that transformer-lens does not pull
# another build; torchvision and torchaudio, if anything brings them, are removed.
ATP_VENV := $(BENCH_VENV)/atp
$(ATP_VENV)/bin/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(ATP_VENV)
	$(ATP_VENV)/bin/pip install --quiet $(PIP_NO_COMPILE) --upgrade pip
	$(ATP_VENV)/bin/pip install --quiet $(PIP_NO_COMPILE) "$(TORCH_PIN)"
	$(ATP_VENV)/bin/pip install --quiet $(PIP_NO_COMPILE) -e . "transformer-lens==3.9.0" pytest "$(TORCH_PIN)"
	$(ATP_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

# Our denoising and noising AtP against TransformerLens' on one HookedTransformer, float32 and
# float64, and both against exact patching where the metric is linear in the activation.
bench-atp: $(ATP_VENV)/bin/.installed
	$(ATP_VENV)/bin/python benchmarks/atp_anchor.py

test-peers-atp: $(ATP_VENV)/bin/.installed
	$(ATP_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/peers/test_atp_transformer_lens.py

# One AtP pass on the 12-block model of `make bench`, against a clean forward and a
# hand-written hook pass in the same run.
bench-atp-cost: venv
	$(BIN)/python benchmarks/attribution.py

# Whole values under tensor parallelism (docs/sharded.md): a Llama sharded over 2 gloo
# processes, captured whole, against the sharded forward alone. About 30 s on 2 cores.
bench-sharded: venv
	$(BIN)/python benchmarks/sharded.py

# ActivationMonitor on the 12-block model in Trainer.fit against the same training without it:
# a watched step, an unwatched one, and the average of a run watched every 50 steps, also
# measured over 100-step runs (--direct). One thread and the CPU clock: steadier on a shared
# machine. About 3 minutes on 2 cores (the issue's MLP; --model gpt2 for the 12-block GPT-2).
bench-health: venv
	$(BIN)/python benchmarks/health.py --threads 1 --clock cpu --direct

# Compact stores (docs/compact-stores.md): float32, bfloat16, float8_e4m3fn, each with and
# without codec="zstd", on token rows of a byte-level GPT-2 trained on the standard library
# (trained once, 5 minutes, cached in .cache/compact-study/). bench-compact: bytes per row,
# dump and read throughput, 3 rounds (about 3.5 minutes once the model is cached; `python
# benchmarks/compact_store.py --synthetic`: width 256 with outlier units, 45 s); bench-compact-sae: the same SAE trained on each dtype's store, 3 seeds,
# evaluated on float32 activations of held-out text (9 minutes, same machine).
# bench-compact-study: both.
bench-compact: venv
	$(BIN)/python benchmarks/compact_store.py

bench-compact-sae: venv
	$(BIN)/python benchmarks/compact_sae.py

bench-compact-study: bench-compact bench-compact-sae

# Training an SAE live (LiveActivations) against from a dump (float32, bfloat16,
# float8_e4m3fn+zstd) for 1, 4 and 16 passes over the same tokens, on the compact study's
# GPT-2 (docs/live.md): the table, and the crossover plot in docs/images/live_crossover.png.
# About 3 minutes on 2 idle cores once the model is cached (`--quick`: a smoke run, 1 min).
bench-live: venv
	$(BIN)/python benchmarks/live_crossover.py

clean:
	rm -rf $(VENV) $(BENCH_VENV) .pytest_cache .mypy_cache .ruff_cache site .site-check build/test-install
