"""Every recovery decision of the round loop, driven with fakes: no process starts, nothing sleeps.

Each test is one node's Supervisor over a shared MemoryBackend (the rendezvous), fake worker
processes, a WorkerControl whose spares are "waiting for a rank" when the test says so, and a fake
clock that moves only when the loop waits. A script of what happens at which tick (a worker dies,
a node stops heartbeating, the other node finishes) plays the rest of the job. The assertions are
on outcomes: the rendezvous state, which process holds which rank, what the telemetry recorded.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resilrun import keys
from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.supervision import round_master
from resilrun.agent.supervision.rounds import NodePhase, Round, RoundEnd, SignalFlag
from resilrun.agent.supervision.supervisor import Supervisor
from resilrun.agent.workers.control import WorkerControl
from resilrun.agent.workers.failures import ProcessFailure
from resilrun.agent.workers.procs import Processes, WorkerSnapshot, WorkerSpec
from resilrun.agent.workers.specs import NodeSetup
from resilrun.config import Config
from resilrun.env import STATE_LOST_EXIT_CODE
from resilrun.errors import ShutdownRequested, StateLostError, WorkerGroupFailed
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import MAX_RECOVERIES_WITHOUT_PROGRESS, NodeInfo, RdzvState, decide_replace

RUN = "job-paths"
NPROC = 2
OTHER_MASTER = "a.local:29500"


class FakeClock:
    """Time that moves only when the node waits; each wait is one tick of the rest of the job."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.on_sleep: Callable[[], None] = lambda: None

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.on_sleep()


class FakeProcess:
    """What the supervisor's parts read and do to a worker process."""

    def __init__(self, pid: int, spec: WorkerSpec) -> None:
        self.pid = pid
        self.spec = spec
        self.popen = SimpleNamespace(returncode=None)
        self.exit_observed_at: float | None = None
        self.started_at = 0.0
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.popen.returncode

    def exit(self, code: int) -> None:
        if self.popen.returncode is None:
            self.popen.returncode = code
            self.exit_observed_at = 1.0

    def signal_group(self, signum: int) -> None:
        self.signals.append(signum)
        self.exit(-signum)

    def finish_output(self) -> None:
        pass

    def snapshot(self) -> WorkerSnapshot:
        return WorkerSnapshot(self.pid, self.spec.local_rank, self.spec.global_rank, 0.0, self.poll(), None)


class TooManyTicks(Exception):  # noqa: N818 - a test signal, not an error
    """The loop kept waiting past the script's end: it would have waited on."""


class World:
    """The rest of the job, played tick by tick: each tick is one wait of the node's loop."""

    def __init__(self, backend: MemoryBackend, clock: FakeClock, control: FakeControl) -> None:
        self.backend = backend
        self.clock = clock
        self.control = control
        self.tick = 0
        self.script: dict[int, Callable[[World], None]] = {}
        self.alive = {"a", "b", "s"}  # nodes whose agents heartbeat
        self.max_ticks = 400
        self.processes: list[FakeProcess] = []
        self.warm_spares = True  # spares reach "waiting for a rank" as soon as they start
        self.on_api = True  # scripts call resilrun.init() (else they are plain torchrun scripts)
        self.reruns = False  # plain scripts' workers register as able to re-run (--rerun-in-process)
        clock.on_sleep = self.step

    def at(self, tick: int, action: Callable[[World], None]) -> None:
        self.script[tick] = action

    def step(self) -> None:
        self.tick += 1
        if self.tick > self.max_ticks:
            raise TooManyTicks
        for node in self.alive:
            self.backend.add(keys.node_heartbeat(RUN, node), 1)
        action = self.script.get(self.tick)
        if action is not None:
            action(self)

    def state(self) -> RdzvState:
        return RdzvState.from_bytes(self.backend.get(keys.rdzv_state(RUN)))

    def set_state(self, state: RdzvState) -> None:
        self.backend.set(keys.rdzv_state(RUN), state.to_bytes())

    def worker(self, global_rank: int) -> FakeProcess:
        return next(p for p in self.processes if p.spec.global_rank == global_rank and p.poll() is None)

    def spares(self) -> list[FakeProcess]:
        return [p for p in self.processes if p.spec.global_rank < 0 and p.poll() is None]


