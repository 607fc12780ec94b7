"""Shared segments: DDP state a peer holds itself is filled from its own node memory instead of
travelling, kept by reference until its slot can be rewritten, and refused across generations."""

from __future__ import annotations

import logging
import threading
import time
import zlib
from datetime import timedelta

import pytest
import torch

from resilrun.errors import CheckpointCorruptError
from resilrun.snapshot.layout import parse_header
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, ReplicationError, fetch
from resilrun.tiers.peer.client import push_view
from resilrun.tiers.peer.refs import LocalReferences
from resilrun.tiers.peer.wire import (
    CHUNK_BYTES,
    Announce,
    Deadline,
    snapshot_bounds,
)
from tests.conftest import make_snapshot, wait_until
from tests.socket.peer.harness import (
    SECRET,
    SHORT,
    authenticated,
    commit_to_memory,
    snapshot,
)

pytestmark = pytest.mark.timeout(30)


def _ddp_snapshot(weight: torch.Tensor, own: int) -> bytes:
    """A rank's snapshot: a DDP-equal ``weight`` and per-rank ``rng`` bytes, in one fixed layout."""
    return make_snapshot({"weight": weight, "rng": torch.full((64,), own, dtype=torch.uint8)})


def _shared_announce(data: bytes, rank: int, step: int, round: int = 0) -> Announce:
    view = memoryview(data)
    layout = parse_header(view, len(view))
    weight = next(e for e in layout.entries if e.name == "weight")
    shared = ((layout.data_start + weight.begin, layout.data_start + weight.end),)
    bounds = snapshot_bounds(view)
    return Announce(rank, step, None, len(data), None, bounds, shared, zlib.crc32(layout.header), round)


def test_a_peer_holding_the_step_itself_fills_the_shared_segments_and_only_own_bytes_travel(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight = torch.randn(CHUNK_BYTES // 4 + 1000, generator=torch.Generator().manual_seed(3))
    commit_to_memory(memory, 1, 5, _ddp_snapshot(weight, own=1), None)  # the receiving node's own rank
    # What rank 0's sender streams: its own rng bytes, and a weight that must NOT arrive: if the
    # shared segment travelled, the replica would hold these zeros instead of the receiver's weight.
    sent = _ddp_snapshot(torch.zeros_like(weight), own=7)
    announce = _shared_announce(sent, 0, 5)

    assert push_view(server.address, SECRET, announce, memoryview(sent), Deadline.total(5))

    expected = _ddp_snapshot(weight, own=7)
    assert store.steps(0) == [5]
    data, _ = fetch(server.address, SECRET, 0, 5, timeout=SHORT)  # verified against the stored crc32s
    assert bytes(data) == expected


def _weight_range(data: bytes) -> slice:
    layout = parse_header(memoryview(data), len(data))
    weight = next(e for e in layout.entries if e.name == "weight")
    return slice(layout.data_start + weight.begin, layout.data_start + weight.end)


def _push_step_5_by_reference(server: ReplicaServer, memory: NodeMemoryTier, seed: int) -> tuple[torch.Tensor, bytes]:
    """This node's rank 1 commits step 5; rank 0's replica of it arrives with the weight shared
    (the sender's zeros there must never be what the replica holds). Returns (weight, sent)."""
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
    commit_to_memory(memory, 1, 5, _ddp_snapshot(weight, own=1), None)
    sent = _ddp_snapshot(torch.zeros_like(weight), own=7)
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 5), memoryview(sent), Deadline.total(5))
    return weight, sent


def test_shared_segments_stay_in_node_memory_until_the_replica_is_read(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight, sent = _push_step_5_by_reference(server, memory, seed=8)
    # The replica refers to rank 1's slot for the weight: nothing was copied into its own slot
    replica = store.replica(0, 5)
    assert replica is not None and replica.local is not None
    opened = store.open(0, 5)
    assert opened is not None and not any(bytes(opened[0][_weight_range(sent)]))
    weight_segment = replica.bounds.index(_weight_range(sent).start)
    assert [i for i, crc in enumerate(replica.crcs) if crc is None] == [weight_segment]
    # Reading it copies the weight in first: the bytes and the crc32s are those of the whole snapshot
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=7)
    assert store.replica(0, 5).local is None  # type: ignore[union-attr]


