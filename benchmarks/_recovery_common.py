"""What the two recovery-benchmark workers share: model, data, arguments, the event log, checksum.

Why one module: ``recovery.py`` compares launchers, so everything that is not the launcher's own
business (model size, data, what gets logged and when) must be byte-for-byte the same in the
resilrun script and the torchrun script. It imports only torch, so it costs nothing the scripts
would not pay anyway.

Events go to a file (``--events``), one line each, appended with a single ``os.write`` on an
``O_APPEND`` descriptor: lines from several processes never interleave, nothing sits in a buffer
when a worker is SIGKILLed, and the launcher's stdout handling (prefixes, tee) cannot get in the way.
Line format: ``BENCH <event> <rank> <value> <time.time()>``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import time

import torch
from torch import nn

FEATURES = 64
BATCH = 16
# Parameters + AdamW's two moments, all fp32: 12 bytes of state per parameter.
STATE_BYTES_PER_PARAM = 12


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--mib", type=float, default=64.0, help="state per rank: params + AdamW moments, MiB")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--events", required=True, help="event log file (appended)")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=-1, help="-1: no failure")
    parser.add_argument("--ckpt-dir", default="", help="DCP checkpoint directory (torchrun script)")
    parser.add_argument("--save-every", type=int, default=10, help="DCP save after every N completed steps")
    parser.add_argument("--sleep", type=float, default=0.0, help="extra seconds per step (paces a long fault)")
    parser.add_argument("--setup", type=float, default=0.0, help="seconds of set-up before the model is built")
    parser.add_argument("--setup-cpu", action="store_true", help="the set-up computes (one core) instead of sleeping")
    return parser.parse_args()


def set_up_work(seconds: float, cpu: bool) -> None:
    """Stand for a script's set-up: ``seconds`` asleep, or of one core's work (``cpu``), which a spare
    running it beside training competes with the survivors for."""
    if not cpu:
        time.sleep(seconds)
        return
    end = time.thread_time() + seconds
    a = torch.randn(128, 128)
    while time.thread_time() < end:
        a = torch.tanh(a @ a)


def hidden_for(mib: float) -> int:
    """Hidden width of the MLP below whose state (params + 2 moments) is closest to ``mib``."""
    params = mib * 2**20 / STATE_BYTES_PER_PARAM
    # params = h^2 + (2 * FEATURES + 2) * h + FEATURES
    b = 2 * FEATURES + 2
    return max(8, round((-b + math.sqrt(b * b + 4 * (params - FEATURES))) / 2))


def build_model(mib: float) -> nn.Module:
    """A 3-layer MLP; the middle square layer carries almost all the bytes. Seeded: same on every rank."""
    hidden = hidden_for(mib)
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, FEATURES)
    )


def state_mib(model: nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) * STATE_BYTES_PER_PARAM / 2**20


def batch_for(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step is a function of (step, rank): a resumed run sees what a clean run saw."""
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(BATCH, FEATURES, generator=gen)
    return x, x.tanh()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, sleep_s: float = 0.0) -> None:
    x, y = batch_for(step, rank)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if sleep_s:
        time.sleep(sleep_s)
    opt.step()


def checksum(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class EventLog:
    """Appends ``BENCH`` lines to the shared log file; see the module docstring for why a file."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank

    def write(self, event: str, value: object = "-", at: float | None = None) -> None:
        line = f"BENCH {event} {self.rank} {value} {time.time() if at is None else at:.6f}\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
