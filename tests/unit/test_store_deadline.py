"""A store operation that gets no answer fails after the read timeout instead of hanging the agent.

A TCPStore client's set/get/add have no timeout of their own: with the store host cut off the
network (no FIN, no RST) they block until TCP gives up. Here a fake store blocks the way such a
client does, until the test lets it go.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from resilrun.errors import StoreConnectionError
from resilrun.rendezvous.c10d import C10dBackend


class BlockingStore:
    """``add`` blocks while ``cut`` is set, like a client whose request gets no answer."""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.cut = threading.Event()
        self.healed = threading.Event()

    def add(self, key: str, amount: int) -> int:
        if self.cut.is_set():
            self.healed.wait(30)
        self.counters[key] = self.counters.get(key, 0) + amount
        return self.counters[key]


def test_an_unanswered_operation_fails_after_the_timeout_and_the_next_ones_at_once() -> None:
    store = BlockingStore()
    backend = C10dBackend(store, "h0:29400", timeout=timedelta(seconds=0.3))  # type: ignore[arg-type]
    assert backend.add("k", 1) == 1
    store.cut.set()
    started = time.monotonic()
    with pytest.raises(StoreConnectionError, match=r"rendezvous store at h0:29400 failed: no answer within 0.3 s"):
        backend.add("k", 1)
    assert 0.3 <= time.monotonic() - started < 5
    started = time.monotonic()
    with pytest.raises(StoreConnectionError):  # the stuck call is still out: no second wait behind it
        backend.add("k", 1)
    assert time.monotonic() - started < 0.1
    # The link heals: the stuck call completes, and the store answers again.
    store.cut.clear()
    store.healed.set()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert backend.add("k", 0) == 2
            break
        except StoreConnectionError:
            time.sleep(0.01)
    else:
        pytest.fail("the backend never answered again after the stuck call returned")


def test_a_store_error_still_reads_as_the_stores_failure() -> None:
    class Refusing:
        def add(self, key: str, amount: int) -> int:
            raise RuntimeError("Connection reset by peer")

    backend = C10dBackend(Refusing(), "h0:29400", timeout=timedelta(seconds=5))  # type: ignore[arg-type]
    with pytest.raises(StoreConnectionError, match="rendezvous store at h0:29400 failed: Connection reset by peer"):
        backend.add("k", 1)