def test_a_local_commit_copies_referenced_bytes_in_before_their_slot_can_be_rewritten(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight, sent = _push_step_5_by_reference(server, memory, seed=9)
    # When rank 1 commits step 6 (its worker may then rewrite step 5's slot) and no newer replica
    # of rank 0 comes, the replica takes its own copy of the weight
    commit_to_memory(memory, 1, 6, _ddp_snapshot(weight + 1, own=1), None)
    replica = store.replica(0, 5)
    assert replica is not None and replica.local is None and None not in replica.crcs  # checksummed at rest
    # Then rank 1 rewriting that slot (step 7) does not touch the replica
    commit_to_memory(memory, 1, 7, _ddp_snapshot(weight + 2, own=1), None)
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=7)
    # And a bit flipped in the copied-in weight afterwards is caught like any other
    opened = store.open(0, 5)
    assert opened is not None
    opened[0][_weight_range(sent).start + 5] ^= 0xFF
    del opened
    with pytest.raises(CheckpointCorruptError, match="crc32"):
        fetch(server.address, SECRET, 0, 5, timeout=SHORT)


def test_a_newer_replica_arriving_while_the_commit_waits_lets_the_older_one_go(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(10))
    sent = _ddp_snapshot(torch.zeros_like(weight), own=7)
    commit_to_memory(memory, 1, 4, _ddp_snapshot(weight, own=1), None)
    commit_to_memory(memory, 1, 5, _ddp_snapshot(weight, own=1), None)
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 5), memoryview(sent), Deadline.total(5))
    time.sleep(1.0)  # this node's steps are ~1 s apart: a commit may wait up to 0.8 s for a newer replica
    committing = threading.Thread(target=commit_to_memory, args=(memory, 1, 6, _ddp_snapshot(weight + 1, own=1), None))
    started = time.monotonic()
    committing.start()
    committing.join(0.2)  # returns at once if the commit's answer does not wait
    assert committing.is_alive()  # the commit's answer waits for the replica of step 6...
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 6), memoryview(sent), Deadline.total(5))
    committing.join(5)
    # ...which arrives, by reference too: the older replica is dropped instead of copied
    assert time.monotonic() - started < 0.8
    assert store.steps(0) == [6]
    assert bytes(fetch(server.address, SECRET, 0, 6, timeout=SHORT)[0]) == _ddp_snapshot(weight + 1, own=7)


def test_a_push_of_a_released_step_copies_the_shared_bytes(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(11))
    commit_to_memory(memory, 1, 5, _ddp_snapshot(weight, own=1), None)
    commit_to_memory(memory, 1, 6, _ddp_snapshot(weight + 1, own=1), None)  # step 5's slot is released
    sent = _ddp_snapshot(torch.zeros_like(weight), own=7)
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 5), memoryview(sent), Deadline.total(5))
    assert store.replica(0, 5).local is None  # type: ignore[union-attr]
    commit_to_memory(memory, 1, 7, _ddp_snapshot(weight + 2, own=1), None)
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=7)


def test_a_slot_reallocated_lets_the_replicas_referring_to_it_copy_their_bytes_first(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    # Rank 0's replica of step 5 refers to rank 1's slot 1 for the weight
    weight, sent = _push_step_5_by_reference(server, memory, seed=13)
    assert store.replica(0, 5).local is not None  # type: ignore[union-attr]
    # When that slot is given up without a commit releasing it first (a bigger snapshot written
    # whole after a recovery needs a bigger buffer), the replica keeps its bytes
    memory.allocate(1, 1, 2 * len(sent))
    assert memory.read(1, 5) is None
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=7)


