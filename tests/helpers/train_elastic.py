"""A three-call training script whose world size may change between generations (elastic tests).

Written the way such a script must be: the global batch of step s is a function of s alone, and
each rank takes its rows of it for the current world size, so a resumed run at another world size
trains on the same data. FSDP2 on a named 1-D mesh by default (``--ddp`` for DDP).

Rank 0 appends JSON lines to ``--record``: after every step ``{"step", "world", "digest"}`` of the
whole parameters and optimizer state, and once per generation that resumed ``{"resumed", "world",
"digest"}`` of the state as restored, before anything trains on it: equal digests for the same step
prove a resize lost nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import resilrun


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """Every parameter and its AdamW moments, whole (a collective under FSDP: every rank calls it)."""
    found = hashlib.sha256()
    names = {id(p): name for name, p in model.named_parameters()}
    for name, param in sorted(model.named_parameters()):
        found.update(name.encode())
        found.update(_full(param.detach()).cpu().contiguous().numpy().tobytes())
    moments = sorted((names[id(p)], state) for p, state in opt.state.items())
    for name, state in moments:
        for key in ("exp_avg", "exp_avg_sq"):
            found.update(f"{name}/{key}".encode())
            found.update(_full(state[key]).cpu().contiguous().numpy().tobytes())
    return found.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--record", type=Path, required=True)
    args = parser.parse_args()

    job = resilrun.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 1))
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (job.world_size,), mesh_dim_names=("shard",))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    job.track(model=model, optimizer=opt)

    def record(entry: dict) -> None:
        if job.rank == 0:
            with args.record.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")

    first = True
    for step in job.steps(total=args.steps):
        if first and step > 0:  # the state as restored, before this generation trains on it
            record({"resumed": step - 1, "world": job.world_size, "digest": digest(model, opt)})
        first = False
        batch = torch.randn(12, 16, generator=torch.Generator().manual_seed(step))
        x = batch[job.rank :: job.world_size]  # this rank's rows of the step's global batch
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        record({"step": step, "world": job.world_size, "digest": digest(model, opt)})
        if args.sleep:
            time.sleep(args.sleep)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
