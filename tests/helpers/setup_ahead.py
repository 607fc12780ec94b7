"""A script with a slow set-up between ``resilrun.init()`` and ``job.track()``, as real ones have
(building a model, loading weights, indexing a dataset), kept in a ``@resilrun.once`` function.

Each run of the set-up appends "PID TIME" to ``--trace``: a hot spare runs it ahead of the failure
(before it has a rank) and a survivor's re-run of the script reuses its first result.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
from torch import nn

import resilrun


@resilrun.once
def build(hidden: int, setup_s: float, trace: str) -> nn.Module:
    with open(trace, "a", encoding="utf-8") as handle:
        handle.write(f"{os.getpid()} {time.time():.3f}\n")
    time.sleep(setup_s)  # stands for the work a real set-up does
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--setup", type=float, default=0.0)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--checksum-file", default="")
    args = parser.parse_args()
    job = resilrun.init()
    model = build(args.hidden, args.setup, args.trace)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    job.track(model=ddp, optimizer=opt)
    for step in job.steps(total=args.steps):
        gen = torch.Generator().manual_seed(step * 1000 + job.rank)
        x = torch.randn(8, 16, generator=gen)
        loss = nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).tanh())
        loss.backward()
        opt.step()
        opt.zero_grad()  # after the step, as many loops do: a re-run must not inherit a partial step's grads
        if job.rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(args.sleep)
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    if job.rank == 0 and args.checksum_file:
        with open(args.checksum_file, "w", encoding="utf-8") as handle:
            handle.write(digest.hexdigest())


if __name__ == "__main__":
    main()