def test_a_push_from_a_sender_of_a_superseded_generation_is_refused_and_keeps_the_new_owners_replicas(
    store: ReplicaStore, memory: NodeMemoryTier, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="resilrun.tiers.peer.server")
    # Given a node that follows generation 3, holding the new owner's replica of rank 0 step 7
    generation = 3
    server = ReplicaServer(SECRET, store, memory, io_timeout=timedelta(seconds=5), generation=lambda: generation)

    def push_step(step: int, data: bytes, **fields: int) -> bool:
        announce = Announce(0, step, None, len(data), None, snapshot_bounds(memoryview(data)), **fields)
        return push_view(server.address, SECRET, announce, memoryview(data), Deadline.total(5))

    try:
        fresh = snapshot(70)
        assert push_step(7, fresh, generation=3)
        # When the node that owned rank 0 before (cut off, replaced, back again), which still
        # follows generation 2, pushes its steps, a newer step number among them
        for step in (8, 9, 10):
            with pytest.raises(ReplicationError, match="superseded by generation 3"):
                push_step(step, snapshot(step), generation=2)
        # Then none is kept, the new owner's replica is untouched, and the refusal is said once
        assert store.steps(0) == [7]
        assert bytes(fetch(server.address, SECRET, 0, 7, timeout=SHORT)[0]) == fresh
        said = [r for r in caplog.records if "which follows generation 2" in r.getMessage()]
        assert len([r for r in said if r.levelname == "INFO"]) == 1
        # A survivor's step trained before the recovery counts (it follows the current generation),
        # and so does a push that names no generation (an older sender)
        generation = 4
        assert push_step(11, snapshot(11), round=3, generation=4)
        assert push_step(12, snapshot(12))
        assert store.steps(0) == [12, 11]
    finally:
        server.close()


def test_a_push_still_in_flight_when_its_step_is_released_is_not_published_by_reference(
    memory: NodeMemoryTier, store: ReplicaStore
) -> None:
    refs = LocalReferences(memory, store)
    token = refs.begin(5, 0)
    assert token is not None
    refs.release(5, 0)  # no step interval known yet: no wait, the push is revoked at once
    published: list[bool] = []
    assert not refs.publish(token, lambda: published.append(True)) and not published
    assert refs.begin(5, 0) is None and refs.begin(6, 0) is not None and refs.begin(4, 1) is not None


