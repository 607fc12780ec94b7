"""Deterministic fault injection, for tests and for users rehearsing their own jobs.

``RESILRUN_FAULTS`` holds a plan of faults separated by ';', each ``KIND:key=value,...``:

    kill:rank=1,step=12              SIGKILL this worker when step 12 starts
    exit:rank=0,step=3,code=7        exit with code 7
    raise:rank=2,step=5              raise RuntimeError (the error file records it)
    hang:rank=1,step=8               SIGSTOP itself (a hang the agent must detect)
    stall:rank=1,step=0              sleep forever, heartbeats still running (a deadlock in user
                                     code: only the step timeouts catch it)
    kill:rank=0,step=restore,attempt=1   SIGKILL while restoring in attempt 1 (a failure during
                                         a recovery: the others are mid-restore)
    unhealthy:rank=1,round=1         the device check of the process that joins rank 1 in
                                     generation 1 fails (a spare on a device that does not answer)
    isolated:rank=1,round=1          the process that joins rank 1 in generation 1 never completes
                                     its first collective (a spare whose links to the others are down)

``attempt=N`` (default 0) limits a fault to one restart attempt (TORCHELASTIC_RESTART_COUNT), so
the recovered run does not fail again. Faults fire at the start of the step, before its work.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

KINDS = ("kill", "exit", "raise", "hang", "stall", "unhealthy", "isolated")
_JOINING = ("unhealthy", "isolated")  # faults of the process that joins a generation, not of a step
# ``step=restore``: the fault fires while the rank restores a snapshot, after the restore plan was
# agreed with the other ranks and before its state is loaded.
RESTORE_STEP = -1


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int = 0
    code: int = 1
    round: int = 0  # ``unhealthy``, ``isolated``: the generation whose joining process fails its check


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse a plan; raises ValueError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kind, _, rest = part.partition(":")
        kind = kind.strip()
        if kind not in KINDS:
            raise ValueError(f"fault kind {kind!r} in {part!r} is not one of {', '.join(KINDS)}")
        fields: dict[str, int] = {}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            key, sep, value = item.partition("=")
            if key == "step" and value.strip() == "restore":
                value = str(RESTORE_STEP)
            known = ("rank", "step", "attempt", "code", "round")
            if not sep or key not in known or not value.strip().lstrip("-").isdigit():
                raise ValueError(
                    f"fault field {item!r} in {part!r} is not rank|step|attempt|code|round=INT or step=restore"
                )
            fields[key] = int(value)
        when = "round" if kind in _JOINING else "step"
        if "rank" not in fields or when not in fields:
            raise ValueError(f"fault {part!r} needs rank= and {when}=")
        fields.setdefault("step", 0)
        faults.append(Fault(kind=kind, **fields))
    return tuple(faults)


def fire(faults: tuple[Fault, ...], *, rank: int, step: int, attempt: int) -> None:
    """Inject the fault planned for (rank, step, attempt), if any."""
    for fault in faults:
        if fault.kind in _JOINING or (fault.rank, fault.step, fault.attempt) != (rank, step, attempt):
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "exit":
            os._exit(fault.code)
        elif fault.kind == "raise":
            raise RuntimeError(f"injected fault at step {step} on rank {rank}")
        elif fault.kind == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "stall":
            while True:
                time.sleep(3600)


def unhealthy(faults: tuple[Fault, ...], *, rank: int, round: int) -> str:
    """The injected device-check failure for the process joining ``rank`` in generation ``round``
    (the generation names one joining process already: ``attempt`` is not asked)."""
    for fault in faults:
        if fault.kind == "unhealthy" and (fault.rank, fault.round) == (rank, round):
            return f"injected: the device did not answer (unhealthy:rank={rank},round={round})"
    return ""


def isolated(faults: tuple[Fault, ...], *, rank: int, round: int) -> bool:
    """Whether the process joining ``rank`` in generation ``round`` is to hang in its first collective."""
    return any(f.kind == "isolated" and (f.rank, f.round) == (rank, round) for f in faults)
