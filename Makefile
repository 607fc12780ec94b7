# The two set-up commands of the README: `make demo` and `make test`. Both install what they need
# into the current Python (torch pinned to the CPU build that lies on disk here).
PYTHON ?= python3
PIP_INSTALL = $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: install demo test lint bench

install:
	$(PIP_INSTALL) torch==2.13.0 -e '.[test]'

demo: install
	$(PYTHON) -m resilrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_ddp_torchrun.py --steps 30

test: install
	$(PYTHON) -m ruff check resilrun tests examples benchmarks
	$(PYTHON) -m pytest -n 2 -q

lint:
	$(PYTHON) -m ruff check resilrun tests examples benchmarks

bench: install
	$(PYTHON) benchmarks/launch_overhead.py
