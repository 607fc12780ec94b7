"""The hot-spare pool's decisions with fake processes, a fake control and a fake clock: no process
is started and nothing sleeps."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.supervision.rounds import Round, SignalFlag
from resilrun.agent.supervision.spare_pool import SPARE_READY_TIMEOUT_S, SparePool
from resilrun.agent.workers.procs import WorkerSpec
from resilrun.agent.workers.specs import NodeSetup
from resilrun.config import Config
from resilrun.errors import ShutdownRequested
from resilrun.rendezvous.protocol import RdzvState


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeProcess:
    """What the pool reads of a spare: its pid, spec, exit code and output."""

    def __init__(self, pid: int, spec: WorkerSpec) -> None:
        self.pid = pid
        self.spec = spec
        self.popen = SimpleNamespace(returncode=None)
        self.exit_observed_at: float | None = None
        self.output_finished = False

    def poll(self) -> int | None:
        return self.popen.returncode

    def die(self, code: int, message: str | None = None) -> None:
        self.popen.returncode = code
        self.exit_observed_at = 1.0
        if message is not None:  # what the bootstrap writes for a spare that raised while waiting
            self.spec.error_file.parent.mkdir(parents=True, exist_ok=True)
            extra = {"py_callstack": f"Traceback (most recent call last):\n{message}\n", "timestamp": "1.0"}
            self.spec.error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))

    def finish_output(self) -> None:
        self.output_finished = True


@dataclass
class FakeControl:
    """Spares become "waiting for a rank" when the test says so, or after ``warm_s`` of fake time."""

    clock: FakeClock
    waiting: set[int] = field(default_factory=set)
    warm_at: dict[int, float] = field(default_factory=dict)
    waited: list[float] = field(default_factory=list)

    def waiting_spares(self) -> list[int]:
        self.waiting |= {pid for pid, at in self.warm_at.items() if self.clock.now >= at}
        return sorted(self.waiting)

    def wait_for_waiting_spares(self, pids: list[int], needed: int, timeout_s: float) -> bool:
        self.waited.append(timeout_s)
        self.clock.now += timeout_s  # the time passes; whoever warmed up meanwhile now waits
        return len(set(self.waiting_spares()) & set(pids)) >= needed


@dataclass
class RecordingTelemetry(Telemetry):
    exits: list[tuple[int, int | None, str, int, float]] = field(default_factory=list)

    def spare_exited(self, pid: int, exit_code: int | None, message: str, alive: int, retry_in_s: float) -> None:
        self.exits.append((pid, exit_code, message, alive, retry_in_s))


@dataclass
class Pool:
    pool: SparePool
    round: Round
    clock: FakeClock
    control: FakeControl
    telemetry: RecordingTelemetry
    started: list[FakeProcess]
    signals: SignalFlag


@pytest.fixture
def make(tmp_path: Path):  # noqa: ANN201 - a factory
    def build(spares: int = 2, warm_s: float | None = 0.0) -> Pool:
        clock = FakeClock()
        control = FakeControl(clock)
        telemetry = RecordingTelemetry()
        started: list[FakeProcess] = []
        signals = SignalFlag()

        def spawn(spec: WorkerSpec) -> FakeProcess:
            process = FakeProcess(1000 + len(started), spec)
            started.append(process)
            if warm_s is not None:
                control.warm_at[process.pid] = clock.now + warm_s
            return process

        config = Config(spares=spares)
        setup = NodeSetup(nproc=2, addr="127.0.0.1", log_root=tmp_path, base_env={})
        pool = SparePool(config, setup, control, telemetry, signals, spawn=spawn, clock=clock)  # type: ignore[arg-type]
        round_ = Round(RdzvState(round=3), 0, [], [], None)
        return Pool(pool, round_, clock, control, telemetry, started, signals)

    return build


def test_top_up_starts_the_configured_spares_and_replaces_dead_ones(make) -> None:  # noqa: ANN001
    p = make(spares=2)
    p.pool.top_up(p.round)
    assert [s.pid for s in p.round.spares] == [1000, 1001]
    assert [s.spec.log_dir.name for s in p.round.spares] == ["spare_1", "spare_2"]  # one log dir each
    p.round.spares[0].die(-9)
    p.round.respawn_at = 5.0
    p.pool.top_up(p.round)
    assert [s.pid for s in p.round.spares] == [1001, 1002] and p.round.respawn_at is None


def test_a_spare_that_dies_while_waiting_is_reported_and_restarted_after_a_growing_backoff(
    make,
    caplog: pytest.LogCaptureFixture,  # noqa: ANN001
) -> None:
    p = make(spares=1, warm_s=None)  # spares that die before they ever wait for a rank
    p.pool.top_up(p.round)
    spare = p.round.spares[0]
    spare.die(1, "RuntimeError: could not preload the model")
    with caplog.at_level(logging.ERROR, logger="resilrun.agent.supervision.spare_pool"):
        p.pool.check(p.round)
    # Then it is gone from the pool, its output collected, and the log says why, with its traceback
    assert p.round.spares == [] and spare.output_finished
    assert "hot spare (pid 1000) exited while waiting for a rank: RuntimeError: could not preload" in caplog.text
    assert "the spare's traceback" in caplog.text
    assert p.telemetry.exits == [(1000, 1, "RuntimeError: could not preload the model", 0, 1.0)]
    # and another starts after 1 s, not before
    assert not p.pool.due(p.round)
    p.clock.now += 1.0
    assert p.pool.due(p.round)
    p.pool.top_up(p.round)
    # A second death before any spare got ready doubles the wait; a ready spare resets it
    p.round.spares[0].die(-9)
    p.pool.check(p.round)
    assert p.telemetry.exits[-1][-1] == 2.0
    p.clock.now += 2.0
    p.pool.top_up(p.round)
    p.control.waiting.add(p.round.spares[0].pid)
    p.pool.check(p.round)  # this one got as far as waiting for a rank: the crash loop is over
    p.round.spares[0].die(-9)
    p.pool.check(p.round)
    assert p.telemetry.exits[-1][-1] == 1.0


def test_a_recovery_gets_the_spares_already_waiting_without_waiting(make) -> None:  # noqa: ANN001
    p = make(spares=2)
    p.pool.top_up(p.round)
    assert [s.pid for s in p.pool.ready(p.round, 1)] == [1000, 1001]
    assert p.control.waited == []


def test_a_recovery_waits_for_a_warming_spare_in_fake_time(make) -> None:  # noqa: ANN001
    p = make(spares=1, warm_s=2.0)  # the spare imports torch for two seconds
    p.pool.top_up(p.round)
    started = p.clock.now
    assert [s.pid for s in p.pool.ready(p.round, 1)] == [1000]
    assert 2.0 <= p.clock.now - started < 2.5  # woken within a recheck of the spare getting ready


def test_with_too_few_spares_a_recovery_starts_new_processes_for_the_missing_places(make) -> None:  # noqa: ANN001
    p = make(spares=0, warm_s=3.0)
    ready = p.pool.ready(p.round, 2)
    assert [s.pid for s in p.started] == [1000, 1001]  # two new worker processes for two failed ranks
    assert [s.pid for s in ready] == [1000, 1001]


def test_a_spare_that_never_gets_ready_ends_the_wait_at_the_deadline(make) -> None:  # noqa: ANN001
    p = make(spares=1, warm_s=None)  # never waits for a rank
    p.pool.top_up(p.round)
    started = p.clock.now
    assert p.pool.ready(p.round, 1) == []
    assert p.clock.now - started == pytest.approx(SPARE_READY_TIMEOUT_S)  # the caller restarts instead


def test_a_spare_dying_while_waited_for_ends_the_wait_early(make) -> None:  # noqa: ANN001
    p = make(spares=2, warm_s=None)
    p.pool.top_up(p.round)
    real_wait = p.control.wait_for_waiting_spares

    def die_on_first_wait(pids: list[int], needed: int, timeout_s: float) -> bool:
        p.round.spares[0].die(-9)
        return real_wait(pids, needed, timeout_s)

    p.control.wait_for_waiting_spares = die_on_first_wait  # type: ignore[method-assign]
    started = p.clock.now
    assert p.pool.ready(p.round, 2) == []
    assert p.clock.now - started < 1.0  # one recheck, not the 30 s deadline


def test_a_shutdown_signal_ends_the_wait(make) -> None:  # noqa: ANN001
    p = make(spares=1, warm_s=None)
    p.pool.top_up(p.round)
    p.signals.signum = 15
    with pytest.raises(ShutdownRequested):
        p.pool.ready(p.round, 1)
