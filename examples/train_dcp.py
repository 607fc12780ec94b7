"""A torchrun script that checkpoints itself with ``torch.distributed.checkpoint`` (DCP), the way
torchtitan-style loops do: FSDP2 (or DDP) model and optimizer through ``get_state_dict``, a
``step-N`` folder every few steps, and at start the newest folder with a ``.metadata`` loaded.

Two ways to run it:

- unmodified DCP, its folder captured (``--ckpt-dir`` under ``--capture-dir``)::

    resilrun --standalone --nproc-per-node 2 --capture-dir ckpt examples/train_dcp.py --ckpt-dir ckpt

- with resilrun's DCP writer and reader (``--resilrun-tiers``: the three lines marked below), which
  put the folders under the job's captured folder and skip the fsyncs (the tiers are the copies
  that survive)::

    resilrun --standalone --nproc-per-node 2 --capture-dir /dev/shm/ckpt examples/train_dcp.py --resilrun-tiers

``--async`` saves with ``dcp.async_save`` (training goes on while the files are written). Data is a
function of (step, rank), so a resumed run computes what an uninterrupted one would from the
loaded step on; rank 0 prints a checksum of the final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ckpt-dir", default="ckpt", help="where the step-N folders go (unmodified DCP)")
    parser.add_argument("--resilrun-tiers", action="store_true", help="save and load with resilrun.checkpoint")
    parser.add_argument("--async", dest="use_async", action="store_true", help="dcp.async_save")
    parser.add_argument("--ddp", action="store_true", help="DDP instead of FSDP2")
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (fault tests)")
    parser.add_argument("--log-every", type=int, default=0, help="rank 0 prints every N steps' loss (0: at saves)")
    return parser.parse_args()


def newest_complete(folder: str) -> str | None:
    """The step-N folder with the largest N that has DCP's .metadata (written last)."""
    try:
        names = [p.name for p in Path(folder).iterdir() if (p / ".metadata").is_file()]
    except OSError:
        return None
    steps = [n for n in names if re.fullmatch(r"step-\d+", n)]
    return os.path.join(folder, max(steps, key=lambda n: int(n[5:]))) if steps else None


def checksum(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Of the whole parameters (gathered from their shards), the same at any world size."""
    model_state, _ = get_state_dict(model, optimizer)
    digest = hashlib.sha256()
    for name in sorted(model_state):
        tensor = model_state[name]
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(full.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)).to(device)
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    else:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    start = 0
    if args.resilrun_tiers:
        import resilrun.checkpoint as tiers  # (1) of three lines

        found = tiers.latest()
    else:
        found = newest_complete(args.ckpt_dir)
    if found is not None:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}
        reader = tiers.StorageReader(found) if args.resilrun_tiers else None  # (2)
        dcp.load(state, checkpoint_id=None if reader else found, storage_reader=reader)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"]) + 1
        print(f"[rank {rank}] resumed from {found} at step {start} checksum {checksum(model, optimizer)}", flush=True)

    pending = None
    # async_save's collectives run beside training's: on a group of their own, as torchtitan does
    save_group = dist.new_group(backend="gloo") if args.use_async else None
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, 16, generator=gen).to(device)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).tanh())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if args.sleep:
            time.sleep(args.sleep)
        if rank == 0 and args.log_every and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        if step % args.save_every == args.save_every - 1:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}
            folder = f"step-{step}"
            writer = tiers.StorageWriter(folder) if args.resilrun_tiers else None  # (3)
            target = None if writer else os.path.join(args.ckpt_dir, folder)
            began = time.monotonic()
            if args.use_async:
                if pending is not None:
                    pending.result()
                pending = dcp.async_save(state, checkpoint_id=target, storage_writer=writer, process_group=save_group)
            else:
                dcp.save(state, checkpoint_id=target, storage_writer=writer)
            took = time.monotonic() - began
            summed = checksum(model, optimizer)  # a collective under FSDP2: every rank computes it
            if rank == 0:
                print(
                    f"step {step} loss {loss.item():.5f} saved {folder} in {took:.3f} s checksum {summed}", flush=True
                )
    if pending is not None:
        pending.result()
    print(f"[rank {rank}] finished {args.steps} steps checksum {checksum(model, optimizer)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
