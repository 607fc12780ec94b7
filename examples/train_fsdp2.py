"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on resilrun's three-call API: init, track, steps.

Each rank snapshots only its own shards (the local tensors of its DTensor parameters and optimizer
state), so a snapshot costs 1/world_size of the model per rank and nothing is gathered. After a
failure every rank reloads its shards and the job continues from the newest step all ranks finished.
The shard layout depends on the world size, so a job resumes with the same number of workers.

Runs on CPU with gloo (torch >= 2.6) and on CUDA with NCCL:

    resilrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_fsdp2.py --steps 40
"""

from __future__ import annotations

import argparse
import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import resilrun

try:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
except ImportError as exc:  # torch < 2.6 has FSDP2 only under torch.distributed._composable
    raise SystemExit(f"this example needs torch >= 2.6 for torch.distributed.fsdp.fully_shard ({exc})") from exc


class LocalShards:
    """The sharded training state as plain tensors: what this rank owns, nothing gathered.

    ``job.track`` snapshots plain tensors; FSDP2 keeps parameters and optimizer state as DTensors.
    This adapter hands out their local shards and, on restore, copies shards back into the live
    parameters and rebuilds the optimizer's DTensor state with the parameters' mesh and placements.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        params = {name: _local(p) for name, p in self.model.named_parameters()}
        optim = self.optimizer.state_dict()
        state = {
            index: {key: _local(value) for key, value in per_param.items()}
            for index, per_param in optim["state"].items()
        }
        return {"params": params, "optim": {"state": state, "param_groups": optim["param_groups"]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = list(self.model.parameters())
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                _local(param).copy_(state["params"][name])
        optim_state = {
            index: {key: _like(params[int(index)], value) for key, value in per_param.items()}
            for index, per_param in state["optim"]["state"].items()
        }
        self.optimizer.load_state_dict({"state": optim_state, "param_groups": state["optim"]["param_groups"]})


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _like(param: torch.Tensor, value: Any) -> Any:
    """A DTensor laid out like ``param`` from this rank's shard; scalars such as ``step`` stay plain."""
    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.ndim != param.ndim:
        return value
    return DTensor.from_local(
        value.to(param.device), param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def batch_for(step: int, rank: int, batch: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step is a function of (step, rank): a resumed run sees what a clean run saw."""
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(batch, features, generator=gen)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--checksum-file", default="", help="rank 0 writes the final checksum here")
    args = parser.parse_args()

    job = resilrun.init()
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(32, args.hidden), nn.ReLU()]
    for _ in range(args.layers - 1):
        blocks += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(args.hidden, 1)).to(job.device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)  # one FSDP unit per layer: its all-gather overlaps the previous layer
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    job.track(shards=LocalShards(model, opt))

    for step in job.steps(total=args.steps):
        x, y = batch_for(step, job.rank, 16, 32)
        loss = nn.functional.mse_loss(model(x.to(job.device)), y.to(job.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if job.rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)

    # The checksum covers every rank's shards (gathered into full tensors), so it names the model.
    digest = hashlib.sha256()
    for value in model.state_dict().values():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        digest.update(full.detach().cpu().contiguous().numpy().tobytes())
    if job.rank == 0:
        print(f"done: {args.steps} steps on {job.world_size} ranks; params sha256 {digest.hexdigest()}")
        if args.checksum_file:
            with open(args.checksum_file, "w", encoding="utf-8") as handle:
                handle.write(digest.hexdigest())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
