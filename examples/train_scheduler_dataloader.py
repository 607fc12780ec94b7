"""A DDP script with an LR schedule and a DataLoader whose order depends on the step (three-call API).

Two things usually break a resumed run, and this script shows how each survives a failure:

* **The learning-rate schedule** (linear warm-up, then cosine decay) is an object with
  ``state_dict()``; ``job.track(scheduler=...)`` snapshots it with the model and optimizer, so a
  resumed run continues at the same learning rate instead of warming up again.
* **The data order** comes from ``StepBatchSampler``: the batch of step ``s`` is a pure function of
  (seed, s, rank) (a permutation per epoch, seeded by the epoch), so resuming at step ``s`` needs no
  sampler state at all: the loader restarts at ``s`` and yields exactly the batches a failure-free
  run would have seen. No sample is skipped or seen twice in an epoch.

    resilrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_scheduler_dataloader.py
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import resilrun


class StepBatchSampler(Sampler[list[int]]):
    """Yields this rank's batch for ``start_step``, ``start_step + 1``, ... (one batch per step).

    Each epoch is a fresh permutation of the dataset seeded by ``(seed, epoch)``; step ``s`` takes the
    ``s``-th slice of ``world_size * batch_size`` indices and this rank takes every ``world_size``-th
    of those. The order is therefore a function of the step, and resuming means setting ``start_step``.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int = 0) -> None:
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.steps_per_epoch = num_samples // (batch_size * world_size)  # the ragged tail is dropped
        if self.steps_per_epoch < 1:
            raise ValueError(f"{num_samples} samples cannot fill one step of {batch_size} x {world_size}")
        self.start_step = 0

    def batch_for(self, step: int) -> list[int]:
        epoch, position = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch))
        span = self.batch_size * self.world_size
        return order[position * span : (position + 1) * span][self.rank :: self.world_size].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for step in itertools.count(self.start_step):
            yield self.batch_for(step)


def make_dataset(num_samples: int, features: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(num_samples, features, generator=gen)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).tanh())


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=warmup)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total - warmup), eta_min=1e-5)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warm, decay], milestones=[warmup])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--checksum-file", default="", help="rank 0 writes the final checksum here")
    args = parser.parse_args()

    job = resilrun.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    model = nn.parallel.DistributedDataParallel(model.to(job.device))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = warmup_cosine(opt, args.warmup, args.steps)
    job.track(model=model, optimizer=opt, scheduler=sched)

    sampler = StepBatchSampler(args.samples, args.batch, job.rank, job.world_size, seed=7)
    loader = DataLoader(make_dataset(args.samples, 32), batch_sampler=sampler)
    batches: Iterator[list[torch.Tensor]] | None = None
    for step in job.steps(total=args.steps):
        if batches is None:  # the first step after a (re)start: the loader begins at that step
            sampler.start_step = step
            batches = iter(loader)
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x.to(job.device)), y.to(job.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if job.rank == 0 and step % 10 == 0:
            epoch = step // sampler.steps_per_epoch
            lr = sched.get_last_lr()[0]
            print(f"step {step} epoch {epoch} lr {lr:.6f} loss {loss.item():.5f}", flush=True)

    digest = hashlib.sha256()
    for tensor in model.module.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    lr = sched.get_last_lr()[0]
    if job.rank == 0:
        print(f"done: {args.steps} steps on {job.world_size} ranks; lr {lr:.6f}; params sha256 {digest.hexdigest()}")
        if args.checksum_file:
            with open(args.checksum_file, "w", encoding="utf-8") as handle:
                handle.write(digest.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
