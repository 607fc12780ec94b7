"""How long a checkpoint save holds up training, against a memcpy of the same bytes (issue 45's
"save stall <= 1.5x a memcpy").

    python benchmarks/save_stall.py [--mib 64] [--repeats 5]

One process, a gloo group of one (DCP plans through collectives even alone), a state of ``--mib``
MiB (a model and its AdamW moments, float32) saved into a temporary folder on this machine's
page cache, five ways, each ``--repeats`` times interleaved (medians, min-max):

- memcpy: every tensor copied into a preallocated twin (the floor any in-memory snapshot pays);
- ``torch.save`` of the state dict (what the tutorial script does, synchronously);
- ``dcp.save`` with DCP's ``FileSystemWriter`` (synchronous);
- ``dcp.save`` with ``resilrun.checkpoint.StorageWriter`` (no fsync: the tiers hold the copies);
- ``dcp.async_save`` with ``resilrun.checkpoint.StorageWriter``: the stall is until it returns
  (the state staged in memory), the rest is written beside training; its completion is timed too.

Outside resilrun the StorageWriter writes the path it is given, so this runs with plain python.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from resilrun.checkpoint import StorageWriter


def _state(mib: int) -> dict[str, torch.Tensor]:
    """Parameters of about mib/3 MiB and AdamW's two moments (each as large): mib in all."""
    width = int((mib * 2**20 / 3 / 4 / 4) ** 0.5)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for index, moments in enumerate(opt.state.values()):
        state[f"opt.{index}.exp_avg"] = moments["exp_avg"]
        state[f"opt.{index}.exp_avg_sq"] = moments["exp_avg_sq"]
    return state


def _timed(action: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="state size, MiB")
    parser.add_argument("--repeats", type=int, default=5, help="saves per way")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    state = _state(args.mib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    twins = {k: torch.empty_like(v) for k, v in state.items()}
    times: dict[str, list[float]] = {}
    # One stager for every save: its staging copies are allocated once and reused (on a GPU it would
    # also pin them); the first save pays the allocation.
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
        )
    )
    with tempfile.TemporaryDirectory(prefix="save-stall-") as root:
        for i in range(args.repeats):
            folder = Path(root) / str(i)
            folder.mkdir()
            spent, _ = _timed(lambda: [twins[k].copy_(v) for k, v in state.items()])
            times.setdefault("memcpy", []).append(spent)
            spent, _ = _timed(lambda: torch.save(state, folder / "snapshot.pt"))  # noqa: B023
            times.setdefault("torch.save", []).append(spent)
            spent, _ = _timed(
                lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder / "fs")))  # noqa: B023
            )
            times.setdefault("dcp.save, FileSystemWriter", []).append(spent)
            spent, _ = _timed(lambda: dcp.save(state, storage_writer=StorageWriter(str(folder / "rs"))))  # noqa: B023
            times.setdefault("dcp.save, resilrun StorageWriter", []).append(spent)
            spent, future = _timed(
                lambda: dcp.async_save(state, storage_writer=StorageWriter(str(folder / "as")))  # noqa: B023
            )
            times.setdefault("dcp.async_save, resilrun StorageWriter (stall)", []).append(spent)
            started = time.perf_counter()
            future.result()  # type: ignore[attr-defined]
            times.setdefault("  ... and its write, after the stall", []).append(time.perf_counter() - started)
            spent, response = _timed(
                lambda: dcp.async_save(
                    state,
                    storage_writer=StorageWriter(str(folder / "ss")),  # noqa: B023
                    async_stager=stager,
                )
            )
            times.setdefault("dcp.async_save, StorageWriter, staging buffers kept (stall)", []).append(spent)
            response.result()  # type: ignore[attr-defined]
    dist.destroy_process_group()
    floor = statistics.median(times["memcpy"])
    print(f"{nbytes / 2**20:.0f} MiB of state, {args.repeats} saves each, {os.cpu_count()} cores, page cache\n")
    print("| save | time (ms), median (min-max) | / memcpy |")
    print("| --- | --- | --- |")
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"{median * 1e3:.1f} ({min(values) * 1e3:.1f}-{max(values) * 1e3:.1f})"
        print(f"| {name} | {spread} | {median / floor:.1f}x |")


if __name__ == "__main__":
    main()
