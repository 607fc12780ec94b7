"""An unmodified torchrun-style DDP training script (CPU/gloo here, CUDA/NCCL where available).

It uses only what torchrun gives every worker (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT via
``init_process_group()``), so the same file runs under ``torchrun`` and ``resilrun``. Data is a
function of (step, rank), so any launcher computes the same parameters; rank 0 prints a checksum
of the final parameters for comparisons.

    resilrun --standalone --nproc-per-node 2 examples/train_ddp_torchrun.py --steps 30
    torchrun --standalone --nproc-per-node 2 examples/train_ddp_torchrun.py --steps 30
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (for fault tests)")
    parser.add_argument("--checksum-file", default="", help="rank 0 writes the final checksum here")
    return parser.parse_args()


def batch_for(step: int, rank: int, batch: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(batch, features, generator=gen)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    start = time.monotonic()
    for step in range(args.steps):
        x, y = batch_for(step, rank, args.batch, 32)
        loss = nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        if args.sleep:
            time.sleep(args.sleep)
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    if rank == 0:
        elapsed = time.monotonic() - start
        print(f"done: {args.steps} steps on {world} ranks in {elapsed:.2f} s; params sha256 {digest.hexdigest()}")
        if args.checksum_file:
            with open(args.checksum_file, "w", encoding="utf-8") as handle:
                handle.write(digest.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
