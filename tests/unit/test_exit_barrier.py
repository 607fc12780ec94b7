"""The exit barrier: nodes whose workers finished wait for the others, with a deadline and a
heartbeat check, and count each node once even when the store applies a counter update twice.

No process runs: each node is a Supervisor over one shared MemoryBackend, time is a fake clock
that moves only when the barrier sleeps, and a poll budget stops a barrier that would wait forever.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from resilrun import keys
from resilrun.agent.supervision.rounds import RoundEnd, SignalFlag
from resilrun.agent.supervision.supervisor import Supervisor
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.specs import NodeSetup
from resilrun.config import Config
from resilrun.errors import RendezvousClosedError, RendezvousTimeoutError, ShutdownRequested
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState

RUN = "job-exit"
ROUND = 3


class FakeClock:
    """Monotonic time that moves only when someone sleeps; ``on_sleep`` plays the other nodes' part."""

    def __init__(self, on_sleep: Callable[[], None] | None = None) -> None:
        self.now = 1000.0
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep()


class StillWaiting(Exception):  # noqa: N818 - a test signal, not an error
    """The barrier polled more often than the test allows: it would have waited on."""


class PollBudget(SignalFlag):
    """A signal flag the barrier checks once per poll; raises StillWaiting after ``polls`` checks."""

    def __init__(self, polls: int) -> None:
        super().__init__()
        self.polls = polls

    def raise_if_set(self) -> None:
        super().raise_if_set()
        self.polls -= 1
        if self.polls < 0:
            raise StillWaiting


class DoubleAdd(MemoryBackend):
    """Applies every increment twice: an etcd add whose answer was lost and that was retried."""

    def add(self, key: str, amount: int) -> int:
        if amount:
            super().add(key, amount)
        return super().add(key, amount)


def node(name: str) -> NodeInfo:
    return NodeInfo(node_id=name, addr=f"{name}.local", local_world_size=1, hostname=name)


def start_round(backend: MemoryBackend, names: list[str]) -> RdzvState:
    state = RdzvState(round=ROUND, complete=True, participants=tuple(node(n) for n in names))
    backend.set(keys.rdzv_state(RUN), state.to_bytes())
    return state


def make_config(**overrides: float) -> Config:
    # Small, fake-clock seconds: the heartbeat verdict comes after ~20 polls, the deadline after ~100.
    base = Config(monitor_interval_s=0.001, heartbeat_interval_s=0.005, heartbeat_timeout_s=0.02, max_restarts=1)
    return dataclasses.replace(base, **overrides)


def supervisor(
    backend: MemoryBackend,
    me: str,
    clock: FakeClock,
    config: Config,
    signals: SignalFlag,
    tmp_path: Path,
) -> Supervisor:
    rdzv = RendezvousClient(
        backend,
        RUN,
        node(me),
        min_nodes=1,
        max_nodes=8,
        join_timeout=timedelta(seconds=60),
        last_call_timeout=timedelta(seconds=1),
        clock=clock,
    )
    setup = NodeSetup(nproc=1, addr=f"{me}.local", log_root=tmp_path, base_env={})
    return Supervisor(config, setup, rdzv, signals, WorkerControl())


def beat(backend: MemoryBackend, *names: str) -> Callable[[], None]:
    """The named nodes are alive: their agents bump their heartbeat counters all along."""

    def bump() -> None:
        for name in names:
            backend.add(keys.node_heartbeat(RUN, name), 1)

    return bump


def finish_and_die(backend: MemoryBackend, me: str, state: RdzvState, tmp_path: Path) -> None:
    """Node ``me`` enters the barrier (its workers exited 0) and its agent dies at once after."""
    dying = SignalFlag()
    dying.signum = signal.SIGKILL  # the barrier's first poll stops it, right after it counted itself
    node_ = supervisor(backend, me, FakeClock(), make_config(), dying, tmp_path)
    with pytest.raises(ShutdownRequested):
        node_.exit_barrier.wait(state)


def current(backend: MemoryBackend) -> RdzvState:
    return RdzvState.from_bytes(backend.get(keys.rdzv_state(RUN)))


def test_all_nodes_finished_closes_the_job_as_succeeded(tmp_path: Path) -> None:
    backend = MemoryBackend()
    state = start_round(backend, ["a", "b"])
    finish_and_die(backend, "b", state, tmp_path)
    a = supervisor(backend, "a", FakeClock(), make_config(), PollBudget(1000), tmp_path)
    assert a.exit_barrier.wait(state) is RoundEnd.DONE
    assert (current(backend).closed, current(backend).outcome) == (True, "succeeded")


