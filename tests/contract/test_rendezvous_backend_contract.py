"""The RendezvousBackend contract: every backend passes this suite unchanged.

Parametrised over the in-memory backend, the c10d backend (a real TCPStore hosted on port 0 on
loopback, used through a second, client-side connection as a remote node would) and the etcd backend
(a real single-member etcd on loopback; skipped without the etcd binary, except in CI).
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest

from resilrun.rendezvous.api import RendezvousBackend
from resilrun.rendezvous.memory import MemoryBackend
from tests.contract.conftest import HostedStore


@pytest.fixture
def key() -> str:
    """A fresh key per test, so tests sharing one store never see each other's data."""
    return f"resilrun/v1/test-{uuid.uuid4().hex}/key"


# -- get / set -------------------------------------------------------------------------------------
def test_get_of_a_missing_key_is_none(key: str, backend: RendezvousBackend) -> None:
    assert backend.get(key + "/never-written") is None


def test_set_then_get_returns_the_value(key: str, backend: RendezvousBackend) -> None:
    backend.set(key, b"hello")
    assert backend.get(key) == b"hello"


def test_set_overwrites_the_previous_value(key: str, backend: RendezvousBackend) -> None:
    backend.set(key, b"first")
    backend.set(key, b"second")
    assert backend.get(key) == b"second"


@pytest.mark.parametrize(
    "value",
    [b"", b"v", b"vv", b"\x00", bytes(range(256)), b"\xff\xfe not utf8 \x80", "ünïcödé".encode(), b"x" * 100_000],
    ids=["empty", "frame-byte", "two-frame-bytes", "nul", "all-bytes", "not-utf8", "utf8", "100k"],
)
def test_values_round_trip_as_arbitrary_bytes(key: str, backend: RendezvousBackend, value: bytes) -> None:
    backend.set(key, value)
    assert backend.get(key) == value


def test_an_empty_value_is_distinct_from_a_missing_key(key: str, backend: RendezvousBackend) -> None:
    backend.set(key, b"")
    assert backend.get(key) == b""
    assert backend.get(key + "/other") is None


def test_keys_are_independent(key: str, backend: RendezvousBackend) -> None:
    backend.set(key + "/a", b"1")
    backend.set(key + "/b", b"2")
    assert (backend.get(key + "/a"), backend.get(key + "/b")) == (b"1", b"2")


# -- compare_set -----------------------------------------------------------------------------------
def test_compare_set_with_none_writes_an_absent_key(key: str, backend: RendezvousBackend) -> None:
    assert backend.compare_set(key, None, b"first") is True
    assert backend.get(key) == b"first"


def test_compare_set_with_none_does_not_overwrite_a_present_key(key: str, backend: RendezvousBackend) -> None:
    backend.set(key, b"there")
    assert backend.compare_set(key, None, b"new") is False
    assert backend.get(key) == b"there"


def test_compare_set_with_none_does_not_overwrite_a_present_empty_value(key: str, backend: RendezvousBackend) -> None:
    backend.set(key, b"")
    assert backend.compare_set(key, None, b"new") is False
    assert backend.get(key) == b""


def test_compare_set_with_the_current_value_writes(key: str, backend: RendezvousBackend) -> None:
    backend.set(key, b"old")
    assert backend.compare_set(key, b"old", b"new") is True
    assert backend.get(key) == b"new"


def test_compare_set_with_an_empty_current_value_writes(key: str, backend: RendezvousBackend) -> None:
    backend.set(key, b"")
    assert backend.compare_set(key, b"", b"new") is True
    assert backend.get(key) == b"new"


def test_compare_set_mismatch_returns_false_and_does_not_write(key: str, backend: RendezvousBackend) -> None:
    backend.set(key, b"current")
    assert backend.compare_set(key, b"stale", b"new") is False
    assert backend.get(key) == b"current"


def test_compare_set_with_an_expected_value_on_an_absent_key_does_not_write(
    key: str, backend: RendezvousBackend
) -> None:
    assert backend.compare_set(key, b"stale", b"new") is False
    assert backend.get(key) is None


def test_compare_set_with_an_empty_expected_value_on_an_absent_key_does_not_write(
    key: str,
    backend: RendezvousBackend,
) -> None:
    assert backend.compare_set(key, b"", b"new") is False
    assert backend.get(key) is None


def test_compare_set_mismatch_reports_true_when_the_key_already_holds_desired(
    key: str, backend: RendezvousBackend
) -> None:
    # The contract is "the key holds desired afterwards": a lost race to the same value is a success.
    backend.set(key, b"same")
    assert backend.compare_set(key, b"stale", b"same") is True
    assert backend.get(key) == b"same"


