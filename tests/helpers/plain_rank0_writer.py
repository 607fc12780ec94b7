"""A plain torchrun script (no resilrun API) whose rank 0 writes the job's artifact.

Every process that runs it appends one line to ``--trace`` saying which RANK/WORLD_SIZE it saw
when its first line ran; rank 0 writes ``--out`` at the end, as real scripts write checkpoints.
"""

from __future__ import annotations

import argparse
import os

parser = argparse.ArgumentParser()
parser.add_argument("--trace", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()
with open(args.trace, "a", encoding="utf-8") as handle:
    handle.write(f"pid={os.getpid()} RANK={os.environ.get('RANK')} WORLD_SIZE={os.environ.get('WORLD_SIZE')}\n")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
total = torch.zeros(1)
for _ in range(args.steps):
    value = torch.ones(1)
    dist.all_reduce(value)
    total += value
if dist.get_rank() == 0:
    with open(args.out, "w", encoding="utf-8") as handle:
        handle.write(f"world={dist.get_world_size()} total={int(total.item())}\n")
dist.destroy_process_group()
