"""One owner per worker: the supervisor thread reaps, waits and closes pidfds; the status thread only
reads snapshots (issue 14, item 6). Each race is staged with events, not timing."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resilrun.agent.status import StatusPublisher
from resilrun.agent.supervision.rounds import Membership, NodePhase, Round
from resilrun.agent.workers import procs
from resilrun.option_values import Std
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import RdzvState

_SLEEPER = "import time; time.sleep(60)"
_DEADLINE_S = 20.0


def _spec(tmp_path: Path, rank: int, code: str = _SLEEPER) -> procs.WorkerSpec:
    return procs.WorkerSpec(
        local_rank=rank,
        global_rank=rank,
        argv=(sys.executable, "-c", code),
        env=dict(os.environ),
        log_dir=tmp_path / f"rank{rank}",
        to_file=Std.NONE,
        to_console=Std.NONE,
    )


def _membership(current: Round | None) -> Membership:
    membership = Membership("n0")
    if current is not None:
        membership.run(current, NodePhase.ACTIVE)
    return membership


def _publisher(current: Round | None) -> StatusPublisher:
    """A StatusPublisher over fakes of the agent's parts; its thread publishes once, then idles."""
    telemetry = SimpleNamespace(
        events=SimpleNamespace(add_listener=lambda listener: None),
        counts={},
        progress={},
        uploaded={},
        persisted_step=None,
        interval=None,
    )
    control = SimpleNamespace(
        waiting_spares=lambda: [],
        silent_for=lambda pid: None,
        stalled_for=lambda pid: None,
        newest_step=lambda pids: None,
    )
    memory = SimpleNamespace(describe=lambda rank: {"committed": {}}, finished=lambda ranks: None)
    rdzv = SimpleNamespace(backend=MemoryBackend(), run_id="job", me=SimpleNamespace(node_id="n0", addr="127.0.0.1"))
    config = SimpleNamespace(
        heartbeat_timeout_s=30.0,
        heartbeat_interval_s=1.0,
        spares=1,
        checkpoint_uri=None,
        snapshot_every=1,
        max_overhead_pct=3.0,
        replicas=1,
        replicate_every=1,
        persist_every=100,
    )
    return StatusPublisher(
        config,  # type: ignore[arg-type]
        rdzv,  # type: ignore[arg-type]
        _membership(current),
        control,  # type: ignore[arg-type]
        memory,  # type: ignore[arg-type]
        telemetry,  # type: ignore[arg-type]
        interval_s=3600.0,
    )


def _in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = target()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _identity(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


@pytest.fixture
def reaper() -> Iterator[list[procs.WorkerProcess]]:
    """Workers to kill at the end, whatever the test did (a failed test leaves no sleepers)."""
    workers: list[procs.WorkerProcess] = []
    yield workers
    for worker in workers:
        worker.popen.kill()  # a no-op once reaped
        worker.popen.wait(_DEADLINE_S)


def test_a_status_read_while_the_supervisor_waits_on_a_pidfd_leaves_it_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reaper: list[procs.WorkerProcess]
) -> None:
    real_select = procs.select.select
    selecting, resume = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def hooked_select(rlist: list[int], wlist: list[int], xlist: list[int], timeout: float) -> Any:
        # Between collecting the pidfds and selecting on them: the window the status thread hit.
        seen["fds"] = {fd: _identity(fd) for fd in rlist}
        selecting.set()
        assert resume.wait(_DEADLINE_S)
        try:
            seen["after"] = {fd: _identity(fd) for fd in rlist}
        except OSError as exc:
            seen["after"] = exc
        return real_select(rlist, wlist, xlist, timeout)

    monkeypatch.setattr(procs, "select", SimpleNamespace(select=hooked_select))
    holder: dict[str, procs.WorkerProcess] = {}
    spawned = threading.Event()

    def supervisor() -> None:  # spawns, so it owns the worker, then waits on it
        holder["worker"] = worker = procs.spawn(_spec(tmp_path, 0))
        spawned.set()
        procs.wait_any_exit([worker], timeout_s=_DEADLINE_S)
        assert worker.poll() == -signal.SIGKILL
        assert worker.exit_fd() is None  # the owner closed it once it saw the exit

    thread, result = _in_thread(supervisor)
    assert spawned.wait(_DEADLINE_S)
    worker = holder["worker"]
    reaper.append(worker)
    publisher = _publisher(Round(RdzvState(round=1), 0, [worker], [], None))
    try:
        assert selecting.wait(_DEADLINE_S)
        (fd,) = seen["fds"]
        os.kill(worker.pid, signal.SIGKILL)
        assert real_select([fd], [], [], _DEADLINE_S)[0] == [fd]  # dead (pidfd readable), not reaped
        document = publisher.build()  # the status thread's read, while the supervisor is about to select
        assert document["ranks"][0]["state"] == "failed"  # the read still sees the exit...
        assert document["ranks"][0]["exit_code"] == -signal.SIGKILL
        assert _identity(fd) == seen["fds"][fd]  # ...and the supervisor's pidfd is still its own
    finally:
        resume.set()
        thread.join(_DEADLINE_S)
        publisher.close()
    assert "error" not in result, result.get("error")
    assert seen["after"] == seen["fds"]


