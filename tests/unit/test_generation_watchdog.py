"""The generation watchdog aborts exactly the generation it was armed for, and leaves no thread behind."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from resilrun.errors import CheckpointError
from resilrun.worker import job


class _Group:
    def __init__(self, name: str) -> None:
        self.name = name
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


class _Agent:
    """Stands in for the agent channel: ``await_generation`` blocks until told, or interrupted."""

    instances: list[_Agent] = []

    def __init__(self, path: str, token: str | None = None) -> None:
        self.release = threading.Event()
        self.interrupted = threading.Event()
        self.closed = False
        _Agent.instances.append(self)

    def request(self, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        while not self.release.wait(0.01):
            if self.interrupted.is_set():
                raise CheckpointError("the agent channel failed during 'await_generation': shut down")
        return {"ok": True, "env": {"RANK": "0"}}, []

    def interrupt(self) -> None:
        self.interrupted.set()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """torch.distributed as job.py sees it: an NCCL default group that a test can replace."""
    fake = SimpleNamespace(
        is_initialized=lambda: True,
        get_backend=lambda group=None: "nccl",
        group=SimpleNamespace(WORLD=_Group("generation 0")),
        destroy_process_group=lambda: None,
    )
    monkeypatch.setattr(job, "dist", fake)
    monkeypatch.setattr(job, "AgentClient", _Agent)
    _Agent.instances.clear()
    return fake


def test_the_abort_hits_the_group_it_was_armed_for_not_the_next_generations(nccl: SimpleNamespace) -> None:
    # Given a watchdog armed in generation 0
    armed_for = nccl.group.WORLD
    watchdog = job._start_watchdog("agent.sock", 0, {})
    # When the process already built generation 1's group by the time the news arrives
    newer = _Group("generation 1")
    nccl.group.WORLD = newer
    _Agent.instances[-1].release.set()
    watchdog.join(5)
    # Then generation 0's group was aborted, and the new one left alone
    assert armed_for.aborted
    assert not newer.aborted


def test_leaving_a_generation_ends_its_watchdog_thread(nccl: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job whose watchdog waits (through the agent) for the next generation
    watchdog = job._start_watchdog("agent.sock", 0, {})
    monkeypatch.setattr(job, "_JOB", SimpleNamespace(_watchdog=watchdog, _snapshotter=None))
    # When the process leaves the generation to run the script again
    job.reset_for_reentry()
    # Then the watchdog is gone (not one more blocked thread per generation), its channel closed,
    assert not watchdog.is_alive()
    assert _Agent.instances[-1].closed
    # and news of a generation arriving late aborts nothing
    _Agent.instances[-1].release.set()
    assert not nccl.group.WORLD.aborted