def test_compare_set_on_an_absent_key_with_expected_equal_to_desired_returns_false(
    key: str, backend: RendezvousBackend
) -> None:
    assert backend.compare_set(key, b"x", b"x") is False
    assert backend.get(key) is None


def test_compare_set_chain_applies_each_step_once(key: str, backend: RendezvousBackend) -> None:
    current: bytes | None = None
    for step in range(5):
        desired = f"state-{step}".encode()
        assert backend.compare_set(key, current, desired) is True
        assert backend.compare_set(key, current, b"loser") is False
        current = desired
    assert backend.get(key) == b"state-4"


# -- add -------------------------------------------------------------------------------------------
def test_add_creates_a_counter_at_zero(key: str, backend: RendezvousBackend) -> None:
    assert backend.add(key, 0) == 0
    assert backend.add(key + "/other", 3) == 3


def test_add_accumulates_and_returns_the_new_value(key: str, backend: RendezvousBackend) -> None:
    assert backend.add(key, 1) == 1
    assert backend.add(key, 1) == 2
    assert backend.add(key, 5) == 7
    assert backend.add(key, -2) == 5
    assert backend.add(key, 0) == 5


def test_add_counters_are_independent(key: str, backend: RendezvousBackend) -> None:
    backend.add(key + "/a", 2)
    backend.add(key + "/b", 40)
    assert backend.add(key + "/a", 0) == 2
    assert backend.add(key + "/b", 0) == 40


# -- get_many ----------------------------------------------------------------------------------------
def test_get_many_returns_each_value_in_order_and_none_for_a_missing_key(key: str, backend: RendezvousBackend) -> None:
    backend.set(key + "/a", b"1")
    backend.set(key + "/c", b"")
    assert backend.get_many([key + "/c", key + "/b", key + "/a"]) == [b"", None, b"1"]


def test_get_many_of_no_key_is_empty(backend: RendezvousBackend) -> None:
    assert backend.get_many([]) == []


def test_get_many_of_only_present_keys_returns_them_all(key: str, backend: RendezvousBackend) -> None:
    names = [f"{key}/{i}" for i in range(3)]
    for i, name in enumerate(names):
        backend.set(name, b"v" * i)
    assert backend.get_many(names) == [b"", b"v", b"vv"]


def test_get_many_of_more_keys_than_one_request_holds(key: str, backend: RendezvousBackend) -> None:
    # etcd caps the operations of one transaction (128 by default): a long list is split, not refused.
    names = [f"{key}/{i}" for i in range(300)]
    for name in names[::2]:
        backend.set(name, name.encode())
    assert backend.get_many(names) == [name.encode() if i % 2 == 0 else None for i, name in enumerate(names)]


def test_get_many_sees_a_key_written_by_another_client(connect: Any, key: str) -> None:
    writer, reader = connect(), connect()
    assert reader.get_many([key]) == [None]
    writer.set(key, b"done")
    assert reader.get_many([key, key]) == [b"done", b"done"]


@pytest.mark.parametrize("kind", ["memory", "c10d"])
def test_close_is_safe_to_call(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "memory":
        memory = MemoryBackend()
        memory.close()
        memory.close()  # twice: a second close is a no-op, not an error
        return
    from resilrun.rendezvous.c10d import C10dBackend, connect_store

    # Its own connection, so closing it cannot affect the store the other tests share.
    hosted: HostedStore = request.getfixturevalue("hosted_store")
    own = C10dBackend(connect_store("127.0.0.1", hosted.port, timedelta(seconds=5)), "own")
    own.close()
    own.close()
    key = f"close-{uuid.uuid4().hex[:8]}"
    hosted.client.set(key, b"still served")  # and the store the other clients share still answers
    assert hosted.client.get(key) == b"still served"


# -- concurrency: what the protocol relies on when many agents share one store ----------------------
def test_concurrent_adds_from_many_threads_are_all_counted(key: str, backend: RendezvousBackend) -> None:
    import threading

    threads = [threading.Thread(target=lambda: [backend.add(key, 1) for _ in range(10)]) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert backend.add(key, 0) == 40


def test_concurrent_compare_sets_of_the_same_expected_value_have_one_winner(
    key: str, backend: RendezvousBackend
) -> None:
    import threading

    backend.set(key, b"base")
    wins: list[bytes] = []
    lock = threading.Lock()

    def race(name: bytes) -> None:
        if backend.compare_set(key, b"base", name):
            with lock:
                wins.append(name)

    threads = [threading.Thread(target=race, args=(f"node-{i}".encode(),)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(wins) == 1
    assert backend.get(key) == wins[0]
