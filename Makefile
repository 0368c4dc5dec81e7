# make train: create .venv if needed, install, train the quickstart experiment (CPU, < 1 minute)
# make test:  the whole test suite, including DDP and the real two-node SLURM tests (needs slurm-wlm, root)
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: install train test lint clean

# The exact versions the template was tested with come from uv.lock (pyproject.toml keeps the ranges):
# uv installs them several times faster than pip. --inexact keeps uv itself in the venv.
# --compile-bytecode writes the .pyc files at install time, as pip does: where PYTHONDONTWRITEBYTECODE
# is set (many CI images and clusters), every process would otherwise compile torch again, twice the
# startup time (5.6 s -> 12.7 s for `import pytorch_lightning` here).
$(VENV)/.installed: pyproject.toml uv.lock
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip uv
	UV_PROJECT_ENVIRONMENT=$(VENV) $(VENV)/bin/uv sync --quiet --frozen --inexact --extra dev --extra loggers --extra export --extra docs --compile-bytecode
	touch $@

install: $(VENV)/.installed

train: install
	$(PYTHON) src/train.py experiment=quickstart

# Two xdist workers, one per core of the development machine: each takes the next test when it is free,
# longest first (tests/conftest.py), and starts its own local Slurm cluster for the Slurm tests.
test: install
	$(PYTHON) -m pytest -n 2 --dist load

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf logs .pytest_cache .ruff_cache

# The template's maintenance targets (make benchmark, ...): scripts/dev/ stays in the template repository.
-include scripts/dev/dev.mk