class FakeProcesses(Processes):
    def __init__(self, world: World) -> None:
        self.world = world
        self.next_pid = 100
        self.stopped: list[tuple[int, int]] = []  # (pid, signal)

    def spawn(self, spec: WorkerSpec) -> FakeProcess:  # type: ignore[override]
        self.next_pid += 1
        process = FakeProcess(self.next_pid, spec)
        self.world.processes.append(process)
        if self.world.on_api:
            self.world.control.register_api(process.pid)
        elif self.world.reruns:
            self.world.control.register_rerun(process.pid)
        if spec.global_rank < 0 and self.world.warm_spares:
            self.world.control.warm.add(process.pid)
        return process

    def wait_any_exit(self, workers: Iterable[Any], timeout_s: float) -> None:
        self.world.clock.sleep(timeout_s)

    def stop(self, workers: Iterable[Any], signum: int, grace_s: float) -> None:
        for worker in workers:
            if worker.poll() is None:
                self.stopped.append((worker.pid, signum))
            worker.exit(-signum)


class FakeControl(WorkerControl):
    """A WorkerControl whose spares wait for a rank once warm (``warm``), without channel threads;
    waiting for a spare moves the fake clock instead of blocking."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.warm: set[int] = set()
        self.assigned: dict[int, dict[str, str]] = {}
        self.published: list[tuple[int, dict[int, dict[str, str]]]] = []

    def waiting_spares(self) -> list[int]:
        return sorted(self.warm - set(self.assigned))

    def wait_for_waiting_spares(self, pids: list[int], needed: int, timeout_s: float) -> bool:
        self.clock.sleep(timeout_s)
        return len(set(self.waiting_spares()) & set(pids)) >= needed

    def assign(self, pid: int, env: dict[str, str]) -> None:
        super().assign(pid, env)
        self.assigned[pid] = env

    def publish_generation(self, round: int, envs: dict[int, dict[str, str]]) -> None:
        super().publish_generation(round, envs)
        self.published.append((round, envs))


@dataclasses.dataclass
class Recorded(Telemetry):
    """The telemetry hooks the decisions call, kept for the assertions."""

    calls: list[tuple[str, Any]] = dataclasses.field(default_factory=list)
    reruns: list[bool] = dataclasses.field(default_factory=list)  # each recovery's ``rerun``
    stragglers: list[bool] = dataclasses.field(default_factory=list)  # each recovery's ``straggler``

    def failures(self, round: int, failures: list[ProcessFailure]) -> None:
        self.calls.append(("failures", (round, [f.global_rank for f in failures])))

    def recovery_decided(
        self,
        new: RdzvState,
        failed: list[Any],
        replacements: dict[int, Any],
        decided_s: float,
        *,
        rerun: bool = False,
        straggler: bool = False,
    ) -> None:
        self.calls.append(("recovery", (new.round, {k: v.pid for k, v in replacements.items()})))
        self.reruns.append(rerun)
        self.stragglers.append(straggler)

    def straggler(self, kind: str, rank: int, **evidence: Any) -> None:
        self.calls.append((f"straggler_{kind}", (rank, evidence)))

    def nodes_replaced(self, new: RdzvState, failures: list[ProcessFailure], *, straggler: Any = None) -> None:
        self.calls.append(("nodes_replaced", new.round))

    def restart(self, old: RdzvState, new: RdzvState, cause: ProcessFailure | None) -> None:
        self.calls.append(("restart", (old.round, new.round, cause.global_rank if cause else None)))

    def generation_entered(self, new: RdzvState, node_rank: int, workers: list[Any]) -> None:
        self.calls.append(("generation", (new.round, [w.pid for w in workers])))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.calls]


class OtherNodeHostsStores(MemoryBackend):
    """Node rank 0 ("a") hosts every round's worker store as soon as the round exists, unless told not to."""

    def __init__(self) -> None:
        super().__init__()
        self.host_stores = True

    def get(self, key: str) -> bytes | None:
        if self.host_stores and re.fullmatch(keys.round_master(RUN, 999).replace("999", r"\d+"), key):
            return OTHER_MASTER.encode()
        return super().get(key)


