"""The sealed rendezvous store (rendezvous/sealed.py) and the rendezvous document's replay guard
(rendezvous/executor.py), against a party that can write to the store but lacks the job secret."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from resilrun import keys
from resilrun.rendezvous.executor import RendezvousClient
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState
from resilrun.rendezvous.sealed import MAGIC, SealedBackend, store_key
from tests.unit.test_rendezvous_client import FakeClock, PushingStore, node

KEY = store_key(b"s" * 32)
RUN = "job-1"


def sealed(store: MemoryBackend, key: bytes | None = KEY) -> tuple[SealedBackend, list[str]]:
    forged: list[str] = []
    return SealedBackend(store, key, on_forged=forged.append), forged


def test_values_round_trip_sealed_and_what_the_store_holds_carries_the_mac() -> None:
    store = MemoryBackend()
    backend, forged = sealed(store)
    backend.set("k", b"value")
    assert backend.get("k") == b"value"
    raw = store.get("k")
    assert raw is not None and raw.startswith(MAGIC) and raw.endswith(b"value") and raw != b"value"
    assert forged == [] and backend.refused == 0


def test_a_value_written_without_the_secret_reads_as_absent_is_reported_once_and_is_overwritten() -> None:
    store = MemoryBackend()
    backend, forged = sealed(store)
    store.set("k", b'{"participants": ["attacker"]}')  # the attacker writes the store directly
    assert backend.get("k") is None
    assert backend.get("k") is None
    assert forged == ["k"] and backend.refused == 1  # once per forged value, not per read
    # the next compare-and-set of an absent key replaces the forgery, as it would an absent key
    assert backend.compare_set("k", None, b"mine")
    assert backend.get("k") == b"mine"
    store.set("k", b"another forgery")
    assert backend.get("k") is None and forged == ["k", "k"]


def test_a_pushed_value_is_verified_as_a_read_one_once_per_value() -> None:
    store = PushingStore()
    backend, forged = sealed(store)
    backend.set("k", b"value")
    view = backend.watch_key("k")
    assert view is not None
    # A sealed value pushed opens as read
    seen = view.seen()
    assert seen is not None and seen[0] == b"value"
    # A forgery pushed reads as absent, reported once however often it is looked at
    store.set("k", b"forged")
    for _ in range(3):
        seen = view.seen()
        assert seen is not None and seen[0] is None
    assert forged == ["k"] and backend.refused == 1
    # and a compare-and-set of the absent key replaces it, as after a read
    assert backend.compare_set("k", None, b"mine")
    seen = view.seen()
    assert seen is not None and seen[0] == b"mine"
    # A broken push says so (the caller reads instead)
    store.watches[0].current = False
    assert view.seen() is None


def test_a_sealed_value_moved_to_another_key_or_sealed_under_another_secret_does_not_verify() -> None:
    store = MemoryBackend()
    backend, forged = sealed(store)
    backend.set(keys.node_lost(RUN, "a"), b'{"round": 1}')
    raw = store.get(keys.node_lost(RUN, "a"))
    assert raw is not None
    store.set(keys.node_lost(RUN, "b"), raw)  # "node b is lost", with a valid MAC for another key
    assert backend.get(keys.node_lost(RUN, "b")) is None
    other, _ = sealed(store, store_key(b"t" * 32))
    other.set("x", b"1")
    assert backend.get("x") is None
    assert forged == [keys.node_lost(RUN, "b"), "x"]


def test_the_secret_check_key_is_never_overwritten_and_tells_another_secret_apart() -> None:
    store = MemoryBackend()
    mine, _ = sealed(store)
    theirs, _ = sealed(store, store_key(b"t" * 32))
    assert mine.check_key("check", b"c")
    assert mine.check_key("check", b"c")  # the same secret finds its own seal
    assert not theirs.check_key("check", b"c")
    assert mine.check_key("check", b"c")  # and did not overwrite it


def test_junk_at_the_secret_check_does_not_stop_the_job() -> None:
    # Anyone at the store can write there before the first agent (issue 43, F14): junk is not
    # taken for another secret's seal, it is overwritten
    for junk in (b"junk", MAGIC + b"x" * 60, b""):
        store = MemoryBackend()
        store.set("check", junk)
        mine, _ = sealed(store)
        assert mine.check_key("check", b"c")
        assert mine.check_key("check", b"c")


def test_a_reader_without_the_secret_unwraps_unverified_and_cannot_write() -> None:
    store = MemoryBackend()
    writer, _ = sealed(store)
    writer.set("k", b"v")
    store.set("plain", b"unsealed")
    reader, forged = sealed(store, None)
    assert not reader.verified
    assert reader.get("k") == b"v"
    assert reader.get("plain") is None and forged == ["plain"]  # nothing resilrun wrote looks like that
    with pytest.raises(PermissionError):
        reader.set("k", b"x")


def test_counters_pass_through() -> None:
    store = MemoryBackend()
    backend, _ = sealed(store)
    assert backend.add("c", 2) == 2 and store.add("c", 0) == 2


# -- the rendezvous document ------------------------------------------------------------------------
def _client(backend: SealedBackend, me: NodeInfo) -> RendezvousClient:
    return RendezvousClient(
        backend,
        RUN,
        me,
        min_nodes=2,
        max_nodes=2,
        join_timeout=timedelta(seconds=60),
        last_call_timeout=timedelta(seconds=1),
        clock=FakeClock(),
    )


def _formed(store: MemoryBackend) -> tuple[RendezvousClient, RendezvousClient]:
    a, b = _client(sealed(store)[0], node("a")), _client(sealed(store)[0], node("b"))
    for who in (a, b):
        who._update(lambda s, me=who.me: RdzvState(round=0, complete=False, waiting=(*s.waiting, me.node_id)))
    a._update(lambda s: RdzvState(round=0, complete=True, participants=(node("a"), node("b"))))
    return a, b


def test_every_write_bumps_seq_and_a_replayed_older_document_is_refused_and_put_back() -> None:
    store = MemoryBackend()
    a, b = _formed(store)
    old = store.get(keys.rdzv_state(RUN))  # a valid, sealed document of round 0
    assert old is not None
    newer = a._update(_bump_round)
    assert newer.round == 1 and newer.seq > RdzvState.from_bytes(old[len(MAGIC) + 16 :]).seq
    assert b.state().round == 1
    # When the attacker writes the old document back (its MAC is valid: it is a real one)
    store.set(keys.rdzv_state(RUN), old)
    # Then both nodes refuse it, keep round 1, and the store holds the newest document again
    assert a.state().round == 1 and b.state().round == 1
    assert a.replayed + b.replayed >= 1
    assert RdzvState.from_bytes(sealed(store)[0].get(keys.rdzv_state(RUN))).round == 1


def test_a_document_of_an_earlier_job_under_the_same_id_and_secret_is_refused_whatever_its_seq() -> None:
    # Given an earlier job (same --rdzv-id, same secret: a rerun) that ran further and closed
    earlier = MemoryBackend()
    a, _ = _formed(earlier)
    for _ in range(5):
        a._update(_bump_round)
    a.close("succeeded")
    closed = earlier.get(keys.rdzv_state(RUN))
    assert closed is not None
    # When its sealed "closed, succeeded" is written into the rerun's store (issue 43, F3)
    store = MemoryBackend()
    c, d = _formed(store)
    assert RdzvState.from_bytes(closed[len(MAGIC) + 16 :]).seq > c.state().seq
    store.set(keys.rdzv_state(RUN), closed)
    # Then both nodes refuse it, and the store holds the rerun's document again
    assert not c.state().closed and not d.state().closed
    assert c.replayed + d.replayed >= 1
    again = sealed(store)[0].get(keys.rdzv_state(RUN))
    assert again is not None and not RdzvState.from_bytes(again).closed


def test_a_forged_rendezvous_document_is_replaced_by_the_newest_one_a_node_read() -> None:
    store = MemoryBackend()
    a, _ = _formed(store)
    assert a.state().complete
    forged = RdzvState(round=5, complete=True, participants=(node("attacker"), node("b")), seq=10**6)
    store.set(keys.rdzv_state(RUN), forged.to_bytes())  # no MAC: anyone can write this much
    state = a.state()
    assert state.round == 0 and [p.node_id for p in state.participants] == ["a", "b"]
    again = sealed(store)[0].get(keys.rdzv_state(RUN))
    assert again is not None and RdzvState.from_bytes(again).participants[0].node_id == "a"


def _bump_round(state: RdzvState) -> RdzvState:
    from dataclasses import replace

    return replace(state, round=state.round + 1)


def test_an_arrival_written_without_the_secret_is_never_admitted() -> None:
    """The arrivals lane takes NodeInfos from the store: a party without the secret that writes
    one (and bumps the counter) is passed over, and the real nodes still form their round."""
    store = MemoryBackend()
    index = store.add(keys.rdzv_arrivals(RUN), 1)
    intruder = json.dumps({"node_id": "intruder", "addr": "10.9.9.9", "local_world_size": 8}).encode()
    store.set(keys.rdzv_arrival(RUN, index), intruder)
    a, b = _client(sealed(store)[0], node("a")), _client(sealed(store)[0], node("b"))
    waits: list[RdzvState] = []
    state = a.join(on_wait=lambda: waits.append(b.join()) if not waits else None)
    assert state.complete and sorted(p.node_id for p in state.participants) == ["a", "b"]
    assert waits == [state]
