"""A DDP training script on resilrun's three-call API: init, track, steps.

Every finished step is snapshotted into node memory; after a failure the job resumes from the
newest step all ranks finished, and computes exactly what a failure-free run computes, because
the data of a step is a function of (step, rank) and the random generators are tracked too.

    resilrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_checkpointless.py
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
from torch import nn

import resilrun


def batch_for(step: int, rank: int, batch: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(batch, features, generator=gen)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument(
        "--state-mib", type=float, default=0.0, help="extra tracked state (a running feature table), MiB per rank"
    )
    parser.add_argument("--checksum-file", default="")
    parser.add_argument("--progress", action="store_true", help="rank 0 prints a line for every step")
    args = parser.parse_args()

    job = resilrun.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(args.hidden, 1))
    model = nn.parallel.DistributedDataParallel(model.to(job.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    job.track(model=model, optimizer=opt, scheduler=sched)
    table = torch.zeros(int(args.state_mib * 2**20) // 4, device=job.device)
    if table.numel():
        job.track(table=table)  # large state next to a small model: snapshots cost more than steps

    for step in job.steps(total=args.steps):
        x, y = batch_for(step, job.rank, 32, 32)
        loss = nn.functional.mse_loss(model(x.to(job.device)), y.to(job.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if job.rank == 0 and (args.progress or step % 10 == 0):
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        if table.numel():
            table.mul_(0.5).add_(loss.detach())
        if args.sleep:
            time.sleep(args.sleep)

    digest = hashlib.sha256()
    for tensor in [*model.module.state_dict().values(), *([table] if table.numel() else [])]:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    if job.rank == 0:
        print(f"done: {args.steps} steps on {job.world_size} ranks; params sha256 {digest.hexdigest()}")
        if args.checksum_file:
            with open(args.checksum_file, "w", encoding="utf-8") as handle:
                handle.write(digest.hexdigest())


if __name__ == "__main__":
    main()