def node(name: str) -> NodeInfo:
    return NodeInfo(node_id=name, addr=f"{name}.local", local_world_size=NPROC, hostname=name)


@dataclasses.dataclass
class Job:
    sup: Supervisor
    world: World
    processes: FakeProcesses
    control: FakeControl
    telemetry: Recorded
    signals: SignalFlag
    backend: OtherNodeHostsStores


def make_job(
    tmp_path: Path,
    *,
    me: str = "b",
    spares: int = 1,
    spare_nodes: tuple[str, ...] = (),
    captured: Any = None,
    fence: Any = None,
    **config: Any,
) -> Job:
    clock = FakeClock()
    backend = OtherNodeHostsStores()
    control = FakeControl(clock)
    world = World(backend, clock, control)
    processes = FakeProcesses(world)
    telemetry = Recorded()
    signals = SignalFlag()
    base = Config(
        spares=spares,
        monitor_interval_s=0.1,
        heartbeat_interval_s=0.5,
        heartbeat_timeout_s=2.0,
        max_restarts=3,
        shutdown_timeout_s=0.0,
        exit_barrier_timeout_s=60.0,
    )
    rdzv = RendezvousClient(
        backend,
        RUN,
        node(me),
        min_nodes=1,
        max_nodes=8,
        join_timeout=timedelta(seconds=30),
        last_call_timeout=timedelta(seconds=1),
        clock=clock,
    )
    setup = NodeSetup(nproc=NPROC, addr=f"{me}.local", log_root=tmp_path, base_env={})
    sup = Supervisor(
        dataclasses.replace(base, **config),
        setup,
        rdzv,
        signals,
        control,
        telemetry,
        processes,
        captured=captured,
        fence=fence,
    )
    world.set_state(
        RdzvState(round=0, complete=True, participants=(node("a"), node("b")), spares=tuple(map(node, spare_nodes)))
    )
    return Job(sup, world, processes, control, telemetry, signals, backend)


def run_round(job: Job) -> RoundEnd:
    state = job.world.state()
    job.sup.membership.enter(state)
    rank = state.node_rank(job.sup.rdzv.me.node_id)
    assert rank is not None
    return job.sup._run_round(state, rank)


def fail(rank: int, code: int = -signal.SIGKILL) -> Callable[[World], None]:
    return lambda world: world.worker(rank).exit(code)


def commit(rank: int, step: int) -> Callable[[World], None]:
    return lambda world: world.control.report_step(world.worker(rank).pid, step)


def finish_all(world: World) -> None:
    """Every worker of the job exits 0 (the other nodes say so at the exit barrier)."""
    for process in world.processes:
        if process.spec.global_rank >= 0:
            process.exit(0)
    state = world.state()
    for other in state.participants:
        world.backend.set(keys.round_done(RUN, state.round, other.node_id), b"1")


def then(*actions: Callable[[World], None]) -> Callable[[World], None]:
    def run(world: World) -> None:
        for action in actions:
            action(world)

    return run


