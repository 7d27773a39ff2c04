# Two commands a new user needs: `make demo` (install, then train a local swarm) and `make test`.
# The virtualenv is created on first use and reused; it is reinstalled when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
# Set TORCH_INDEX_URL to a CPU wheel index on machines whose default torch wheel is a large CUDA build.
TORCH_INDEX_URL ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_ARGS ?=

.PHONY: demo test bench install bytecode clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, so that pip keeps this (CPU) build instead of pulling the CUDA wheels as a dependency
$(VENV)/.torch: | $(PY)
	$(PIP) install -q "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(PIP) install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

# Our modules' bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (this project's CI image sets it) every
# process compiled them again, ~0.4 s of CPU per volunteer process (a test run starts hundreds). Up-to-date files are
# skipped (0.3 s); a stale cache is ignored by Python, never used.
PACKAGES := swarm volunteer volunteer_cli tui benchmarks configs
bytecode: install
	$(PY) -m compileall -q -j 0 $(PACKAGES) tests

demo: bytecode
	$(VENV)/bin/volunteer demo $(DEMO_ARGS)

# Two workers, a module at a time each: most of a swarm test is waiting on processes and heartbeats, so
# the second worker fills the idle half of a 2-core machine (9 min 50 s -> 7 min 13 s at load 2-5). PYTEST_ARGS adds options.
PYTEST_WORKERS ?= 2
test: bytecode
	$(PY) -m pytest -q --timeout=600 -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: install
	$(PY) -m benchmarks.join --json
	$(PY) -m benchmarks.pipeline --json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find $(PACKAGES) tests -name __pycache__ -type d -prune -exec rm -rf {} +
