# The two set-up commands of the README are `make demo` and `make test`. Both install what they
# need into ./.venv (it sees the system's packages, so a torch already installed is reused; torch
# is pinned to the 2.13 CPU build, which an unpinned install would replace with a multi-GB CUDA one).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install test-tools demo test quick lint bench

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

demo: install
	$(PY) examples/demo/resilient_demo.py

# Every test's time goes to build/test-times.xml (JUnit XML) and each worker's timeline to
# build/test-timeline (python -m tools.suite_timeline): where the suite's budget goes.
# --dist worksteal: with xdist's default (load), one worker took the integration tests in one chunk
# and ran all of them alone while the other had finished and stood idle for most of the suite.
test: install test-tools
	$(PY) -m ruff check resilrun tests examples benchmarks tools
	rm -rf build/test-timeline
	TEST_TIMELINE_DIR=build/test-timeline $(PY) -m pytest -n 2 --dist worksteal -q -p no:cacheprovider -p no:benchmark --durations=25 --junitxml=build/test-times.xml

# The quick subset: unit, contract, socket and CLI tests, no launcher started (a minute or so on 2 cores).
quick: install test-tools
	$(PY) -m ruff check resilrun tests examples benchmarks tools
	$(PY) -m pytest -n 2 --dist worksteal -q -p no:cacheprovider -p no:benchmark tests/unit tests/contract tests/socket tests/cli

lint: $(PY)
	$(PY) -m ruff check resilrun tests examples benchmarks tools

bench: install
	$(PY) benchmarks/launch_overhead.py