# -- a worker crash ------------------------------------------------------------------------------
def test_a_crashed_worker_is_replaced_by_a_hot_spare_and_the_survivor_keeps_its_process(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=1)
    job.world.at(3, fail(3))
    job.world.at(10, finish_all)
    survivor = {}
    job.world.at(2, lambda w: survivor.update(pid=w.worker(2).pid, spare=w.spares()[0].pid))

    assert run_round(job) is RoundEnd.DONE

    state = job.world.state()
    assert (state.closed, state.outcome, state.restarts, state.recoveries) == (True, "succeeded", 0, 1)
    workers = job.sup.membership.current.workers  # type: ignore[union-attr]
    assert [w.pid for w in workers] == [survivor["pid"], survivor["spare"]]
    assert [w.spec.global_rank for w in workers] == [2, 3]
    assert job.control.assigned[survivor["spare"]]["RANK"] == "3"
    # The survivor learns the new generation's env; the spare got its own by assignment.
    assert job.control.published == [(1, {survivor["pid"]: workers[0].spec.env})]
    assert workers[0].spec.env["MASTER_ADDR"] == "a.local"
    assert job.telemetry.kinds() == ["failures", "recovery", "generation"]
    assert job.telemetry.calls[1] == ("recovery", (1, {1: survivor["spare"]}))
    assert job.processes.stopped == []  # nobody was stopped along the way (only at the end, as finished)


def test_without_a_spare_a_new_process_takes_the_rank_when_it_comes_up_in_time(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=0)
    job.world.at(3, fail(3))
    job.world.at(10, finish_all)

    assert run_round(job) is RoundEnd.DONE

    state = job.world.state()
    assert (state.restarts, state.recoveries) == (0, 1)
    promoted = job.sup.membership.current.workers[1]  # type: ignore[union-attr]
    assert promoted.spec.global_rank == 3 and promoted.pid in job.control.assigned


def test_without_a_spare_that_comes_up_the_job_restarts(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=0)
    job.world.warm_spares = False  # the new process never reaches "waiting for a rank"
    job.world.at(3, fail(3))

    assert run_round(job) is RoundEnd.REJOIN

    state = job.world.state()
    assert (state.round, state.recovering, state.restarts, state.recoveries) == (1, False, 1, 0)
    assert state.failure is not None and state.failure["global_rank"] == 3
    assert ("restart", (0, 1, 3)) in job.telemetry.calls
    assert all(p.poll() is not None for p in job.world.processes)  # every process of the round is gone


def test_a_script_off_the_resilrun_api_restarts_even_with_a_spare(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=1)
    job.world.on_api = False  # a plain torchrun script
    job.world.at(3, fail(3))

    assert run_round(job) is RoundEnd.REJOIN
    assert (job.world.state().restarts, job.world.state().recoveries) == (1, 0)


class FakeCaptured:
    """The script's checkpoint folder: records when it was told of a failure and put back."""

    def __init__(self, control: FakeControl | None = None) -> None:
        self.control = control
        self.calls: list[tuple[str, int]] = []  # (call, generations published before it)

    def worker_failed(self) -> None:
        self.calls.append(("worker_failed", len(self.control.published) if self.control else 0))

    def restore(self, timeout_s: float) -> None:
        self.calls.append(("restore", len(self.control.published) if self.control else 0))


def test_a_plain_script_that_can_rerun_recovers_in_process_with_the_spare(tmp_path: Path) -> None:
    captured = FakeCaptured()
    job = make_job(tmp_path, spares=1, rerun_in_process=True, captured=captured)
    captured.control = job.control
    job.world.on_api = False  # a plain torchrun script, its workers registered as re-runnable
    job.world.reruns = True
    job.world.at(3, fail(3))
    job.world.at(10, finish_all)
    survivor = {}
    job.world.at(2, lambda w: survivor.update(pid=w.worker(2).pid, spare=w.spares()[0].pid))

    assert run_round(job) is RoundEnd.DONE

    state = job.world.state()
    assert (state.restarts, state.recoveries) == (0, 1)
    workers = job.sup.membership.current.workers  # type: ignore[union-attr]
    assert [w.pid for w in workers] == [survivor["pid"], survivor["spare"]]  # the survivor kept its process
    assert job.control.assigned[survivor["spare"]]["RANK"] == "3"
    assert job.control.published == [(1, {survivor["pid"]: workers[0].spec.env})]
    # The folder is put back (a torn save replaced) before the survivor learns the new generation.
    assert captured.calls == [("restore", 0), ("worker_failed", 0), ("restore", 0)]  # round start, then recovery
    assert job.processes.stopped == []
    assert job.telemetry.reruns == [True]  # recorded as a re-run (events, status history)


