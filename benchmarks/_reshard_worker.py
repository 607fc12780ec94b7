"""Benchmark worker for ``reshard_restore.py``: one FSDP2 model + AdamW, saved at one world size and
restored at another, by resilrun and by DCP.

Modes (``--mode``):

- ``save`` (under resilrun, ``--checkpoint-uri`` given): trains ``--steps`` steps on the three-call
  API, so the last step is persisted by resilrun, then saves the same state with DCP
  (``get_state_dict`` + ``dcp.save``) into ``--dcp``.
- ``resilrun`` (under resilrun, same ``--checkpoint-uri``, another world size): builds the model and
  optimizer, and times ``job.steps()`` up to its first step: the plan and the resharded restore.
- ``dcp`` (under torchrun, same world size as ``resilrun``): builds the same model and optimizer, and
  times ``get_state_dict`` (which initialises AdamW's state, as DCP needs), ``dcp.load`` (its own
  resharding) and ``set_state_dict``: what a user of DCP runs to resume.

Every mode ends with a digest of the whole parameters and AdamW moments (a collective), so the
benchmark checks both restores hold exactly what was saved. Rank 0 prints one ``BENCH_JSON`` line
with the slowest rank's restore seconds (a restore is done when every rank is).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 512  # width of the square Linear layers; the layer count is solved from --mib


def build(mib: float, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """An MLP whose params + AdamW moments are about ``mib`` MiB, each layer FSDP2-sharded on a named
    1-D mesh (the name lets a restore at another world size find the saved mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    layers = max(1, round(mib * 2**20 / (12 * (HIDDEN * HIDDEN + HIDDEN))))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    found = hashlib.sha256()
    names = {id(p): name for name, p in model.named_parameters()}
    for name, param in sorted(model.named_parameters()):
        found.update(name.encode() + param.detach().full_tensor().contiguous().numpy().tobytes())
    for name, state in sorted((names[id(p)], s) for p, s in opt.state.items()):
        for key in ("exp_avg", "exp_avg_sq"):
            found.update(f"{name}/{key}".encode() + state[key].full_tensor().contiguous().numpy().tobytes())
    return found.hexdigest()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> None:
    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(step))[rank::world]
    loss = model(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["save", "resilrun", "dcp"], required=True)
    parser.add_argument("--mib", type=float, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dcp", required=True)
    args = parser.parse_args()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    result: dict[str, Any] = {"mode": args.mode}
    if args.mode == "dcp":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model, opt = build(args.mib, world)
        dist.barrier()
        started = time.perf_counter()
        model_sd, opt_sd = get_state_dict(model, opt)
        dcp.load({"model": model_sd, "optim": opt_sd}, checkpoint_id=args.dcp)
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=opt_sd)
        result["seconds"] = slowest(time.perf_counter() - started)
    else:
        import resilrun

        job = resilrun.init()
        rank, world = job.rank, job.world_size
        model, opt = build(args.mib, world)
        job.track(model=model, optimizer=opt)
        if args.mode == "save":
            for step in job.steps(total=args.steps):
                train_step(model, opt, step, rank, world)
            model_sd, opt_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=args.dcp)
        else:
            dist.barrier()
            started = time.perf_counter()
            steps = job.steps(total=args.steps + 1)
            result["resumed_at"] = next(steps)
            result["seconds"] = slowest(time.perf_counter() - started)
            steps.close()  # nothing trained: the restored state is what the digest reads
    result.update(world=world, digest=digest(model, opt), pid=os.getpid())
    if rank == 0:
        print("BENCH_JSON " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
