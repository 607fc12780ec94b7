"""Ranged fetches: a rank resuming at another world size fetches only the rows it needs."""

from __future__ import annotations

import mmap
import time
import uuid

import pytest
import torch

from resilrun.agent.state.replication import PeerTier
from resilrun.errors import CheckpointNotFoundError
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.selection import Selection
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, fetch, push
from resilrun.tiers.peer import server as peer_server
from resilrun.tiers.peer.stream import spans
from tests.conftest import make_snapshot
from tests.socket.peer.harness import (
    SECRET,
    SHORT,
    commit_to_memory,
)

pytestmark = pytest.mark.timeout(30)


def _rows_snapshot(rows: int = 2048, cols: int = 512) -> tuple[bytes, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(rows, cols, generator=generator), torch.randn(rows, generator=generator)
    return make_snapshot({"w": weight, "b": bias}), weight, bias


def _sparse(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


def _tensor_in(buffer: memoryview, name: str) -> torch.Tensor:
    layout = parse_header(buffer, len(buffer))
    entry = next(e for e in layout.entries if e.name == name)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)[layout.data_start + entry.begin : layout.data_start + entry.end]
    return raw.view(torch.float32).view(entry.shape)


@pytest.mark.parametrize("held_as", ["replica", "local"])
def test_a_ranged_fetch_moves_only_the_selected_rows(
    server: ReplicaServer, memory: NodeMemoryTier, held_as: str
) -> None:
    data, weight, bias = _rows_snapshot()
    if held_as == "replica":
        push(server.address, SECRET, 2, 9, 3, data, {"k": 1}, timeout=SHORT)
    else:
        commit_to_memory(memory, 2, 9, data, {"k": 1})
    select = Selection({"w": (100, 164)})
    wanted = select.ranges(parse_header(data, len(data)))

    buffer, values = fetch(server.address, SECRET, 2, 9, SHORT, select=select, into=_sparse)

    assert values == {"k": 1}
    assert torch.equal(_tensor_in(buffer, "w")[100:164], weight[100:164])
    outside = spans(len(data), wanted)
    assert all(not any(buffer[b:e]) for b, e in outside)  # nothing else arrived
    assert sum(e - b for b, e in wanted) < len(data) // 20
    whole, _ = fetch(server.address, SECRET, 2, 9, SHORT, select=Selection(rest=True), into=_sparse)
    assert torch.equal(_tensor_in(whole, "b"), bias) and bytes(whole) == data


def test_a_replica_corrupted_at_rest_is_refused_to_a_ranged_fetch_and_dropped(
    server: ReplicaServer, store: ReplicaStore
) -> None:
    data, _, _ = _rows_snapshot()
    push(server.address, SECRET, 0, 1, None, data, None, timeout=SHORT)
    opened = store.open(0, 1)
    assert opened is not None
    view, _, _ = opened
    layout = parse_header(data, len(data))
    w = next(e for e in layout.entries if e.name == "w")
    view[layout.data_start + w.end - 3] ^= 0xFF  # in a row the fetch does not ask for
    del view, opened

    with pytest.raises(CheckpointNotFoundError, match="corrupt"):
        fetch(server.address, SECRET, 0, 1, SHORT, select=Selection({"w": (0, 4)}), into=_sparse)
    assert store.steps(0) == []


def test_a_peer_sending_other_bytes_than_asked_is_refused(
    server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, _, _ = _rows_snapshot()
    push(server.address, SECRET, 0, 1, None, data, None, timeout=SHORT)
    # A server that honours a different selection than the one asked for (a defect or a lie).
    real = Selection.ranges
    monkeypatch.setattr(
        peer_server,
        "Selection",
        type("Other", (Selection,), {"ranges": lambda self, layout: real(Selection(rest=True), layout)}),
    )

    with pytest.raises(ReplicationError, match="other bytes"):
        fetch(server.address, SECRET, 0, 1, SHORT, select=Selection({"w": (0, 4)}), into=_sparse)


def test_a_node_restoring_a_rank_whose_replica_it_holds_itself_reads_its_own_copy() -> None:
    # A node of a job that shrank after losing a host can be the one holding that host's replica
    # and the one whose new rank needs it (which node takes which node rank depends on join order)
    memories = [NodeMemoryTier(f"self-fetch-{uuid.uuid4().hex[:6]}") for _ in range(2)]
    tiers: list[PeerTier] = []
    peers = lambda me: [t.address for t in tiers if t is not me]  # noqa: E731
    for index, memory in enumerate(memories):
        tier = PeerTier(
            memory, SECRET, "self-fetch", f"node-{index}", "127.0.0.1", targets=list,
            peers=lambda index=index: peers(tiers[index]), world_size=lambda: 3, generation=lambda: -1,
        )  # fmt: skip
        tiers.append(tier)
    try:
        data, weight, _ = _rows_snapshot()
        push(tiers[1].address, SECRET, 1, 4, 3, data, {"world_size": 3}, timeout=SHORT)

        deadline = time.monotonic() + SHORT.total_seconds()
        found = tiers[1].fetch(1, 4, deadline)
        assert found is not None and bytes(found.data) == data
        part = tiers[1].fetch(1, 4, deadline, select=Selection({"w": (0, 2)}), into=_sparse)
        assert part is not None and torch.equal(_tensor_in(part.data, "w")[:2], weight[:2])
    finally:
        for tier in tiers:
            tier.close()
        for memory in memories:
            memory.close()