def test_a_plain_script_restarts_without_rerun_in_process_even_when_its_workers_could(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=1)
    job.world.on_api = False
    job.world.reruns = True
    job.world.at(3, fail(3))

    assert run_round(job) is RoundEnd.REJOIN
    assert (job.world.state().restarts, job.world.state().recoveries) == (1, 0)


def test_a_plain_script_restarts_when_a_worker_refused_to_rerun(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=1, rerun_in_process=True)
    job.world.on_api = False
    job.world.reruns = True
    # The survivor started a thread of its own: it cannot re-run the script in its process.
    job.world.at(2, lambda w: w.control.register_rerun(w.worker(2).pid, "a non-daemon thread"))
    job.world.at(3, fail(3))

    assert run_round(job) is RoundEnd.REJOIN
    assert (job.world.state().restarts, job.world.state().recoveries) == (1, 0)


def test_a_failure_during_recovery_is_recovered_and_the_same_rank_failing_again_restarts(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=2)
    job.world.at(2, commit(2, 7))
    job.world.at(3, fail(3))  # recovery 1: rank 3 gets a spare
    job.world.at(5, fail(2))  # another rank, no new step: an independent failure, recovered too
    job.world.at(8, fail(2))  # rank 2 again, still no new step: deterministic, the restart path decides

    assert run_round(job) is RoundEnd.REJOIN

    state = job.world.state()
    assert (state.round, state.recoveries, state.restarts, state.recovering) == (3, 2, 1, False)
    assert job.telemetry.kinds().count("recovery") == 2


def test_a_worker_failing_on_its_own_again_after_progress_is_recovered(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=2)
    job.world.at(2, commit(3, 7))
    job.world.at(3, fail(3))
    job.world.at(5, commit(3, 8))  # the spare that took rank 3 committed a newer step
    job.world.at(6, fail(3))
    job.world.at(12, finish_all)

    assert run_round(job) is RoundEnd.DONE
    assert (job.world.state().recoveries, job.world.state().restarts) == (2, 0)


def test_a_spent_recovery_budget_restarts_the_job(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=1)
    stalled = dataclasses.replace(
        job.world.state(), progress_step=7, stalled_recoveries=MAX_RECOVERIES_WITHOUT_PROGRESS
    )
    job.world.set_state(stalled)
    job.world.at(2, commit(2, 7))  # no step newer than the one of the last recoveries
    job.world.at(3, fail(3))

    assert run_round(job) is RoundEnd.REJOIN
    state = job.world.state()
    assert (state.recovering, state.restarts, state.recoveries) == (False, 1, 0)


def test_a_failure_with_no_restart_left_fails_the_job_with_the_root_cause(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=0, max_restarts=0)
    job.world.warm_spares = False
    job.world.at(3, fail(3, code=1))

    with pytest.raises(WorkerGroupFailed, match=r"rank 3 on node 1 .*no restart left"):
        run_round(job)
    assert (job.world.state().closed, job.world.state().outcome) == (True, "failed")


def test_a_worker_that_found_no_state_stops_the_job_without_a_restart(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=1)
    job.world.at(3, fail(2, code=STATE_LOST_EXIT_CODE))

    with pytest.raises(StateLostError):
        run_round(job)
    state = job.world.state()
    assert (state.outcome, state.restarts, state.recoveries) == ("failed", 0, 0)


def test_a_signal_stops_the_workers_and_the_job(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=1)
    job.world.at(3, lambda w: job.signals.handler(signal.SIGTERM, None))

    with pytest.raises(ShutdownRequested):
        run_round(job)
    assert (job.world.state().closed, job.world.state().outcome) == (True, "stopped")
    assert {s for _, s in job.processes.stopped} == {signal.SIGTERM}
    assert len(job.processes.stopped) == NPROC + 1  # the workers and the spare