def test_a_node_lost_after_its_workers_finished_does_not_fail_the_job(tmp_path: Path) -> None:
    # b counted itself done, then its heartbeat stopped for good: its ranks' work is complete.
    backend = MemoryBackend()
    state = start_round(backend, ["a", "b", "c"])
    finish_and_die(backend, "b", state, tmp_path)
    finish_and_die(backend, "c", state, tmp_path)
    a = supervisor(backend, "a", FakeClock(), make_config(), PollBudget(1000), tmp_path)
    assert a.exit_barrier.wait(state) is RoundEnd.DONE
    assert current(backend).outcome == "succeeded"


def test_a_node_lost_before_its_workers_finished_restarts_the_job(tmp_path: Path) -> None:
    # b never reaches the barrier and its heartbeat stands still: a must notice, not wait forever.
    backend = MemoryBackend()
    state = start_round(backend, ["a", "b"])
    a = supervisor(backend, "a", FakeClock(), make_config(), PollBudget(1000), tmp_path)
    assert a.exit_barrier.wait(state) is RoundEnd.REJOIN
    after = current(backend)
    assert (after.closed, after.round, after.restarts) == (False, ROUND + 1, 1)
    assert after.failure is not None and "node lost" in after.failure["message"]
    assert after.failure["node_rank"] == 1


def test_a_node_lost_before_its_workers_finished_fails_the_job_without_a_restart_left(tmp_path: Path) -> None:
    from resilrun.errors import WorkerGroupFailed

    backend = MemoryBackend()
    state = start_round(backend, ["a", "b"])
    a = supervisor(backend, "a", FakeClock(), make_config(max_restarts=0), PollBudget(1000), tmp_path)
    with pytest.raises(WorkerGroupFailed, match="node 1 .*node lost"):
        a.exit_barrier.wait(state)
    assert (current(backend).closed, current(backend).outcome) == (True, "failed")


def test_the_barrier_gives_up_at_its_deadline_and_stops_the_job(tmp_path: Path) -> None:
    # b is alive (heartbeating) but its workers never finish: a gives up after --exit-barrier-timeout.
    backend = MemoryBackend()
    state = start_round(backend, ["a", "b"])
    clock = FakeClock(on_sleep=beat(backend, "b"))
    config = make_config(exit_barrier_timeout_s=0.1)
    a = supervisor(backend, "a", clock, config, PollBudget(1000), tmp_path)
    start = clock.now
    with pytest.raises(RendezvousTimeoutError, match=r"node 1 \(b\)") as info:
        a.exit_barrier.wait(state)
    assert 0.1 <= clock.now - start < 0.2
    assert info.value.hint is not None and "--exit-barrier-timeout" in info.value.hint
    after = current(backend)
    assert (after.closed, after.outcome) == (True, "stopped")
    # b's agent follows the close (stops its workers) and says why.
    b = supervisor(backend, "b", FakeClock(), make_config(), PollBudget(10), tmp_path)
    with pytest.raises(RendezvousClosedError, match="exit barrier"):
        b.restarts.follow_close(after)


def test_a_twice_applied_counter_update_does_not_count_a_node_twice(tmp_path: Path) -> None:
    # The store applies a's update twice (a retried etcd add): b, still running, must not be
    # counted done, or the job closes "succeeded" and b's workers are SIGTERMed mid-run.
    backend = DoubleAdd()
    state = start_round(backend, ["a", "b"])
    clock = FakeClock(on_sleep=beat(backend, "b"))
    a = supervisor(backend, "a", clock, make_config(), PollBudget(50), tmp_path)
    with pytest.raises(StillWaiting):
        a.exit_barrier.wait(state)
    assert not current(backend).closed
    finish_and_die(backend, "b", state, tmp_path)
    a = supervisor(backend, "a", clock, make_config(), PollBudget(50), tmp_path)
    assert a.exit_barrier.wait(state) is RoundEnd.DONE
    assert current(backend).outcome == "succeeded"


def test_a_node_entering_the_barrier_twice_is_counted_once(tmp_path: Path) -> None:
    # b's barrier is retried (its first attempt's answer was lost): still one node of three.
    backend = MemoryBackend()
    state = start_round(backend, ["a", "b", "c"])
    finish_and_die(backend, "b", state, tmp_path)
    finish_and_die(backend, "b", state, tmp_path)
    clock = FakeClock(on_sleep=beat(backend, "c"))
    a = supervisor(backend, "a", clock, make_config(), PollBudget(50), tmp_path)
    with pytest.raises(StillWaiting):
        a.exit_barrier.wait(state)
    assert not current(backend).closed


@pytest.mark.parametrize("seconds", [0.0, -1.0])
def test_a_non_positive_exit_barrier_timeout_is_a_usage_error(seconds: float, tmp_path: Path) -> None:
    from resilrun.errors import ConfigError

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="--exit-barrier-timeout"):
        Config.from_cli(script=str(script), exit_barrier_timeout_s=seconds)
