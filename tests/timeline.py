"""A per-worker timeline of the suite: when each test started and ended, in every xdist worker.

Why: the suite's budget (20 minutes on 2 cores) is spent partly outside any test (collection,
session fixtures, a worker waiting for work), which test durations alone cannot show. Written only
when ``TEST_TIMELINE_DIR`` is set (``make test`` sets it); ``python -m tools.suite_timeline DIR``
reads it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

_DIR = os.environ.get("TEST_TIMELINE_DIR", "")
_TESTS_HERE = True  # False in an xdist controller: it sees every worker's tests too


def _record(kind: str, nodeid: str = "") -> None:
    if not _DIR or (nodeid and not _TESTS_HERE):
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(_DIR).mkdir(parents=True, exist_ok=True)
    line = {"worker": worker, "kind": kind, "at": time.time(), "load": os.getloadavg()[0], "test": nodeid}
    with open(Path(_DIR) / f"{worker}.jsonl", "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def pytest_sessionstart(session: pytest.Session) -> None:
    global _TESTS_HERE
    controller = "PYTEST_XDIST_WORKER" not in os.environ and bool(getattr(session.config.option, "numprocesses", None))
    _TESTS_HERE = not controller
    _record("session_start")


def pytest_collection_finish(session: pytest.Session) -> None:
    _record("collected")


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _record("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _record("end", nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _record("session_finish")