def test_a_recovery_decided_by_another_node_is_followed_in_place(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=1)
    pids: list[int] = []

    def other_node_recovers(world: World) -> None:
        pids.extend(world.worker(r).pid for r in (2, 3))
        world.set_state(dataclasses.replace(world.state(), round=1, recovering=True, recoveries=1))

    job.world.at(3, other_node_recovers)
    job.world.at(8, finish_all)

    assert run_round(job) is RoundEnd.DONE
    assert [w.pid for w in job.sup.membership.current.workers] == pids  # type: ignore[union-attr]
    assert job.control.published[0][0] == 1 and set(job.control.published[0][1]) == set(pids)


# -- a node loss ---------------------------------------------------------------------------------
def test_a_lost_node_is_replaced_by_a_spare_node_and_this_node_keeps_its_workers(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=0, spare_nodes=("s",))
    job.world.at(5, lambda w: w.alive.discard("a"))  # node "a" stops heartbeating
    pids: list[int] = []
    job.world.at(4, lambda w: pids.extend(w.worker(r).pid for r in (2, 3)))
    rounds_seen: list[int] = []
    job.world.at(24, lambda w: rounds_seen.append(w.state().round))  # 1.9 s after: not lost yet
    job.world.at(60, finish_all)

    assert run_round(job) is RoundEnd.DONE
    assert rounds_seen == [0]

    state = job.world.state()
    assert (state.round, state.recoveries, state.restarts) == (1, 1, 0)
    assert [p.node_id for p in state.participants] == ["s", "b"] and state.spares == ()
    assert [w.pid for w in job.sup.membership.current.workers] == pids  # type: ignore[union-attr]
    assert job.telemetry.kinds()[:3] == ["failures", "nodes_replaced", "generation"]
    assert job.telemetry.calls[0] == ("failures", (0, [0]))  # node "a"'s first rank, in round 0


def test_a_lost_node_without_a_spare_node_restarts_the_job(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=1)
    job.world.at(5, lambda w: w.alive.discard("a"))

    assert run_round(job) is RoundEnd.REJOIN

    state = job.world.state()
    assert (state.round, state.recovering, state.restarts) == (1, False, 1)
    assert state.failure is not None and state.failure["message"].startswith("node lost")
    assert all(p.poll() is not None for p in job.world.processes)


def test_a_plain_script_restarts_on_a_lost_node_even_with_a_spare_node(tmp_path: Path) -> None:
    # A torchrun script off resilrun's API cannot enter a new generation in its processes: its
    # collectives would wait on the lost node. Giving the spare node the place in-process left the
    # survivor's workers stuck; the job restarts, and the spare node joins the next round.
    job = make_job(tmp_path, spares=0, spare_nodes=("s",))
    job.world.on_api = False
    job.world.at(5, lambda w: w.alive.discard("a"))

    assert run_round(job) is RoundEnd.REJOIN

    state = job.world.state()
    assert (state.round, state.recovering, state.restarts, state.recoveries) == (1, False, 1, 0)
    assert state.failure is not None and state.failure["message"].startswith("node lost")
    assert all(p.poll() is not None for p in job.world.processes)


def test_a_node_lost_before_it_hosted_the_worker_store_is_replaced_by_a_spare_node(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=0, spare_nodes=("s",))
    job.backend.host_stores = False
    job.world.alive.discard("a")  # node rank 0 died before it hosted round 0's worker store
    state = job.world.state()
    job.sup.membership.enter(state)

    assert job.sup._run_round(state, 1) is RoundEnd.REJOIN

    new = job.world.state()
    assert (new.round, new.recovering, [p.node_id for p in new.participants]) == (1, True, ["s", "b"])
    assert job.world.processes == []  # no worker was started for a round without a store


def test_a_node_lost_before_it_hosted_the_worker_store_restarts_without_a_spare_node(tmp_path: Path) -> None:
    job = make_job(tmp_path, spares=0)
    job.backend.host_stores = False
    job.world.alive.discard("a")
    state = job.world.state()
    job.sup.membership.enter(state)

    assert job.sup._run_round(state, 1) is RoundEnd.REJOIN
    new = job.world.state()
    assert (new.round, new.recovering, new.restarts) == (1, False, 1)


