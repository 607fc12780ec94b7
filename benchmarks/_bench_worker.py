"""Benchmark worker: a plain torchrun-style DDP script that reports *when* things happen.

It is launched unmodified by every launcher under test (``launch_overhead.py``), so it may use
only what torchrun gives a worker (RANK/WORLD_SIZE/MASTER_* via ``init_process_group()``). Rank 0
prints ``BENCH <event> <value>`` lines: wall-clock (``time.time()``) stamps of the start-up phases,
so the parent can split launch overhead into launcher time vs. worker start-up, and the median
per-step time after warm-up as the steady-state figure. Stamps are epoch seconds because the
parent and the workers are different processes on the same host (same clock).
"""

from __future__ import annotations

import time

SCRIPT_START = time.time()  # before any heavy import: when our Python code first ran

import argparse  # noqa: E402 - the stamp above must precede every import
import os  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

TORCH_IMPORTED = time.time()

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    return parser.parse_args()


def process_created() -> float:
    """When the OS created this process, as epoch seconds, to ~10 ms.

    Why not psutil's ``create_time()``: it adds the boot time, which Linux reports in whole
    seconds, so its absolute value can be up to 1 s off. The age from /proc/uptime is not.
    """
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            start_ticks = int(handle.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux: a missing stamp must not fail a run
        return float("nan")


def report(event: str, value: float) -> None:
    """One parseable line on stdout; the launcher forwards rank 0's stdout to the parent."""
    print(f"BENCH {event} {value:.6f}", flush=True)


def main() -> None:
    args = parse_args()
    is_rank0 = os.environ.get("RANK", "0") == "0"
    dist.init_process_group("gloo")
    pg_ready = time.time()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ddp_ready = time.time()
    gen = torch.Generator().manual_seed(dist.get_rank())
    durations: list[float] = []
    for step in range(args.steps):
        begin = time.perf_counter()
        x = torch.randn(args.batch, 64, generator=gen)
        loss = nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).tanh())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        durations.append(time.perf_counter() - begin)
        if step == 0 and is_rank0:
            # Stamp first, print after: printing (the launcher's pipe) is not part of the step.
            first_step, cpu_first_step = time.time(), time.process_time()
            for event, value in (
                ("proc_created", process_created()),
                ("script_start", SCRIPT_START),
                ("torch_imported", TORCH_IMPORTED),
                ("pg_ready", pg_ready),
                ("ddp_ready", ddp_ready),
                ("first_step", first_step),
                ("cpu_first_step", cpu_first_step),  # this process' CPU seconds since it started
            ):
                report(event, value)
    last_step = time.time()
    dist.destroy_process_group()
    if is_rank0:
        steady = durations[args.warmup :] or durations
        report("step_time", statistics.median(steady))
        report("last_step", last_step)
        report("pg_destroyed", time.time())


if __name__ == "__main__":
    main()
