"""Chaos-run worker on resilrun's three-call API: a small DDP model, a step every ``--sleep`` s.

Launched by ``chaos.py`` through resilrun. Rank 0 stamps every finished step (and every entry into
the loop, ``phase first``) in the shared event log, so the harness can time each recovery from
the fault to the next step done; at the end it writes the parameters' SHA-256 (``done``), which
must equal a failure-free run's. Data is a function of (step, rank): see ``_recovery_common``.
"""

from __future__ import annotations

import argparse
import time

import torch
from _recovery_common import EventLog, build_model, checksum, train_step
from torch import nn

import resilrun


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--mib", type=float, default=2.0, help="state per rank: params + AdamW moments, MiB")
    parser.add_argument("--sleep", type=float, default=0.1, help="extra seconds per step")
    parser.add_argument("--events", required=True)
    args = parser.parse_args()
    job = resilrun.init()
    log = EventLog(args.events, job.rank)
    model = build_model(args.mib)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    job.track(model=ddp, optimizer=opt)
    first = True
    for step in job.steps(total=args.steps):
        if first and job.rank == 0:
            log.write("phase", "first")  # after the restore, if there was one
        first = False
        train_step(ddp, opt, step, job.rank)
        if job.rank == 0:
            log.write("step", step)
        if args.sleep:
            time.sleep(args.sleep)
    if job.rank == 0:
        log.write("done", checksum(model))


if __name__ == "__main__":
    main()
