"""The agent loop of one node: join a round, run the workers, observe, decide, apply.

Invariants: the decision of every tick comes from ``policy.decide`` (pure); this module only does
I/O. Workers of a round never outlive it (``_run_round`` stops them on every exit path). Job-wide
decisions (restart, close) are compare-and-set writes to the rendezvous state, so exactly one node's
decision wins and every node follows it.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

from resilrun import keys
from resilrun.agent import procs
from resilrun.agent.failures import ProcessFailure, collect_failure, format_report, root_cause
from resilrun.agent.heartbeat import StalenessJudge
from resilrun.agent.heartbeat import read_counters as heartbeat_reader
from resilrun.agent.policy import Action, AgentView, decide
from resilrun.config import Config, Std, resolve_std
from resilrun.env import WorkerEnv, omp_threads_default, python_exec
from resilrun.errors import RendezvousClosedError, ShutdownRequested, WorkerGroupFailed
from resilrun.rendezvous.c10d import host_store
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.protocol import RdzvState

logger = logging.getLogger(__name__)


class SignalFlag:
    """Set by signal handlers (which must do nothing else); read by the loop."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    def raise_if_set(self) -> None:
        if self.signum is not None:
            raise ShutdownRequested(self.signum)


class _RoundEnd(Enum):
    DONE = "done"
    REJOIN = "rejoin"


@dataclass(frozen=True, slots=True)
class NodeSetup:
    """Facts resolved once per agent before the first round."""

    nproc: int
    addr: str
    log_root: Path
    base_env: dict[str, str]
    agent_socket: str = ""


