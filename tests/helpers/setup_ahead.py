"""A script with a slow set-up between ``resilrun.init()`` and ``job.track()``, as real ones have
(building a model, loading weights, indexing a dataset, compiling), kept in a ``@resilrun.once``
function.

Each run of the set-up appends "PID TIME" to ``--trace``: a hot spare runs it ahead of the failure
(before it has a rank) and a survivor's re-run of the script reuses its first result. Optional, as
users have them: ``--compile BACKEND`` (``torch.compile`` in the set-up, warmed up there with one
forward so that no rank compiles on the recovery path) and ``--workers N`` (a DataLoader with N
worker processes whose batch for step s depends only on (s, rank), started where the loop begins).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import resilrun


@resilrun.once
def build(hidden: int, setup_s: float, trace: str, compile_backend: str) -> tuple[nn.Module, nn.Module, TensorDataset]:
    """The set-up: the model (and its compiled form) and the dataset; needs no rank."""
    with open(trace, "a", encoding="utf-8") as handle:
        handle.write(f"{os.getpid()} {time.time():.3f}\n")
    time.sleep(setup_s)  # stands for the work a real set-up does
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())
    runs = model
    if compile_backend:
        runs = torch.compile(model, backend=compile_backend)
        with torch.no_grad():
            runs(x[:8])  # compiled now, in the set-up: no rank compiles after a failure
    return model, runs, data


class StepSampler(Sampler[list[int]]):
    """This rank's batch of step ``start``, ``start + 1``, ...: a function of (step, rank) only."""

    def __init__(self, rank: int, world_size: int, start: int) -> None:
        self.rank, self.world_size, self.start = rank, world_size, start

    def __iter__(self) -> Iterator[list[int]]:
        for step in itertools.count(self.start):
            order = torch.randperm(512, generator=torch.Generator().manual_seed(step))
            yield order[: 8 * self.world_size][self.rank :: self.world_size].tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--setup", type=float, default=0.0)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--compile", default="", help="torch.compile backend ('' = not compiled)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--trace", required=True)
    parser.add_argument("--checksum-file", default="")
    args = parser.parse_args()
    job = resilrun.init()
    model, runs, data = build(args.hidden, args.setup, args.trace, args.compile)
    ddp = nn.parallel.DistributedDataParallel(runs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    job.track(model=ddp, optimizer=opt)
    batches: Iterator[list[torch.Tensor]] | None = None
    for step in job.steps(total=args.steps):
        if batches is None:  # the first step of this run: the loader starts at it
            sampler = StepSampler(job.rank, job.world_size, step)
            batches = iter(DataLoader(data, batch_sampler=sampler, num_workers=args.workers))
        x, y = next(batches)
        loss = nn.functional.mse_loss(ddp(x), y)
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
