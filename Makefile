# make train: create .venv if needed, install, train the quickstart experiment (CPU, < 1 minute)
# make test:  the whole test suite, including DDP and the real two-node SLURM tests (needs slurm-wlm, root)
VENV ?= .venv
PYTHON := $(VENV)/bin/python

.PHONY: install train test lint clean FORCE

# The exact versions the template was tested with come from uv.lock (pyproject.toml keeps the ranges):
# uv installs them several times faster than pip. --inexact keeps uv itself in the venv.
# --compile-bytecode writes the .pyc files at install time, as pip does: where PYTHONDONTWRITEBYTECODE
# is set (many CI images and clusters), every process would otherwise compile torch again, twice the
# startup time (5.6 s -> 12.7 s for `import pytorch_lightning` here).
$(VENV)/.installed: pyproject.toml uv.lock $(VENV)/.cuda
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip uv
	UV_PROJECT_ENVIRONMENT=$(VENV) $(VENV)/bin/uv sync --quiet --frozen --inexact --extra dev --extra loggers --extra export --extra docs --extra llm --compile-bytecode $(SYNC_TORCH)
	$(if $(filter lock,$(CUDA)),,$(VENV)/bin/uv pip install --quiet --python $(PYTHON) --torch-backend $(CUDA) --reinstall-package torch --reinstall-package torchvision --compile-bytecode $(LOCKED_TORCH))
	touch $@

# Which CUDA build of torch (its wheels carry their CUDA; the node's NVIDIA driver must run it):
#   make install                 the lock's, from PyPI: CUDA 13 on Linux (driver >= 580; no V100)
#   make install CUDA=cu126      the lock's torch and torchvision built for CUDA 12.6 (driver >= 525), from
#                                PyTorch's own index (uv's --torch-backend); also cu128, cu130, cpu, or auto
#                                (uv picks the build for this machine's driver: run it on a GPU node)
#   make install CUDA=lock       back to the lock's build
# The choice is kept in $(VENV)/.cuda: later make install, make train and make test keep it.
PREVIOUS_CUDA := $(shell cat $(VENV)/.cuda 2>/dev/null)
CUDA ?= $(or $(PREVIOUS_CUDA),lock)
LOCKED_TORCH := $(shell awk '/^\[\[package\]\]/{n=""} /^name = /{n=$$3} /^version = / && (n=="\"torch\""||n=="\"torchvision\""){gsub(/"/,"",n); gsub(/"/,"",$$3); printf "%s==%s ", n, $$3}' uv.lock)
# torch's CUDA 13 libraries in the lock: a variant brings its own, so uv sync leaves these out
LOCKED_CUDA_LIBRARIES := $(shell awk '/^name = "(nvidia-|cuda-)/ && $$3 != "\"nvidia-ml-py\"" {gsub(/"/,"",$$3); print $$3}' uv.lock | sort -u)
SYNC_TORCH = $(if $(filter lock,$(CUDA)),$(if $(filter-out lock,$(PREVIOUS_CUDA)),--reinstall-package torch --reinstall-package torchvision),$(addprefix --no-install-package ,torch torchvision $(LOCKED_CUDA_LIBRARIES)))

$(VENV)/.cuda: FORCE
	@mkdir -p $(VENV) && [ "$$(cat $@ 2>/dev/null)" = "$(CUDA)" ] || echo "$(CUDA)" > $@

FORCE:

install: $(VENV)/.installed

train: install
	$(PYTHON) src/train.py experiment=quickstart

# Two xdist workers, one per core of the development machine, each with its own local Slurm cluster for the
# Slurm tests. The tests come longest first (tests/conftest.py); a worker that runs out takes half of what
# the other has left (worksteal), so neither ends with a queue of slow tests while the other idles.
test: install
	$(PYTHON) -m pytest -n 2 --dist worksteal

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf logs .pytest_cache .ruff_cache

# The template's maintenance targets (make benchmark, ...): scripts/dev/ stays in the template repository.
-include scripts/dev/dev.mk
