"""Recovery-benchmark worker on resilrun's three-call API (``init``, ``track``, ``steps``).

Launched by ``recovery.py`` as ``resilrun --spares 1 ... _recovery_resilrun.py``; the failure is
resilrun's own fault plan (``RESILRUN_FAULTS=kill:rank=1,step=25``), so nothing in the training
loop knows about it. Survivors re-run this file in their own process after a failure (that is
resilrun's in-process recovery), so every stamp below is written again per generation, which is
exactly what the benchmark's timeline wants. A hot spare runs it ahead, up to its DDP (its first
use of the rank), before any failure.
"""

from __future__ import annotations

import time

SCRIPT_START = time.time()  # before heavy imports; on an in-process re-entry they are cached

import os  # noqa: E402 - the stamp above must precede the imports
from typing import Any  # noqa: E402

import torch  # noqa: E402
from _recovery_common import EventLog, build_model, checksum, parse_args, set_up_work, state_mib, train_step  # noqa: E402
from torch import nn  # noqa: E402

import resilrun  # noqa: E402

IMPORTED = time.time()


def stamp_planned_kill(log: EventLog) -> bool:
    """Log ``kill`` right before resilrun's fault injector SIGKILLs this worker.

    Why a wrapper: the fault fires inside ``job.steps()``, between two steps, where the script
    has no hook; stamping at the end of the previous step instead would charge resilrun's
    snapshot commit to its recovery time. Reaches into ``resilrun.worker.job`` (not public API),
    so it degrades to False (the caller then stamps conservatively) if that name moves.
    """
    try:
        import resilrun.worker.job as job_module
    except ImportError:
        return False
    original = getattr(job_module, "fire", None)
    if original is None:
        return False
    if getattr(original, "bench_wrapped", False):  # an in-process re-entry: already wrapped
        return True

    def fire(faults: Any, *, rank: int, step: int, attempt: int) -> None:
        for fault in faults:
            if fault.kind == "kill" and (fault.rank, fault.step, fault.attempt) == (rank, step, attempt):
                log.write("kill", step)
        original(faults, rank=rank, step=step, attempt=attempt)

    fire.bench_wrapped = True  # type: ignore[attr-defined]
    job_module.fire = fire
    return True


def _set_up(mib: float, seconds: float, cpu: bool) -> nn.Module:
    """The script's set-up (``--setup`` seconds, then the model): what a hot spare with a head start
    runs before any rank fails, and, under ``@resilrun.once``, what a survivor's re-run reuses."""
    set_up_work(seconds, cpu)
    return build_model(mib)


# RECOVERY_SETUP_ONCE=0: the set-up is plain code, run again by every survivor (before issue 47).
set_up = resilrun.once(_set_up) if os.environ.get("RECOVERY_SETUP_ONCE", "1") == "1" else _set_up


def main() -> None:
    if os.environ.get("RECOVERY_READ_RANK_FIRST") == "1":
        int(os.environ["RANK"])  # as torchrun scripts do at their top: a spare waits here for its rank
    args = parse_args(__doc__.splitlines()[0])
    spare = os.environ.get("RESILRUN_SPARE") == "1"  # resilrun's own variable: readable before a rank
    job = resilrun.init()
    init_at = time.time()
    model = set_up(args.mib, args.setup, args.setup_cpu)  # needs no rank: a spare runs it ahead of the failure
    ddp = nn.parallel.DistributedDataParallel(model)  # the first use of the rank: a spare waits here
    log = EventLog(args.events, job.rank)
    if not spare:  # a spare's start-up stamps are from long before any failure: meaningless here
        log.write("phase", "start", SCRIPT_START)
        log.write("phase", "imported", IMPORTED)
    log.write("phase", "init", init_at if not spare else None)
    precise = stamp_planned_kill(log) if job.rank == args.kill_rank else True
    if not precise:
        log.write("note", "kill-stamped-at-end-of-previous-step")
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    job.track(model=ddp, optimizer=opt)
    log.write("phase", "ddp")
    if job.rank == 0:
        log.write("config", f"{state_mib(model):.1f}")
    first = True
    for step in job.steps(total=args.steps):
        if first:
            log.write("phase", "first")  # after resilrun restored the snapshot (if any)
            first = False
        train_step(ddp, opt, step, job.rank, args.sleep)
        if job.rank == 0:
            log.write("step", step)
        if not precise and job.rank == args.kill_rank and step == args.kill_step - 1:
            log.write("kill", args.kill_step)  # conservative fallback: before the commit, not at the kill
    if job.rank == 0:
        log.write("done", checksum(model))


if __name__ == "__main__":
    main()
