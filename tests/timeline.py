"""A per-worker timeline of the suite: when each test started and ended, in every xdist worker.

Why: the suite's budget (20 minutes on 2 cores) is spent partly outside any test (collection,
session fixtures, a worker waiting for work), which test durations alone cannot show. Written only
when ``TEST_TIMELINE_DIR`` is set (``make test`` sets it); ``python -m tools.suite_timeline DIR``
reads it.

Where the machine lets it (root, a cgroup v2 or cpuacct mount), each xdist worker moves into a cgroup
of its own and every event carries that cgroup's CPU time so far (``cpu_s``): the CPU a test used,
its launches, workers and servers included (a child stays in its parent's cgroup wherever it is
reparented). Why: with the machine's cores busy most of the suite, its wall time follows its CPU
time, and a test's duration does not say how much of it was CPU and how much waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import pytest

_DIR = os.environ.get("TEST_TIMELINE_DIR", "")
_TESTS_HERE = True  # False in an xdist controller: it sees every worker's tests too
_CPU_FILE: Path | None = None  # this worker's cgroup's CPU counter, once it has one


def _cgroup_roots() -> list[tuple[Path, str]]:
    """Where a cgroup with a CPU counter can be made, below this process's own (its limits still
    apply): in the cgroup v2 hierarchy (``cpu.stat``) or v1's cpuacct (``cpuacct.usage``)."""
    try:
        mounts = Path("/proc/mounts").read_text(encoding="utf-8").splitlines()
        own = Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    where = {}  # controllers ("" for v2) -> this process's cgroup in that hierarchy
    for line in own:
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            where[controller] = path.lstrip("/")
    roots = []
    for line in mounts:
        fields = line.split()
        if len(fields) < 4:
            continue
        if fields[2] == "cgroup2" and "" in where:
            roots.append((Path(fields[1]) / where[""], "cpu.stat"))
        elif fields[2] == "cgroup" and "cpuacct" in fields[3].split(",") and "cpuacct" in where:
            roots.append((Path(fields[1]) / where["cpuacct"], "cpuacct.usage"))
    return roots


def _cpu_s() -> float | None:
    if _CPU_FILE is None:
        return None
    try:
        text = _CPU_FILE.read_text(encoding="utf-8")
    except OSError:
        return None
    if _CPU_FILE.name == "cpuacct.usage":
        return int(text) / 1e9
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    return None


def _own_cgroup(worker: str) -> None:
    """Move this process into a new cgroup whose CPU counter then counts it and its descendants."""
    global _CPU_FILE
    for root, counter in _cgroup_roots():
        group = root / f"resilrun-tests-{os.getpid()}-{worker}"
        try:
            group.mkdir(exist_ok=True)
            (group / "cgroup.procs").write_text(str(os.getpid()), encoding="utf-8")
        except OSError:
            with contextlib.suppress(OSError):
                group.rmdir()
            continue
        _CPU_FILE = group / counter
        return


def _record(kind: str, nodeid: str = "") -> None:
    if not _DIR or (nodeid and not _TESTS_HERE):
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(_DIR).mkdir(parents=True, exist_ok=True)
    line = {"worker": worker, "kind": kind, "at": time.time(), "load": os.getloadavg()[0], "test": nodeid}
    cpu = _cpu_s()
    if cpu is not None:
        line["cpu_s"] = cpu
    with open(Path(_DIR) / f"{worker}.jsonl", "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")


def pytest_sessionstart(session: pytest.Session) -> None:
    global _TESTS_HERE
    controller = "PYTEST_XDIST_WORKER" not in os.environ and bool(getattr(session.config.option, "numprocesses", None))
    _TESTS_HERE = not controller
    if _DIR and not controller:
        _own_cgroup(os.environ.get("PYTEST_XDIST_WORKER", "main"))
    _record("session_start")


def pytest_collection_finish(session: pytest.Session) -> None:
    _record("collected")


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _record("start", nodeid)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _record("end", nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _record("session_finish")
    if _CPU_FILE is not None:  # back to where it was made, and the cgroup removed once it is empty
        with contextlib.suppress(OSError):
            (_CPU_FILE.parent.parent / "cgroup.procs").write_text(str(os.getpid()), encoding="utf-8")
            _CPU_FILE.parent.rmdir()
