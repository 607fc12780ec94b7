"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on resilrun's three-call API: init, track, steps.

The model and optimizer are tracked as they are: resilrun sees their DTensors and each rank
snapshots only its own shards (the local tensors of its parameters and optimizer state, with where
they sit), so a snapshot costs 1/world_size of the model per rank and nothing is gathered. After a
failure every rank gets its shards back in place and the job continues from the newest step all
ranks finished. ``--replicate R`` trains HSDP instead: a 2-D mesh of R replicas of a model sharded
over world_size / R ranks. ``--tp T`` adds tensor parallelism: the first two linear layers split
over T ranks (column-wise, then row-wise), FSDP over the other mesh dimension (none when T is the
world size); their DTensors are tracked as they are too.

Elastic (``--nnodes MIN:MAX``): a job that loses a node without a spare node goes on at the smaller
world size from the newest step every rank finished, each rank rebuilding its shards from the old
ones (and grows again when a node joins). What the script does for that: the mesh dimensions are
named (they find the saved mesh at the new size), and each step's global batch depends on the step
alone, each rank taking its rows for the current world size (``batch_for``).

Runs on CPU with gloo (torch >= 2.6) and on CUDA with NCCL:

    resilrun --standalone --nproc-per-node 2 --spares 1 examples/train_fsdp2.py --steps 40
    resilrun --standalone --nproc-per-node 4 --spares 1 examples/train_fsdp2.py --replicate 2
    resilrun --standalone --nproc-per-node 2 --spares 1 examples/train_fsdp2.py --tp 2
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn

import resilrun

try:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
except ImportError as exc:  # torch < 2.6 has FSDP2 only under torch.distributed._composable
    raise SystemExit(f"this example needs torch >= 2.6 for torch.distributed.fsdp.fully_shard ({exc})") from exc


def batch_for(step: int, rank: int, world_size: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step ``step``'s global batch.

    The global batch is a function of the step alone, and each rank takes its rows for the current
    world size: a resumed run sees what a clean run saw, and an elastic job that resumes at another
    world size (a node lost without a spare, or one more joining) trains on the same data.
    """
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, features, generator=gen)[rank::world_size]
    return x, x.sum(dim=1, keepdim=True).tanh()


# Rows per step across all ranks: divisible by every world size the job may run at.
GLOBAL_BATCH = 48


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--replicate", type=int, default=1, help="HSDP: replicas of the sharded model (1: FSDP)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of the first two layers")
    parser.add_argument("--checksum-file", default="", help="rank 0 writes the final checksum here")
    args = parser.parse_args()

    job = resilrun.init()
    if job.world_size % (args.replicate * args.tp):
        raise SystemExit(f"--replicate {args.replicate} x --tp {args.tp} does not divide world size {job.world_size}")
    if args.tp > 1 and (args.replicate > 1 or args.layers < 2):
        raise SystemExit("--tp needs --replicate 1 and --layers >= 2")
    if args.tp > 1:  # FSDP over "shard" (of size 1 when T is the world size), TP over "tp"
        shape = (job.world_size // args.tp, args.tp)
        mesh = init_device_mesh(job.device.type, shape, mesh_dim_names=("shard", "tp"))
    elif args.replicate == 1:  # FSDP: one dimension, every rank holds a shard
        mesh = init_device_mesh(job.device.type, (job.world_size,), mesh_dim_names=("shard",))
    else:  # HSDP: shards within a replica, gradients all-reduced across replicas
        shape = (args.replicate, job.world_size // args.replicate)
        mesh = init_device_mesh(job.device.type, shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    blocks: list[nn.Module] = [nn.Linear(32, args.hidden), nn.ReLU()]
    for _ in range(args.layers - 1):
        blocks += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(args.hidden, 1)).to(job.device)
    if args.tp > 1:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = mesh["shard"]
    if mesh.size() > 1:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)  # one FSDP unit per layer: its all-gather overlaps the previous
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    job.track(model=model, optimizer=opt)

    # Tensor-parallel ranks (consecutive ranks, the mesh's last dimension) see the same rows.
    data_rank, data_ranks = job.rank // args.tp, job.world_size // args.tp
    for step in job.steps(total=args.steps):
        x, y = batch_for(step, data_rank, data_ranks, 32)
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
