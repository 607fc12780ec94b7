"""Two DDP ranks on one node split the copy of what DDP keeps equal, and lose nothing by it.

Real pieces end to end: two gloo processes on loopback run the three-call API against a real
agent channel and node memory in this process. Each rank copies its share of the parameters and
AdamW moments and borrows the rest; a BatchNorm's buffers (per rank) are always its own. Node
memory must then read out each rank's snapshot complete and equal to that rank's own state, and a
new generation must restore it exactly from node memory.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.state.channel import AgentChannel, channel_env
from resilrun.agent.state.tiers import NodeTiers
from resilrun.agent.workers.control import WorkerControl
from resilrun.snapshot.layout import DTYPES, parse_header
from resilrun.tiers.memory import NodeMemoryTier

STEPS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, env: dict[str, str], out: str, seed: int) -> None:
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    import resilrun

    job = resilrun.init(backend="gloo")
    torch.manual_seed(seed)  # the restoring generation starts from other weights
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
    job.track(model=ddp, opt=opt)
    data = torch.Generator().manual_seed(rank)
    for _ in job.steps(STEPS):
        loss = ddp(torch.randn(8, 16, generator=data)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    tensors, _ = job._collect()
    torch.save({name: t.clone() for name, t in tensors.items() if not name.startswith("_rng")}, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


class _Copies(Telemetry):
    """Records what each commit says it copied (what the memory tier's byte metric counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied: dict[tuple[int, int], int] = {}

    def committed(self, rank: int, step: int, nbytes: int, copy_s: float | None, compute_s: float | None) -> None:
        self.copied[(rank, step)] = nbytes


@pytest.fixture
def agent() -> Iterator[tuple[NodeMemoryTier, dict[str, str], _Copies]]:
    memory = NodeMemoryTier("dedup-contract")
    copies = _Copies()
    channel = AgentChannel(memory, NodeTiers(memory, None), WorkerControl(), copies)
    env = {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "OMP_NUM_THREADS": "1",
        **channel_env(channel),
    }
    try:
        yield memory, env, copies
    finally:
        channel.close()
        memory.close()


def _run(env: dict[str, str], out: Path, seed: int) -> None:
    env = {**env, "MASTER_PORT": str(_free_port())}
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(rank, env, str(out), seed)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0


def _tensors(data: bytes | bytearray) -> dict[str, torch.Tensor]:
    layout = parse_header(memoryview(data), len(data))
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return {
        e.name: raw[layout.data_start + e.begin : layout.data_start + e.end].view(getattr(torch, DTYPES[e.dtype][0]))
        for e in layout.entries
    }


def test_local_ranks_split_the_replicated_state_and_node_memory_holds_every_rank_whole(
    agent: tuple[NodeMemoryTier, dict[str, str], _Copies], tmp_path: Path
) -> None:
    memory, env, telemetry = agent
    _run(env, tmp_path, seed=0)
    borrowed_names: dict[int, set[str]] = {}
    for rank in (0, 1):
        newest = memory.rank(rank).newest()
        assert newest is not None and newest.step == STEPS - 1
        buffer = memory.rank(rank).slots[newest.slot]
        assert buffer is not None
        layout = parse_header(buffer.view(), newest.nbytes)
        start = layout.data_start
        borrowed_names[rank] = {
            e.name
            for e in layout.entries
            if any(b <= start + e.begin and start + e.end <= end for _, b, end in newest.borrowed)
        }
        # The commit reports the bytes the rank copied: all but what it borrowed
        assert telemetry.copied[(rank, STEPS - 1)] == newest.nbytes - sum(e - b for _, b, e in newest.borrowed)
        # Node memory reads the rank out whole, equal to the rank's own state
        assembled = memory.read(rank, STEPS - 1)
        assert assembled is not None
        own = torch.load(tmp_path / f"rank{rank}.pt")
        got = _tensors(assembled[0])
        for name, tensor in own.items():
            assert torch.equal(got[name].view(tensor.shape), tensor), name
    # Every parameter and AdamW state tensor is copied by exactly one rank; buffers by both
    replicated = {name for name in own if "running_" not in name and "num_batches" not in name}
    assert borrowed_names[0] | borrowed_names[1] == replicated
    assert not borrowed_names[0] & borrowed_names[1]
    assert all(("weight" in n or "bias" in n or "/state/" in n) for n in replicated)
    sizes = [sum(own[n].numel() * own[n].element_size() for n in borrowed_names[r]) for r in (0, 1)]
    assert min(sizes) > 0.3 * sum(sizes)  # byte-balanced, not one rank copying everything

    # A new generation (other start weights) restores both ranks exactly from node memory
    saved = {rank: torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)}
    restored = tmp_path / "restored"
    restored.mkdir()
    _run(env, restored, seed=1)
    for rank in (0, 1):
        after = torch.load(restored / f"rank{rank}.pt")
        assert after.keys() == saved[rank].keys()
        for name, tensor in saved[rank].items():
            assert torch.equal(after[name], tensor), f"rank {rank} {name}"