@pytest.mark.parametrize("local", ["none", "abandoned timeline"])
def test_without_the_same_step_locally_the_peer_takes_every_byte(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier, local: str
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    if local == "abandoned timeline":  # step 5 of generation 1, rolled back since: not the step 5 being sent
        commit_to_memory(memory, 1, 5, _ddp_snapshot(torch.ones_like(weight), own=1), None, round=1)
        commit_to_memory(memory, 1, 6, _ddp_snapshot(torch.ones_like(weight), own=1), None, round=1)
    sent = _ddp_snapshot(weight, own=7)

    announce = _shared_announce(sent, 0, 5, round=2)
    assert push_view(server.address, SECRET, announce, memoryview(sent), Deadline.total(5))

    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == sent


def test_a_peer_behind_the_pushed_step_waits_once_for_it_then_takes_every_byte(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(12))
    commit_to_memory(memory, 1, 3, _ddp_snapshot(weight, own=1), None)  # this node's commit of 5 never comes
    sent = _ddp_snapshot(weight + 1, own=7)
    started = time.monotonic()
    assert push_view(server.address, SECRET, _shared_announce(sent, 0, 5), memoryview(sent), Deadline.total(5))
    # One wait for this node's own step 5 (server._SHARED_WAIT_S), not one per way of holding it
    assert time.monotonic() - started < 1.8
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == sent


def test_a_deduplicated_slot_sends_its_complete_copy_when_the_peer_cannot_fill(
    server: ReplicaServer, store: ReplicaStore
) -> None:
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    slot_bytes = _ddp_snapshot(torch.zeros_like(weight), own=7)  # borrowed weight not in this slot
    complete = _ddp_snapshot(weight, own=7)

    announce = _shared_announce(slot_bytes, 0, 5)
    view = memoryview(slot_bytes)
    assert push_view(server.address, SECRET, announce, view, Deadline.total(5), whole=lambda: memoryview(complete))

    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == complete


@pytest.mark.parametrize("shared", [[[8, 9]], [[0, 10**9]], "x", [[16, 8]]])
def test_shared_ranges_off_segment_bounds_are_refused(server: ReplicaServer, shared: object) -> None:
    data = snapshot(1)
    announce = Announce(0, 1, None, len(data), None, snapshot_bounds(memoryview(data)))
    with authenticated(server) as session:
        deadline = Deadline.total(5)
        session.send({"op": "push", **announce.to_message(), "shared": shared, "layout": 1}, deadline)
        reply = session.recv(deadline)
    assert reply["ok"] is False and "shared" in reply["error"]


def _push_in_thread(server: ReplicaServer, step: int, generation: int, delay_s: float) -> tuple[threading.Thread, list]:
    """A push of rank 0 ``step`` from a sender following ``generation`` that stalls ``delay_s`` after
    its announce was accepted (a sender cut off mid-push); the list gets its outcome."""
    data = snapshot(step)
    announce = Announce(0, step, None, len(data), None, snapshot_bounds(memoryview(data)), generation=generation)
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(
                push_view(server.address, SECRET, announce, memoryview(data), Deadline.total(20), delay_s=delay_s)
            )
        except (ReplicationError, OSError) as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_stalled_push_of_a_superseded_sender_gives_way_to_the_new_owners_push(
    store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    # Given a node following generation 2 that accepted rank 0's push from its owner, whose bytes
    # then stop coming (the owner was cut off mid-push: the connection stays open, silent)
    generation = 2
    server = ReplicaServer(SECRET, store, memory, io_timeout=timedelta(seconds=20), generation=lambda: generation)
    try:
        stale, outcome = _push_in_thread(server, 7, generation=2, delay_s=6)
        wait_until(lambda: any(s.writing for s in store._slots.get(0, [])))
        # When the job moves on to generation 3 and rank 0's new owner pushes its step
        generation = 3
        started = time.monotonic()
        fresh = snapshot(80)
        announce = Announce(0, 8, None, len(fresh), None, snapshot_bounds(memoryview(fresh)), generation=3)
        # Then the new owner's push is taken at once, not refused until the stale one times out,
        assert push_view(server.address, SECRET, announce, memoryview(fresh), Deadline.total(10))
        assert time.monotonic() - started < 3
        # and the stale push is cut off, never published
        stale.join(10)
        assert outcome and outcome[0] is not True, outcome
        assert store.steps(0) == [8]
        assert bytes(fetch(server.address, SECRET, 0, 8, timeout=SHORT)[0]) == fresh
    finally:
        server.close()


def test_a_push_whose_sender_was_superseded_during_the_transfer_is_not_kept(
    store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    # Given a push of rank 0 from its owner, accepted while the node follows the owner's generation (2)
    generation = 2
    server = ReplicaServer(SECRET, store, memory, io_timeout=timedelta(seconds=5), generation=lambda: generation)
    try:
        stale, outcome = _push_in_thread(server, 9, generation=2, delay_s=1.0)
        wait_until(lambda: any(s.writing for s in store._slots.get(0, [])))
        # When the node follows generation 3 before the old owner's bytes have all arrived
        generation = 3
        stale.join(10)
        # Then the replica is not kept: its sender no longer owns the rank
        assert isinstance(outcome[0], ReplicationError) and "superseded by generation 3" in str(outcome[0]), outcome
        assert store.steps(0) == []
    finally:
        server.close()


def test_a_replica_kept_by_reference_is_not_dropped_while_another_rank_holds_no_newer_step(
    server: ReplicaServer, store: ReplicaStore, memory: NodeMemoryTier
) -> None:
    # Given ranks 0 and 2 of another node, both replicated at step 5 by reference to this node's
    # own step 5, and rank 0 already at step 6 while rank 2's step 6 has not arrived (in flight
    # when that node was lost)
    weight = torch.randn(1000, generator=torch.Generator().manual_seed(12))
    commit_to_memory(memory, 1, 5, _ddp_snapshot(weight, own=1), None)
    for rank in (0, 2):
        sent = _ddp_snapshot(torch.zeros_like(weight), own=7 + rank)
        assert push_view(server.address, SECRET, _shared_announce(sent, rank, 5), memoryview(sent), Deadline.total(5))
    whole = _ddp_snapshot(weight + 1, own=7)
    plain = Announce(0, 6, None, len(whole), None, snapshot_bounds(memoryview(whole)))
    assert push_view(server.address, SECRET, plain, memoryview(whole), Deadline.total(5))
    # When this node's rank commits step 6 (its worker may then rewrite step 5's slot)
    commit_to_memory(memory, 1, 6, _ddp_snapshot(weight + 1, own=1), None)
    # Then rank 0's step 5 is kept (its bytes copied in), not dropped for its newer step: step 5 is
    # the only step of both, what a restore of their node needs
    assert store.steps(0) == [6, 5] and store.steps(2) == [5]
    commit_to_memory(memory, 1, 7, _ddp_snapshot(weight + 2, own=1), None)  # step 5's slot rewritten
    assert bytes(fetch(server.address, SECRET, 0, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=7)
    assert bytes(fetch(server.address, SECRET, 2, 5, timeout=SHORT)[0]) == _ddp_snapshot(weight, own=9)
