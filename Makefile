# The two set-up commands of the README are `make demo` and `make test`. Both install what they
# need into ./.venv (it sees the system's packages, so a torch already installed is reused; torch
# is pinned to the 2.13 CPU build, which an unpinned install would replace with a multi-GB CUDA one).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install demo test lint bench

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

install: $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e '.[test]'

demo: install
	$(PY) -m resilrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_ddp_torchrun.py --steps 30

test: install
	$(PY) -m ruff check resilrun tests examples benchmarks
	$(PY) -m pytest -n 2 -q -p no:cacheprovider -p no:benchmark

lint: $(PY)
	$(PY) -m ruff check resilrun tests examples benchmarks

bench: install
	$(PY) benchmarks/launch_overhead.py
