"""Worker failures: what each failed process tells us, the job's record of them, the root-cause report.

A failure record is a small JSON dict so it can travel through the rendezvous store to every node
(``FailureLedger``); the root cause is the earliest failure (by the time the worker raised, or the
agent saw it die).
"""

from __future__ import annotations

import json
import signal
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from resilrun import keys
from resilrun.agent.workers.procs import WorkerState
from resilrun.env import UNHEALTHY_EXIT_CODE
from resilrun.rendezvous.api import RendezvousBackend, read_numbered


@dataclass(frozen=True, slots=True)
class ProcessFailure:
    """One worker that ended with a non-zero exit code or a signal."""

    global_rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    exit_code: int
    timestamp: float
    message: str
    traceback: str | None = None
    error_file: str | None = None

    @property
    def state(self) -> WorkerState:
        """What the exit means (``procs.WorkerState``): a failure, or the state lost or refused."""
        return WorkerState.of(self.exit_code)

    @property
    def signal_name(self) -> str | None:
        if self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessFailure:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


class FailureLedger:
    """A round's failures in the rendezvous store, as every agent of the job sees them.

    Why in the store: the root-cause report names the earliest failure on any node, and an agent
    judging a worker that raised (``worker_verdicts.RaisedVerdict``) asks whether any agent recorded
    a failure in the round first. Each failure is recorded once per agent, however many paths
    describe it (an in-process attempt, then the restart it fell back to).
    """

    def __init__(self, backend: RendezvousBackend, run_id: str) -> None:
        self.backend = backend
        self.run_id = run_id
        self._recorded: set[tuple[int, int, int]] = set()  # (round, rank, pid)

    def record(self, round: int, failures: list[ProcessFailure]) -> list[ProcessFailure]:
        """Store the failures not recorded yet; returns those."""
        new = [f for f in failures if (round, f.global_rank, f.pid) not in self._recorded]
        self._recorded.update((round, f.global_rank, f.pid) for f in new)
        for failure in new:
            index = self.backend.add(keys.round_failure_count(self.run_id, round), 1)
            self.backend.set(keys.round_failure(self.run_id, round, index), json.dumps(failure.to_dict()).encode())
        return new

    def count(self, round: int) -> int:
        """How many failures any agent recorded in ``round`` (one store read)."""
        return self.backend.add(keys.round_failure_count(self.run_id, round), 0)

    def read(self, round: int) -> list[ProcessFailure]:
        """Every failure any agent recorded in ``round``, in the order they were recorded."""
        found = read_numbered(self.backend, lambda i: keys.round_failure(self.run_id, round, i), self.count(round))
        return [ProcessFailure.from_dict(json.loads(raw)) for raw in found]


def collect_failure(
    *, global_rank: int, local_rank: int, node_rank: int, pid: int, exit_code: int, observed_at: float, error_file: Path
) -> ProcessFailure:
    """Build the record of a failed worker, preferring its own error file's account."""
    message, tb, timestamp = _describe_exit(pid, exit_code), None, observed_at
    try:
        data = json.loads(error_file.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            data = {"message": data}
        inner = data.get("message", {})
        if isinstance(inner, dict):
            message = str(inner.get("message", message))
            extra = inner.get("extraInfo")
            extra = extra if isinstance(extra, dict) else {}
            tb = extra.get("py_callstack")
            timestamp = float(extra.get("timestamp", timestamp))
        else:
            message = str(inner)
    except (OSError, ValueError, TypeError):
        pass
    return ProcessFailure(
        global_rank=global_rank,
        local_rank=local_rank,
        node_rank=node_rank,
        host=socket.gethostname(),
        pid=pid,
        exit_code=exit_code,
        timestamp=timestamp,
        message=message,
        traceback=tb,
        error_file=str(error_file) if error_file.exists() else None,
    )


def _describe_exit(pid: int, exit_code: int) -> str:
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"Signal {-exit_code} ({name}) received by PID {pid}"
    if exit_code == UNHEALTHY_EXIT_CODE:
        return (
            f"its device or its first collective failed the check before it took its rank (exit code {exit_code}; "
            "device_unhealthy event)"
        )
    return f"exited with code {exit_code} (no error file: the script failed outside Python, or called sys.exit)"


def root_cause(failures: list[ProcessFailure]) -> ProcessFailure | None:
    return min(failures, key=lambda f: f.timestamp) if failures else None


_STOPPING = (WorkerState.STATE_REFUSED, WorkerState.STATE_LOST)


def ending_cause(failures: list[ProcessFailure]) -> ProcessFailure | None:
    """The failure that says how a failed job ends: the earliest rank that found the state refused
    or lost, if any did, else the root cause.

    Why not always the root cause: a rank that refused a step writes its error and is on its way out
    with the refusal's code when a rank it told exits with that code first and the agent stops the
    rest; the first failure on record is then the refusing rank's own, with the agent's signal as its
    exit code, and the job would end as an ordinary failure instead of a refused (or lost) state."""
    stopping = [f for f in failures if f.state in _STOPPING]
    return root_cause(stopping) or root_cause(failures)


def format_report(title: str, failures: list[ProcessFailure]) -> str:
    """A readable block in the spirit of torchrun's ChildFailedError summary."""
    cause = root_cause(failures)
    if cause is None:
        return f"{title}: no failure record"
    lines = [f"{title}", "Root cause (first observed failure):"]
    lines += _entry(cause)
    others = [f for f in sorted(failures, key=lambda f: f.timestamp) if f is not cause]
    if others:
        lines.append(f"Other failures ({len(others)}):")
        for failure in others:
            lines.append(
                f"  rank {failure.global_rank} (local {failure.local_rank}) on node {failure.node_rank}: "
                f"{failure.message.splitlines()[0] if failure.message else ''}"
            )
    return "\n".join(lines)


def _entry(failure: ProcessFailure) -> list[str]:
    code = f"{failure.exit_code}" + (f" ({failure.signal_name})" if failure.signal_name else "")
    lines = [
        f"  rank:       {failure.global_rank} (local_rank {failure.local_rank}, node_rank {failure.node_rank})",
        f"  host:       {failure.host}",
        f"  exit code:  {code} (pid {failure.pid})",
        f"  message:    {failure.message}",
    ]
    if failure.error_file:
        lines.append(f"  error file: {failure.error_file}")
    if failure.traceback:
        lines.append("  traceback:")
        lines += [f"    {line}" for line in failure.traceback.rstrip().splitlines()]
    return lines
