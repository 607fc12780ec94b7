"""Which workers the agent kills as hung, and how: a fake control says how long each was silent."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.supervision.rounds import Round
from resilrun.agent.supervision.worker_verdicts import HungWorkers
from resilrun.config import Config
from resilrun.rendezvous.protocol import RdzvState


@dataclass
class FakeControl:
    silent: dict[int, float] = field(default_factory=dict)
    stalled: dict[int, float] = field(default_factory=dict)
    pending: dict[int, float] = field(default_factory=dict)

    def silent_for(self, pid: int) -> float | None:
        return self.silent.get(pid)

    def stalled_for(self, pid: int) -> float | None:
        return self.stalled.get(pid)

    def first_step_pending_for(self, pid: int) -> float | None:
        return self.pending.get(pid)


class FakeWorker:
    def __init__(self, pid: int, rank: int) -> None:
        self.pid = pid
        self.spec = SimpleNamespace(global_rank=rank)
        self.signals: list[int] = []
        self.code: int | None = None
        self.popen = SimpleNamespace(wait=lambda timeout: None)

    def poll(self) -> int | None:
        return self.code

    def signal_group(self, signum: int) -> None:
        self.signals.append(signum)
        self.code = -signum


class RecordingTelemetry(Telemetry):
    def __init__(self) -> None:
        self.hung_ranks: list[tuple[int, int, str]] = []

    def hung(self, rank: int, pid: int, reason: str) -> None:
        self.hung_ranks.append((rank, pid, reason))


CONFIG = Config(heartbeat_timeout_s=5.0, hang_timeout_s=300.0, first_step_timeout_s=600.0)


@pytest.mark.parametrize(
    ("silent", "stalled", "pending", "reason"),
    [
        (6.0, None, None, "no heartbeat for 6.0 s (frozen?)"),
        (1.0, 301.0, None, "no step committed for 301 s (--hang-timeout 300)"),
        (1.0, None, 601.0, "no first step after 601 s (--first-step-timeout 600)"),
        (4.9, 299.0, 599.0, None),
    ],
)
def test_a_worker_is_hung_past_exactly_one_of_its_three_timeouts(
    silent: float, stalled: float | None, pending: float | None, reason: str | None
) -> None:
    control = FakeControl({1: silent}, {1: stalled} if stalled else {}, {1: pending} if pending else {})
    assert HungWorkers(CONFIG, control, Telemetry()).reason(1) == reason  # type: ignore[arg-type]


def test_hung_workers_are_killed_once_and_the_others_left_alone() -> None:
    control = FakeControl(silent={10: 9.0, 11: 0.5, 12: 9.0})
    telemetry = RecordingTelemetry()
    workers = [FakeWorker(10, 0), FakeWorker(11, 1), FakeWorker(12, 2)]
    workers[2].code = 0  # already finished: never killed, however long it has been silent
    round_ = Round(RdzvState(round=1), 0, workers, [], None)  # type: ignore[arg-type]
    judge = HungWorkers(CONFIG, control, telemetry)  # type: ignore[arg-type]
    judge.kill(round_)
    judge.kill(round_)  # the next tick: the killed worker is not killed again
    assert [w.signals for w in workers] == [[signal.SIGKILL], [], []]
    assert round_.killed == {10}
    assert telemetry.hung_ranks == [(0, 10, "no heartbeat for 9.0 s (frozen?)")]
