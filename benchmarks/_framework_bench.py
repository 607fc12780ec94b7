"""What the framework scripts of benchmarks/framework_overhead.py share: their command line, their
synthetic tokens, the step-end stamps and the one injected kill (the fault is the benchmark's)."""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import IO

import torch
from torch.utils.data import Dataset

VOCAB, CONTEXT = 512, 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-step", type=int, default=-1)
    parser.add_argument("--stamps", default="")
    return parser.parse_args()


class Bench:
    """Stamps each optimizer step's end (rank 0) and SIGKILLs rank --kill-rank as optimizer step
    --kill-step starts, once per job (a marker file remembers it), so the same kill hits every launcher."""

    def __init__(self, cli: argparse.Namespace) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.kill_rank, self.kill_step = cli.kill_rank, cli.kill_step
        self.marker = Path(cli.out) / "killed"
        self.stamps: IO[str] | None = open(cli.stamps, "a") if cli.stamps and self.rank == 0 else None  # noqa: SIM115

    def step_begins(self, done: int) -> None:
        """``done`` optimizer steps are finished; the next one starts."""
        if self.rank == self.kill_rank and done == self.kill_step and not self.marker.exists():
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def step_ended(self, done: int) -> None:
        if self.stamps is not None:
            self.stamps.write(f"{done} {time.time():.6f}\n")
            self.stamps.flush()


class Tokens(Dataset):
    """Fixed synthetic next-token pairs (the same in every run and under every launcher)."""

    def __init__(self, count: int) -> None:
        self.data = torch.randint(0, VOCAB, (count, CONTEXT + 1), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, :-1], self.data[index, 1:]