class Supervisor:
    """Runs the node's share of the job until it succeeds, fails for good, or is stopped."""

    def __init__(self, config: Config, setup: NodeSetup, rdzv: RendezvousClient, signals: SignalFlag) -> None:
        self.config = config
        self.setup = setup
        self.rdzv = rdzv
        self.signals = signals
        self.run_id = rdzv.run_id
        self.last_state: RdzvState | None = None

    # -- main loop ------------------------------------------------------------------------------
    def run(self) -> None:
        """Returns when the job succeeded.

        Raises:
            WorkerGroupFailed: the restart budget is spent; carries the root-cause report.
            ShutdownRequested: SIGTERM/SIGINT; workers were stopped and the job closed.
            RendezvousError: the store failed, the join timed out, or another node stopped the job.
        """
        while True:
            state = self.rdzv.join(on_wait=self.signals.raise_if_set)
            self.last_state = state
            node_rank = state.node_rank(self.rdzv.me.node_id)
            self.rdzv.me = replace(self.rdzv.me, preferred_rank=node_rank)
            if self._run_round(state) is _RoundEnd.DONE:
                return

    def _run_round(self, state: RdzvState) -> _RoundEnd:
        node_rank = state.node_rank(self.rdzv.me.node_id)
        if node_rank is None:  # cannot happen after a successful join
            return _RoundEnd.REJOIN
        worker_store, master = self._round_master(state, node_rank)
        if master is None:
            return _RoundEnd.REJOIN
        specs = self._worker_specs(state, node_rank, master)
        world = sum(p.local_world_size for p in state.participants)
        logger.info(
            "round %d formed: %d node(s), world size %d, this node rank %d runs ranks %d-%d (restart %d/%d)",
            state.round,
            len(state.participants),
            world,
            node_rank,
            specs[0].global_rank,
            specs[-1].global_rank,
            state.restarts,
            self.config.max_restarts,
        )
        workers = [procs.spawn(spec) for spec in specs]
        try:
            return self._monitor(state, node_rank, workers)
        finally:
            procs.stop([w for w in workers if w.poll() is None], signal.SIGKILL, 0.0)
            for worker in workers:
                worker.finish_output()
            del worker_store

    def _monitor(self, state: RdzvState, node_rank: int, workers: list[procs.WorkerProcess]) -> _RoundEnd:
        interval = self.config.monitor_interval_s
        grace = self.config.shutdown_timeout_s
        others = [p.node_id for p in state.participants if p.node_id != self.rdzv.me.node_id]
        judge = StalenessJudge(self.config.heartbeat_timeout_s)
        read_counters = heartbeat_reader(self.rdzv.backend, self.run_id, others)
        next_heartbeat_check = 0.0
        lost: tuple[str, ...] = ()
        while True:
            time.sleep(interval)
            codes = tuple(w.poll() for w in workers)
            current = self.rdzv.state()
            if others and time.monotonic() >= next_heartbeat_check:
                for node, counter in read_counters().items():
                    judge.observe(node, counter)
                lost = tuple(judge.stale())
                next_heartbeat_check = time.monotonic() + self.config.heartbeat_interval_s
            action = decide(AgentView(state.round, codes, current, self.signals.signum, lost))
            if action is Action.WAIT:
                continue
            if action is Action.SHUTDOWN:
                signum = self.signals.signum or signal.SIGTERM
                logger.warning("received %s: stopping workers (grace %.0f s)", signal.Signals(signum).name, grace)
                procs.stop(workers, signum, grace)
                self.rdzv.close("stopped", {"message": f"node {node_rank} received {signal.Signals(signum).name}"})
                self.rdzv.ack_closed()
                raise ShutdownRequested(signum)
            if action is Action.CLOSED:
                procs.stop(workers, signal.SIGTERM, grace)
                return self._follow_close(current)
            if action is Action.REJOIN:
                logger.warning("round %d ended by another node: stopping workers to rejoin", state.round)
                procs.stop(workers, signal.SIGTERM, grace)
                return _RoundEnd.REJOIN
            if action is Action.NODE_LOST:
                return self._node_lost(state, lost, judge, workers)
            if action is Action.RESTART_JOB:
                return self._restart_job(state, node_rank, workers)
            if action is Action.FINISH:
                return self._exit_barrier(state)
            if action is Action.OPEN_ROUND:
                logger.info("a node is waiting to join: opening round %d", state.round + 1)
                self.rdzv.next_round(state.round, failure=None, max_restarts=self.config.max_restarts)

    # -- actions --------------------------------------------------------------------------------
    def _node_lost(
        self, state: RdzvState, lost: tuple[str, ...], judge: StalenessJudge, workers: list[procs.WorkerProcess]
    ) -> _RoundEnd:
        """Another node stopped heartbeating: its workers are gone or unreachable, so the job restarts."""
        failures = []
        for node_id in lost:
            rank = state.node_rank(node_id)
            node = state.participants[rank] if rank is not None else None
            base = sum(p.local_world_size for p in state.participants[: rank or 0])
            failures.append(
                ProcessFailure(
                    global_rank=base,
                    local_rank=-1,
                    node_rank=rank if rank is not None else -1,
                    host=node.hostname if node else node_id,
                    pid=0,
                    exit_code=0,
                    timestamp=time.time(),
                    message=f"node lost: no heartbeat for {judge.age(node_id) or 0:.1f} s "
                    f"(--heartbeat-timeout {self.config.heartbeat_timeout_s:g})",
                )
            )
        logger.error("%s", "; ".join(f"node {f.node_rank} ({f.host}) {f.message}" for f in failures))
        procs.stop(workers, signal.SIGTERM, self.config.shutdown_timeout_s)
        return self._open_next_round(state, failures)

    def _restart_job(self, state: RdzvState, node_rank: int, workers: list[procs.WorkerProcess]) -> _RoundEnd:
        failed = [w for w in workers if w.poll() not in (None, 0)]
        procs.stop(workers, signal.SIGTERM, self.config.shutdown_timeout_s)
        failures = [
            collect_failure(
                global_rank=w.spec.global_rank,
                local_rank=w.spec.local_rank,
                node_rank=node_rank,
                pid=w.pid,
                exit_code=w.popen.returncode,
                observed_at=w.exit_observed_at or time.time(),
                error_file=w.spec.error_file,
            )
            for w in failed
        ]
        return self._open_next_round(state, failures)

    def _open_next_round(self, state: RdzvState, failures: list[ProcessFailure]) -> _RoundEnd:
        self._record_failures(state.round, failures)
        cause = root_cause(failures)
        if cause is not None and cause.local_rank >= 0:
            logger.error(
                "rank %d failed (%s): stopping the job's workers",
                cause.global_rank,
                cause.message.splitlines()[0] if cause.message else "?",
            )
        new = self.rdzv.next_round(
            state.round, failure=cause.to_dict() if cause else None, max_restarts=self.config.max_restarts
        )
        if new.closed:
            return self._follow_close(new)
        if new.round != state.round:
            logger.warning("restarting the job: restart %d of %d", new.restarts, self.config.max_restarts)
        return _RoundEnd.REJOIN

    def _follow_close(self, state: RdzvState) -> _RoundEnd:
        self.rdzv.ack_closed()
        if state.outcome == "succeeded":
            return _RoundEnd.DONE
        if state.outcome == "failed":
            failures = self._read_failures(state.round)
            if not failures and state.failure:
                failures = [ProcessFailure.from_dict(state.failure)]
            report = format_report("resilrun: the job failed", failures)
            cause = root_cause(failures)
            summary = (
                f"rank {cause.global_rank} on node {cause.node_rank} ({cause.host}) failed: "
                f"{cause.message.splitlines()[0] if cause.message else cause.exit_code}"
                if cause
                else "workers failed"
            )
            raise WorkerGroupFailed(
                f"{summary}; no restart left (--max-restarts {self.config.max_restarts})",
                report=report,
                hint="see the root-cause report above and the per-rank logs under "
                f"{self.setup.log_root}; raise --max-restarts to retry more",
            )
        detail = (state.failure or {}).get("message", "")
        raise RendezvousClosedError(
            f"the job was stopped by another node{': ' + detail if detail else ''}", outcome=state.outcome or "stopped"
        )

    def _exit_barrier(self, state: RdzvState) -> _RoundEnd:
        """Wait until every node's workers finished; nodes finishing early keep the store alive."""
        done = self.rdzv.backend.add(keys.round_done(self.run_id, state.round), 1)
        logger.info("workers finished; waiting for the other nodes (%d/%d done)", done, len(state.participants))
        while True:
            self.signals.raise_if_set()
            current = self.rdzv.state()
            if current.closed:
                return self._follow_close(current)
            if current.round != state.round:
                return _RoundEnd.REJOIN
            if self.rdzv.backend.add(keys.round_done(self.run_id, state.round), 0) >= len(state.participants):
                closed = self.rdzv.close("succeeded")
                return self._follow_close(closed)
            time.sleep(self.config.monitor_interval_s)

    # -- helpers --------------------------------------------------------------------------------
    def _round_master(self, state: RdzvState, node_rank: int) -> tuple[Any, str | None]:
        """The round's worker store: hosted by node rank 0's agent, fresh every round.

        A fresh store per round is what keeps a restarted worker from reading the gloo addresses
        of the previous attempt (torchrun 2.13's stale-store trap).
        """
        key = keys.round_master(self.run_id, state.round)
        if node_rank == 0:
            store = host_store("0.0.0.0", 0, timedelta(seconds=self.rdzv_read_timeout()))
            master = f"{self.setup.addr}:{store.port}"
            self.rdzv.backend.set(key, master.encode())
            return store, master
        deadline = time.monotonic() + self.rdzv.join_timeout.total_seconds()
        while time.monotonic() < deadline:
            self.signals.raise_if_set()
            raw = self.rdzv.backend.get(key)
            if raw is not None:
                return None, raw.decode()
            current = self.rdzv.state()
            if current.closed or current.round != state.round:
                return None, None
            time.sleep(0.02)
        return None, None

    def world_size(self) -> int:
        """World size of the current round (0 before the first)."""
        state = self.last_state
        return sum(p.local_world_size for p in state.participants) if state is not None else 0

    def rdzv_read_timeout(self) -> float:
        return self.config.rdzv.read_timeout_s

    def _worker_specs(self, state: RdzvState, node_rank: int, master: str) -> list[procs.WorkerSpec]:
        cfg = self.config
        master_addr, _, master_port = master.rpartition(":")
        base_rank = sum(p.local_world_size for p in state.participants[:node_rank])
        world = sum(p.local_world_size for p in state.participants)
        nproc = self.setup.nproc
        base_env = {**self.setup.base_env, **omp_threads_default(self.setup.base_env, nproc)}
        if cfg.no_python:
            command: tuple[str, ...] = (cfg.script,)
        else:
            command = (
                python_exec(),
                "-u",
                "-m",
                "resilrun.worker._bootstrap",
                *(("-m",) if cfg.module else ()),
                cfg.script,
            )
        ranks_filter = cfg.ranks_filter
        specs = []
        for local_rank in range(nproc):
            global_rank = base_rank + local_rank
            log_dir = self.setup.log_root / f"round_{state.round}" / f"rank_{global_rank}"
            redirect = resolve_std(cfg.redirects_spec, local_rank)
            tee = resolve_std(cfg.tee_spec, local_rank)
            to_file, to_console = Std(redirect | tee), Std(Std.ALL & ~redirect)
            if ranks_filter is not None and local_rank not in ranks_filter:
                to_file, to_console = Std.ALL, Std.NONE  # hidden from the console, kept in files
            env = WorkerEnv(
                global_rank=global_rank,
                local_rank=local_rank,
                world_size=world,
                local_world_size=nproc,
                node_rank=node_rank,
                num_nodes=len(state.participants),
                role_name=cfg.role,
                role_rank=global_rank,
                role_world_size=world,
                master_addr=master_addr,
                master_port=int(master_port),
                run_id=self.run_id,
                restart_count=state.restarts,
                max_restarts=cfg.max_restarts,
                error_file=str(log_dir / "error.json"),
                round=state.round,
                agent_socket=self.setup.agent_socket,
            ).to_env(base_env)
            specs.append(
                procs.WorkerSpec(
                    local_rank=local_rank,
                    global_rank=global_rank,
                    argv=(*command, *cfg.script_args),
                    env=env,
                    log_dir=log_dir,
                    to_file=to_file,
                    to_console=to_console,
                )
            )
        return specs

    def _record_failures(self, round: int, failures: list[ProcessFailure]) -> None:
        for failure in failures:
            index = self.rdzv.backend.add(keys.round_failure_count(self.run_id, round), 1)
            self.rdzv.backend.set(keys.round_failure(self.run_id, round, index), json.dumps(failure.to_dict()).encode())

    def _read_failures(self, round: int) -> list[ProcessFailure]:
        count = self.rdzv.backend.add(keys.round_failure_count(self.run_id, round), 0)
        failures = []
        for index in range(1, count + 1):
            raw = self.rdzv.backend.get(keys.round_failure(self.run_id, round, index))
            if raw is not None:
                failures.append(ProcessFailure.from_dict(json.loads(raw)))
        return failures