def test_only_the_owner_thread_may_poll(tmp_path: Path, reaper: list[procs.WorkerProcess]) -> None:
    worker = procs.spawn(_spec(tmp_path, 0))
    reaper.append(worker)
    thread, result = _in_thread(worker.poll)
    thread.join(_DEADLINE_S)
    assert isinstance(result.get("error"), RuntimeError)
    assert worker.exit_fd() is not None
    procs.stop([worker], signal.SIGKILL, 0.0)
    assert worker.exit_fd() is None


def test_a_snapshot_sees_a_spare_die_without_reaping_it(tmp_path: Path, reaper: list[procs.WorkerProcess]) -> None:
    worker = procs.spawn(_spec(tmp_path, 0, "raise SystemExit(3)"))
    reaper.append(worker)
    fd = worker.exit_fd()
    assert fd is not None and procs.select.select([fd], [], [], _DEADLINE_S)[0] == [fd]
    snap = worker.snapshot()
    assert (snap.pid, snap.global_rank, snap.exit_code) == (worker.pid, 0, 3)
    assert worker.popen.returncode is None  # not reaped: the owner's poll() does that
    assert worker.poll() == 3 and worker.exit_fd() is None
    assert worker.snapshot().exit_code == 3


def test_a_round_read_during_a_promotion_sees_it_whole_or_not_at_all(
    tmp_path: Path, reaper: list[procs.WorkerProcess]
) -> None:
    survivor, failed, spare = (procs.spawn(_spec(tmp_path, r)) for r in (0, 1, 2))
    reaper.extend((survivor, failed, spare))
    before_spec = failed.spec
    round_ = Round(RdzvState(round=1), 0, [survivor, failed], [spare], None)
    publisher = _publisher(round_)
    try:
        os.kill(failed.pid, signal.SIGKILL)
        failed.popen.wait(_DEADLINE_S)
        failed.poll()

        def read() -> tuple[list[Any], dict[str, Any]]:
            doc = publisher.build()
            return [(r["rank"], r["pid"], r["state"]) for r in doc["ranks"]], doc["spares"]

        before = ([(0, survivor.pid, "starting"), (1, failed.pid, "failed")], {"alive": 1, "pids": [spare.pid]})
        with round_.updating():  # the promotion, step by step as InProcessRecovery.enter_generation does it
            round_.spares.remove(spare)
            spare.spec = before_spec
            thread, result = _in_thread(read)  # the status thread, in the middle of it
            thread.join(_DEADLINE_S)
            assert "error" not in result, result.get("error")
            ranks, spares = result["value"]
            assert (ranks, {k: spares[k] for k in ("alive", "pids")}) == before
            round_.workers = [survivor, spare]
            round_.state = RdzvState(round=2)
        ranks, spares = read()
        assert ranks == [(0, survivor.pid, "starting"), (1, spare.pid, "starting")]
        assert (spares["alive"], spares["pids"]) == (0, [])
        assert round_.snapshot().state.round == 2
    finally:
        procs.stop([survivor, failed, spare], signal.SIGKILL, 0.0)
        publisher.close()


def test_the_ranks_a_node_runs_are_the_ones_its_workers_are_given(tmp_path) -> None:  # noqa: ANN001 - pytest's
    from resilrun.agent.workers.specs import NodeSetup, worker_specs
    from resilrun.config import Config
    from resilrun.rendezvous.protocol import NodeInfo, RdzvState

    # Given three nodes of 2, 3 and 2 workers (uneven, as --nproc-per-node may differ per node)
    nodes = (NodeInfo("n0", "127.0.0.1", 2), NodeInfo("n1", "127.0.0.1", 3), NodeInfo("n2", "127.0.0.1", 2))
    state = RdzvState(round=4, complete=True, participants=nodes)
    for node_rank, node in enumerate(nodes):
        membership = Membership(node.node_id)
        membership.enter(state)
        setup = NodeSetup(nproc=node.local_world_size, addr="127.0.0.1", log_root=tmp_path, base_env={})
        config = Config(nproc_per_node=str(node.local_world_size), script="train.py")
        specs = worker_specs(config, setup, "run", state, node_rank, "127.0.0.1:29500")
        # Then the replicator's view of the node's ranks is the workers' ranks
        assert list(membership.local_ranks()) == [spec.global_rank for spec in specs]
    # and a node without a node rank (joining, a spare node) runs none
    outsider = Membership("n9")
    outsider.enter(state)
    assert list(outsider.local_ranks()) == [] and list(Membership("n0").local_ranks()) == []
