"""A script written the way torchrun users write them: the environment is read before anything else.

``ddp = int(os.environ.get("RANK", -1)) != -1`` decides, at the top, whether the run is distributed;
``LOCAL_RANK`` is read the same way. Only then does the script join the job (``resilrun.init()``
where it had ``init_process_group()``). A process that ran this without the rank it replaces would
take the single-process branch and fail.
"""

from __future__ import annotations

import argparse
import hashlib
import os

ddp = int(os.environ.get("RANK", -1)) != -1
if not ddp:
    raise SystemExit("env_first.py: not started as a distributed worker (RANK is not set)")
LOCAL_RANK = int(os.environ["LOCAL_RANK"])
WORLD_SIZE = int(os.environ["WORLD_SIZE"])

import torch  # noqa: E402 - after the environment, as in the scripts this imitates
from torch import nn  # noqa: E402

import resilrun  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checksum-file", default="")
    args = parser.parse_args()
    job = resilrun.init()
    assert job.world_size == WORLD_SIZE and job.local_rank == LOCAL_RANK, (job.world_size, WORLD_SIZE)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    job.track(model=model, optimizer=opt)
    for step in job.steps(total=args.steps):
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
