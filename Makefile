# The two set-up commands of the README are `make demo` and `make test`. Both install what they
# need into ./.venv (it sees the system's packages, so a torch already installed is reused; torch
# is pinned to the 2.13 CPU build, which an unpinned install would replace with a multi-GB CUDA one).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install test-tools test-torchtitan demo test quick lint bench

$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

install: $(PY)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e '.[test]'

# What the man-page lint and shell-completion tests run (tests/cli/test_docgen.py, test_completions.py),
# the etcd server the etcd backend's tests start on loopback (Debian's etcd-server: binary etcd), and
# iproute2's ip and util-linux's unshare for the multi-host tests' network namespaces (as root).
# On a fresh Debian/Ubuntu machine as root, missing ones are installed with apt-get; elsewhere those
# tests skip (and fail under CI=true), so install them yourself: groff-base or mandoc, zsh, fish, etcd,
# iproute2, util-linux.
TEST_TOOLS := groff mandoc zsh fish etcd ip unshare nft slurmctld slurmd sbatch munged

test-tools:
	@missing=""; for tool in $(TEST_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing with apt-get"; \
		packages=$$(echo $$missing | sed 's/groff/groff-base/; s/etcd/etcd-server/; s/\bip\b/iproute2/; s/unshare/util-linux/; s/\bnft\b/nftables/; s/\bsbatch\b/slurm-client/; s/\bmunged\b/munge/'); \
		{ DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$packages >/dev/null; } \
		|| echo "could not install$$missing: those tests will skip (and fail under CI=true)"; \
	elif [ -n "$$missing" ]; then \
		echo "not installed:$$missing (tests that need them skip; as root on Debian, make test installs them)"; \
	fi

# torchtitan for its integration's tests (tests/integration/test_framework_torchtitan.py), in a folder of
# its own that only those tests' launches put on PYTHONPATH: its datasets pins a huggingface-hub older
# than the one transformers needs. Its dependencies already in the environment (torch, torchdata,
# tokenizers, safetensors, numpy) are not installed again (--no-deps, the rest named here).
TORCHTITAN_SITE := build/torchtitan-site
TORCHTITAN_PACKAGES := torchtitan==0.3.0 torch_checkpointing==0.1.1 spmd_types==0.2.3 tyro==1.0.17 \
	docstring_parser==0.18.0 typeguard==4.6.1 einops==0.8.2 datasets==4.7.0 huggingface-hub==1.33.0 \
	dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pyarrow==26.0.1 pandas==3.1.1 python-dateutil==4.0.0 \
	tzdata==2026.6 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 \
	tensorboard==2.21.0 tensorboard-data-server==0.7.2 absl-py==2.5.1 grpcio==1.85.4 markdown==3.11.4 \
	protobuf==7.36.2 werkzeug==3.1.9

test-torchtitan: $(PY)
	@[ -f $(TORCHTITAN_SITE)/torchtitan/__init__.py ] || \
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --target $(TORCHTITAN_SITE) $(TORCHTITAN_PACKAGES) \
	|| echo "could not install torchtitan: its tests will skip (and fail under CI=true)"

demo: install
	$(PY) examples/demo/resilient_demo.py

# Every test's time goes to build/test-times.xml (JUnit XML) and each worker's timeline to
# build/test-timeline (python -m tools.suite_timeline): where the suite's budget goes, with each
# test's CPU. --dist worksteal: with xdist's default (load), one worker took the integration tests
# in one chunk and ran all of them alone while the other had finished and stood idle for most of
# the suite. Three workers on 2 cores: with 2, the cores were 17 % idle (tests that wait for a
# timeout, a heartbeat or a slowed replica); since workers are forked from a node's template, a
# third worker fills that time instead of competing for imports (before the template it made the
# suite slower). Bytecode is written (the machine's environment may say not to): otherwise every
# fresh interpreter the suite starts, a node's worker template above all, compiles resilrun's
# sources again (half a CPU-second each). Together 21:17 -> 15:44 on a fresh clone (2026-12-08).
test: install test-tools test-torchtitan
	$(PY) -m ruff check resilrun tests examples benchmarks tools
	rm -rf build/test-timeline
	env -u PYTHONDONTWRITEBYTECODE TEST_TIMELINE_DIR=build/test-timeline $(PY) -m pytest -n 3 --dist worksteal -q -p no:cacheprovider -p no:benchmark --durations=25 --junitxml=build/test-times.xml

# The quick subset: unit, contract, socket and CLI tests, no launcher started (a minute and a half on
# 2 cores). Four xdist workers on 2 cores: these tests mostly wait (sockets, leases, timeouts; 62 % of
# 2 cores busy with 2 workers), so two more workers fill the idle time (120 s -> 95 s here). `make
# test` has three: its integration tests use the cores far more (see above).
quick: install test-tools
	$(PY) -m ruff check resilrun tests examples benchmarks tools
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n 4 --dist worksteal -q -p no:cacheprovider -p no:benchmark tests/unit tests/contract tests/socket tests/cli

lint: $(PY)
	$(PY) -m ruff check resilrun tests examples benchmarks tools

bench: install
	$(PY) benchmarks/launch_overhead.py
