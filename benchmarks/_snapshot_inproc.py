"""Training time blocked per snapshot, in one process: resilrun's commit vs memcpy, torch.save, DCP.

Run by ``snapshot_cost.py`` once per state size (``resilrun.init()`` is once per process). Why in
one process: every method then saves the very same tensors with the same threads, and the
repetitions of all methods are interleaved (the order rotates each round), so load from
other users of this shared machine hits all of them alike.

The resilrun row is the real path: a real ``AgentChannel`` (with ``NodeMemoryTier``, ``NodeTiers``
and ``WorkerControl``) runs in threads of this process, ``resilrun.init()`` connects to it through
the same environment the launcher sets, and each measurement is one ``next()`` of ``job.steps()``,
which is exactly what a training loop waits for between two steps: collect the state dicts,
memcpy them into the free slot, send the commit message. Its parts are timed by wrapping the
job's collect and the channel's post/collect on the instance (nothing in resilrun/ is changed).

Prints one ``BENCH_JSON {...}`` line: seconds per repetition for every method and part.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _snapshot_worker import build_model, hidden_for, state_bytes, train_step

Method = Callable[[], None]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_agent() -> Any:
    """A real agent channel in this process; the environment points ``resilrun.init()`` at it."""
    from resilrun.agent.state.channel import AgentChannel, channel_env
    from resilrun.agent.state.tiers import NodeTiers
    from resilrun.agent.workers.control import WorkerControl
    from resilrun.tiers.memory import NodeMemoryTier

    memory = NodeMemoryTier(f"bench-{uuid.uuid4().hex[:8]}")
    channel = AgentChannel(memory, NodeTiers(memory, None), WorkerControl())
    os.environ.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        **channel_env(channel),
    )
    return memory, channel


def timed(parts: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, appending the seconds of each call to ``parts[name]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            parts[name].append(time.perf_counter() - begin)

    return wrapper


def fsync_tree(path: Path) -> None:
    for item in [path, *path.iterdir()] if path.is_dir() else [path]:
        fd = os.open(item, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_methods(
    model: torch.nn.Module, opt: torch.optim.Optimizer, nbytes: int, workdir: Path, parts: dict[str, list[float]]
) -> dict[str, Method]:
    """The methods under test, each one closure that saves (model, opt) once."""
    import torch.distributed.checkpoint as dcp

    import resilrun

    job = resilrun.init()
    job.track(model=model, optimizer=opt)
    # Instrument this job's commit path on the instance: collect, and the commit message (posted,
    # then its answer collected at the next commit).
    job._collect = timed(parts, "collect", job._collect)  # type: ignore[method-assign]
    client = job._snapshotter.client  # type: ignore[union-attr]  # init() found the agent socket
    client.post = timed(parts, "message", client.post)  # type: ignore[method-assign]
    client.collect = timed(parts, "message", client.collect)  # type: ignore[method-assign]
    steps = job.steps(total=2**62)
    next(steps)  # restore (nothing held) and the first yield: no commit yet
    source = torch.empty(nbytes, dtype=torch.uint8).random_()
    anon = torch.zeros(nbytes, dtype=torch.uint8)  # zeroed: every page faulted in before timing
    from resilrun.snapshot.shm import SharedBuffer

    memfd = SharedBuffer.create(nbytes, "bench-memfd")  # pre-faulted by create(), as the agent does

    def torch_save() -> None:
        path = workdir / "torch_save.pt"
        with open(path, "wb") as handle:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        path.unlink()

    def dcp_save() -> None:
        path = workdir / "dcp"
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path)
        fsync_tree(path)  # FileSystemWriter fsyncs its files already; this adds the directory
        shutil.rmtree(path)

    def memcpy() -> None:
        anon.copy_(source)

    def memcpy_memfd() -> None:
        memfd.tensor[:nbytes].copy_(source)

    def resilrun_commit() -> None:
        next(steps)  # commits the step just "trained", then yields the next one

    return {
        "memcpy": memcpy,
        "memcpy_memfd": memcpy_memfd,
        "resilrun": resilrun_commit,
        "torch_save": torch_save,
        "dcp_save": dcp_save,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state-mib", type=float, default=64.0)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2, help="rounds left out (slot allocation, first writes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (workers under a launcher get 1)")
    parser.add_argument("--dir", default="", help="where torch.save/DCP write (default: a temp dir on disk)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    memory, channel = start_agent()
    workdir = Path(tempfile.mkdtemp(prefix="resilrun-snapbench-", dir=args.dir or None))
    try:
        model = build_model(args.state_mib)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train_step(model, opt, torch.randn(8, hidden_for(args.state_mib)))  # Adam moments exist now
        nbytes = state_bytes(model, opt)
        parts: dict[str, list[float]] = {"collect": [], "message": []}
        methods = make_methods(model, opt, nbytes, workdir, parts)
        times: dict[str, list[float]] = {name: [] for name in methods}
        first: dict[str, list[float]] = {name: [] for name in methods}  # resilrun: allocating the slots
        resilrun_parts: dict[str, list[float]] = {"collect": [], "message": []}
        names = list(methods)
        for rnd in range(args.warmup + args.reps):
            for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                for part in parts.values():
                    part.clear()
                begin = time.perf_counter()
                methods[name]()
                elapsed = time.perf_counter() - begin
                if rnd < args.warmup:
                    first[name].append(elapsed)
                else:
                    times[name].append(elapsed)
                    if name == "resilrun":
                        for part, values in parts.items():
                            resilrun_parts[part].append(sum(values))
        import resilrun

        meta_json = len(json.dumps(resilrun.init()._collect()[1]))  # the values sent with every commit
        result = {
            "state_bytes": nbytes,
            "hidden": hidden_for(args.state_mib),
            "threads": torch.get_num_threads(),
            "times": times,
            "warmup_times": first,
            "parts": resilrun_parts,
            "commit_json_bytes": meta_json,
        }
        print("BENCH_JSON " + json.dumps(result), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        channel.close()
        memory.close()


if __name__ == "__main__":
    main()
