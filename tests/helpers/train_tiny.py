"""A tiny torchrun-style DDP worker for integration tests.

Honours a fault plan given on the command line (rank, step, restart attempt, mode) so that faults
fire only in the attempt that should fail and recovery can be proven. Writes its environment, pid
and the final parameter checksum to files so tests can compare launchers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--fail-attempt", type=int, default=0)
    parser.add_argument("--fail-mode", choices=["raise", "exit", "kill"], default="raise")
    args, unknown = parser.parse_known_args()
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"env_rank{rank}_attempt{attempt}.json").write_text(json.dumps(dict(os.environ)))
    (args.out / f"pid_rank{rank}").write_text(str(os.getpid()))
    if unknown:
        (args.out / f"args_rank{rank}").write_text(json.dumps(unknown))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(args.steps):
        if rank == args.fail_rank and step == args.fail_step and attempt == args.fail_attempt:
            if args.fail_mode == "raise":
                raise RuntimeError(f"injected failure at step {step}")
            if args.fail_mode == "exit":
                sys.exit(7)
            os.kill(os.getpid(), signal.SIGKILL)
        gen = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(4, 8, generator=gen)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        (args.out / f"step_rank{rank}").write_text(str(step))
        if args.sleep:
            time.sleep(args.sleep)
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    (args.out / f"checksum_rank{rank}").write_text(digest.hexdigest())
    print(f"rank {rank} finished attempt {attempt}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
