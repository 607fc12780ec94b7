"""What only the c10d backend does: the TCPStore's lifecycle (connect, a second client of one store)."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest

from resilrun.errors import ExitCode, StoreConnectionError
from resilrun.rendezvous.c10d import C10dBackend, connect_store
from tests.conftest import free_port

# The contract suites' TCPStore (one per module), registered here by its import.
from tests.contract.conftest import HostedStore, hosted_store  # noqa: F401


def test_connect_store_to_a_closed_port_raises_store_connection_error_quickly() -> None:
    port = free_port()  # bound then released: nothing listens there
    start = time.monotonic()
    with pytest.raises(StoreConnectionError) as info:
        connect_store("127.0.0.1", port, timedelta(seconds=1))
    elapsed = time.monotonic() - start
    # torch retries once after a jittered delay, so allow a few timeouts, never minutes.
    assert elapsed < 10
    assert f"127.0.0.1:{port}" in info.value.message
    assert "within 1 s" in info.value.message
    assert info.value.hint and "--rdzv-endpoint" in info.value.hint
    assert info.value.exit_code == ExitCode.RENDEZVOUS
    assert info.value.__cause__ is not None


def test_a_second_client_sees_what_the_first_wrote(request: pytest.FixtureRequest) -> None:
    hosted: HostedStore = request.getfixturevalue("hosted_store")
    key = f"resilrun/v1/test-{uuid.uuid4().hex}/key"
    endpoint = f"127.0.0.1:{hosted.port}"
    other = C10dBackend(connect_store("127.0.0.1", hosted.port, timedelta(seconds=5)), endpoint)
    one = hosted.client
    assert one.compare_set(key, None, b"mine") is True
    assert other.compare_set(key, None, b"theirs") is False
    assert other.get(key) == b"mine"
    assert one.add(key + "/n", 1) == 1
    assert other.add(key + "/n", 1) == 2
