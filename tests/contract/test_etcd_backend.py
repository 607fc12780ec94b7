"""What only the etcd backend does: endpoint failover, bounded failure, the job lease."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import pytest

from resilrun.errors import ConfigError, ExitCode, StoreConnectionError
from resilrun.option_values import parse_endpoints
from resilrun.rendezvous.etcd import EtcdBackend, open_etcd
from tests.conftest import free_port


def _key() -> str:
    return f"resilrun/v1/test-{uuid.uuid4().hex}/key"


def test_parse_endpoints_accepts_a_comma_separated_list_with_default_ports() -> None:
    assert parse_endpoints("a:1, b ,[::1]:3") == [("a", 1), ("b", 2379), ("::1", 3)]


def test_parse_endpoints_rejects_a_bad_entry_with_a_usage_error() -> None:
    with pytest.raises(ConfigError):
        parse_endpoints("a:1,b:99999")


def test_a_dead_first_endpoint_fails_over_to_the_next(etcd_server: Any) -> None:
    # Given a list whose first endpoint has nothing listening
    dead = f"127.0.0.1:{free_port()}"
    backend = open_etcd(f"{dead},{etcd_server.endpoint}", timeout=timedelta(seconds=5))
    try:
        key = _key()
        # Then every call still works, served by the live member
        assert backend.compare_set(key, None, b"x") is True
        assert backend.add(key + "/n", 2) == 2
        assert backend.get(key) == b"x"
    finally:
        backend.close()


def test_unreachable_etcd_raises_store_connection_error_with_a_hint_within_the_timeout() -> None:
    endpoints = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(StoreConnectionError) as info:
        open_etcd(endpoints, timeout=timedelta(seconds=1))
    assert time.monotonic() - started < 5
    assert "could not reach etcd at 127.0.0.1:" in info.value.message
    assert info.value.hint and "--rdzv-endpoint" in info.value.hint
    assert info.value.exit_code == ExitCode.RENDEZVOUS
    assert info.value.__cause__ is not None


def test_a_call_after_etcd_is_gone_raises_store_connection_error(tmp_path: Any) -> None:
    from tests.conftest import _require_etcd
    from tests.etcd_server import EtcdCluster

    _require_etcd()
    cluster = EtcdCluster(tmp_path / "etcd").start()
    backend = EtcdBackend(parse_endpoints(cluster.endpoint), timeout=timedelta(seconds=1))
    backend.set(_key(), b"v")
    cluster.stop()
    started = time.monotonic()
    with pytest.raises(StoreConnectionError) as info:
        backend.add(_key(), 1)
    assert time.monotonic() - started < 5
    assert "did not answer within 1 s" in info.value.message
    backend.close()


def test_job_keys_are_attached_to_one_shared_lease_and_vanish_after_it(etcd_server: Any) -> None:
    # Given two agents of one job attaching to the job lease
    lease_key = _key() + "/lease"
    one = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    two = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    try:
        lease = one.attach_job_lease(lease_key, ttl_s=2)
        assert two.attach_job_lease(lease_key, ttl_s=2) == lease
        key = _key()
        two.set(key, b"job data")
        assert one.add(key + "/n", 1) == 1
    finally:
        one.close()
        two.close()
    # When no agent refreshes it any more, etcd deletes the job's keys after the TTL
    reader = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    deadline = time.monotonic() + 15
    while reader.get(key) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert reader.get(key) is None
    assert reader.get(lease_key) is None
    # And a later job with the same key gets a fresh lease
    assert reader.attach_job_lease(lease_key, ttl_s=2) != lease
    reader.close()
