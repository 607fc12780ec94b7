"""A DDP script whose rank fails with an error of its own that reads like a communication error.

``--fail-rank R --fail-step S``: in the job's first incarnation, rank R raises torch's
DistBackendError with an NCCL-style message (what a rank's own illegal memory access looks like
under NCCL) as step S starts, while its peers wait in that step's all-reduce for it.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
import torch.distributed as dist
from torch import nn

import resilrun


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--checksum-file", default="")
    args = parser.parse_args()
    job = resilrun.init()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    job.track(model=model, optimizer=opt)
    for step in job.steps(total=args.steps):
        if (job.rank, step, os.environ.get("RESILRUN_ATTEMPT")) == (args.fail_rank, args.fail_step, "0"):
            raise dist.DistBackendError(
                "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for "
                "details), NCCL version 2.21.5; Last error: Cuda failure 'an illegal memory access was encountered'"
            )
        gen = torch.Generator().manual_seed(step * 1000 + job.rank)
        x = torch.randn(8, 16, generator=gen)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).tanh())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    digest = hashlib.sha256()
    for tensor in model.module.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    if job.rank == 0 and args.checksum_file:
        with open(args.checksum_file, "w", encoding="utf-8") as handle:
            handle.write(digest.hexdigest())


if __name__ == "__main__":
    main()