# -- a spare node --------------------------------------------------------------------------------
def spare_job(tmp_path: Path) -> tuple[Job, RdzvState]:
    job = make_job(tmp_path, me="s", spares=0, spare_nodes=("s",))
    return job, job.world.state()


def test_a_spare_node_takes_a_lost_nodes_ranks_with_its_warm_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, state = spare_job(tmp_path)
    hosted: list[str] = []  # node rank 0 now: it hosts the new generation's worker store (no real one here)
    monkeypatch.setattr(
        round_master, "host_store", lambda addr, port, timeout: hosted.append(addr) or SimpleNamespace(port=29501)
    )
    warm: list[int] = []
    job.world.at(2, lambda w: warm.extend(p.pid for p in w.spares()))
    job.world.at(
        4,
        lambda w: w.set_state(decide_replace(w.state(), 0, ("a",), failure=None)),  # type: ignore[arg-type]
    )

    taken = job.sup.standby.stand_by(state)

    assert isinstance(taken, Round)
    assert (taken.node_rank, [w.pid for w in taken.workers]) == (0, warm)
    assert [w.spec.global_rank for w in taken.workers] == [0, 1]
    assert set(job.control.assigned) == set(warm)
    assert hosted == ["s.local"] and taken.workers[0].spec.env["MASTER_ADDR"] == "s.local"
    assert job.sup.membership.phase is NodePhase.ACTIVE
    assert job.processes.stopped == []  # the warm workers now run the ranks: the round loop owns them


def test_a_restart_ends_the_standby_and_the_warm_workers_are_kept_for_the_next_round(tmp_path: Path) -> None:
    job, state = spare_job(tmp_path)
    job.world.at(4, lambda w: w.set_state(RdzvState(round=1, spares=w.state().spares)))  # a restart round opens

    assert job.sup.standby.stand_by(state) is RoundEnd.REJOIN
    assert job.sup.membership.phase is NodePhase.SPARE
    warm = job.world.spares()
    assert len(warm) == NPROC  # kept alive for whatever role this node gets next
    job.sup.standby.drop()  # it got a place in the round: the kept ones go
    assert job.world.spares() == []


def test_a_closed_job_ends_the_standby_and_its_warm_workers(tmp_path: Path) -> None:
    job, state = spare_job(tmp_path)
    job.world.at(4, lambda w: w.set_state(dataclasses.replace(w.state(), closed=True, outcome="succeeded")))

    assert job.sup.standby.stand_by(state) is RoundEnd.DONE
    assert job.world.spares() == []


# -- the whole loop ------------------------------------------------------------------------------
def test_a_restart_rejoins_and_the_next_round_runs_to_the_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One node alone (node rank 0, hosting its stores): a failure no spare takes restarts the job,
    the node joins the next round with new workers, and that round finishes."""
    monkeypatch.setattr(round_master, "host_store", lambda addr, port, timeout: SimpleNamespace(port=29501))
    job = make_job(tmp_path, spares=0)
    job.sup.rdzv.max_nodes = 1
    job.world.set_state(RdzvState())  # nobody joined yet
    job.world.warm_spares = False
    first: list[int] = []
    job.world.at(3, lambda w: first.extend(p.pid for p in w.processes))
    job.world.at(4, fail(1))
    job.world.at(400, finish_all)
    job.world.max_ticks = 600

    job.sup.run()

    state = job.world.state()
    assert (state.closed, state.outcome, state.restarts, state.round) == (True, "succeeded", 1, 1)
    workers = job.sup.membership.current.workers  # type: ignore[union-attr]
    assert not {w.pid for w in workers} & set(first)  # the restart gave every rank a new process
    assert [w.spec.env["MASTER_ADDR"] for w in workers] == ["b.local", "b.local"]
