"""What only the etcd backend does: endpoint failover, bounded failure, the job lease."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import pytest

from resilrun.errors import ConfigError, ExitCode, StoreConnectionError
from resilrun.option_values import parse_endpoints
from resilrun.rendezvous.etcd import EtcdBackend, _b64, open_etcd
from tests.conftest import free_port, wait_until


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
    wait_until(lambda: reader.get(key) is None, timeout=15, what="the job's keys deleted")
    assert reader.get(lease_key) is None
    # And a later job with the same key gets a fresh lease
    assert reader.attach_job_lease(lease_key, ttl_s=2) != lease
    reader.close()


def _counter(watch: Any) -> int | None:
    """A counter as a key watch pushes it (None: the watch is not current)."""
    seen = watch.seen()
    return None if seen is None else int(seen[0] or b"0")


def test_a_watched_counter_follows_every_change_without_a_request_per_check(etcd_server: Any) -> None:
    # Given a counter already at 2 and an agent watching it
    key = _key()
    writer = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    reader = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    writer.add(key, 2)
    posts = 0
    post = reader.post

    def counted(path: str, body: dict[str, Any]) -> dict[str, Any]:
        nonlocal posts
        posts += 1
        return post(path, body)

    reader.post = counted  # type: ignore[method-assign]
    try:
        watch = reader.watch_key(key)
        assert watch is not None
        # Then it reads 2 once the stream is open, and each later change another agent makes
        wait_until(lambda: _counter(watch) == 2, timeout=10)
        for expected in (3, 4, 9):
            writer.add(key, expected - writer.add(key, 0))
            wait_until(lambda expected=expected: _counter(watch) == expected, timeout=10, what=f"counter {expected}")
        # with one request in all (the range it started from), however often it is checked
        for _ in range(200):
            assert _counter(watch) == 9
        assert posts == 1
    finally:
        writer.close()
        reader.close()
    assert _counter(watch) is None  # closed: its stream is gone, so it claims nothing


def test_an_idle_watch_is_reopened_and_misses_no_change(etcd_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given streams re-opened after 0.3 s without an event (a cut connection looks like that)
    monkeypatch.setattr("resilrun.rendezvous.etcd._WATCH_IDLE_S", 0.3)
    key = _key()
    backend = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    opens = 0
    open_stream = backend.open_stream

    def counted(path: str, body: dict[str, Any]) -> tuple[Any, int]:
        nonlocal opens
        opens += 1
        return open_stream(path, body)

    backend.open_stream = counted  # type: ignore[method-assign]
    try:
        backend.add(key, 1)
        watch = backend.watch_key(key)
        assert watch is not None
        wait_until(lambda: _counter(watch) == 1, timeout=10)
        wait_until(lambda: opens >= 3, timeout=10, what="the stream re-opened twice")
        # Then changes made across them are followed
        for expected in (2, 3):
            backend.add(key, 1)
            wait_until(lambda expected=expected: _counter(watch) == expected, timeout=10)
    finally:
        backend.close()


def test_a_watch_whose_etcd_is_gone_claims_no_value(tmp_path: Any) -> None:
    from tests.conftest import _require_etcd
    from tests.etcd_server import EtcdCluster

    _require_etcd()
    cluster = EtcdCluster(tmp_path / "etcd").start()
    backend = EtcdBackend(parse_endpoints(cluster.endpoint), timeout=timedelta(seconds=1))
    failed = 0  # requests that etcd did not answer (the watch's re-opens read the key first)
    post = backend.post

    def counted(path: str, body: dict[str, Any]) -> dict[str, Any]:
        nonlocal failed
        try:
            return post(path, body)
        except Exception:
            failed += 1
            raise

    backend.post = counted  # type: ignore[method-assign]
    try:
        key = _key()
        backend.add(key, 5)
        watch = backend.watch_key(key)
        assert watch is not None
        wait_until(lambda: _counter(watch) == 5, timeout=10)
        # When etcd stops, the watch no longer claims a value: its readers poll, and hear the failure
        cluster.stop()
        wait_until(lambda: _counter(watch) is None, timeout=10)
        # and it claims none after trying to re-open the stream on the etcd that is gone
        tried = failed
        wait_until(lambda: failed > tried, timeout=10, what="a failed re-open")
        assert _counter(watch) is None
    finally:
        backend.close()
        cluster.stop()


def test_a_watch_left_on_a_member_the_requests_moved_away_from_is_reopened_where_they_go(etcd_server: Any) -> None:
    """A member cut off without closing its connections leaves a quiet stream, not a broken one."""
    host, port = etcd_server.endpoint.rsplit(":", 1)
    # Given a backend with two endpoints (one member under two names), its watch open on the first
    backend = open_etcd(f"{host}:{port},localhost:{port}", timeout=timedelta(seconds=5))
    try:
        key = _key()
        backend.add(key, 1)
        watch = backend.watch_key(key)
        assert watch is not None
        wait_until(lambda: _counter(watch) == 1, timeout=10)
        # When the backend's requests fail over to the second endpoint
        with backend._lock:
            backend._current = 1
        # Then the watch claims nothing (its readers poll) until it follows from there
        assert _counter(watch) is None
        wait_until(lambda: _counter(watch) == 1, timeout=10)
        assert watch._watch._index == 1  # type: ignore[attr-defined]
        backend.add(key, 1)
        wait_until(lambda: _counter(watch) == 2, timeout=10)
    finally:
        backend.close()


def test_a_leased_key_lives_while_renewed_goes_after_its_ttl_and_comes_back_when_renewed_again(
    etcd_server: Any,
) -> None:
    key = _key()
    owner = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    watcher = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=5))
    try:
        # Given a key on a 1 s lease (etcd raises it to its minimum) and a watcher of it
        leased = owner.lease_key(key, b"ttl", 1)
        assert leased is not None and leased.ttl_s >= 1
        presence = watcher.watch_presence(key)
        assert presence is not None
        wait_until(lambda: (presence.seen() or (None,))[0] == b"ttl", timeout=10)
        # While it is renewed it stays, with no write to the store (its revision does not move)
        revision = int(owner.post("/kv/range", {"key": _b64(key)})["kvs"][0]["mod_revision"])
        for _ in range(int(3 * leased.ttl_s / 0.5)):
            leased.refresh()
            time.sleep(0.5)
        kv = owner.post("/kv/range", {"key": _b64(key)})["kvs"][0]
        assert int(kv["mod_revision"]) == revision
        # When renewals stop, it is gone after its TTL, and the watcher hears it, with its last value
        stopped = time.monotonic()
        wait_until(lambda: (presence.seen() or (b"",))[0] is None, timeout=leased.ttl_s + 3)
        seen = presence.seen()
        assert seen is not None and seen[1] - stopped >= leased.ttl_s - 0.6 and presence.last_present == b"ttl"
        # and a renewal after that (a node back from a cut) puts it back
        leased.refresh()
        wait_until(lambda: (presence.seen() or (None,))[0] == b"ttl", timeout=10)
    finally:
        owner.close()
        watcher.close()


def test_proxy_variables_in_the_environment_do_not_route_etcd_traffic(
    etcd_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cluster nodes often carry http(s)_proxy for the internet; etcd is reached directly, as the
    TCPStore is (a proxy that cannot reach it would fail every rendezvous, one that can would see
    the job's keys and tokens)."""
    import socket
    import threading

    # Given a "proxy" that counts the connections it receives and answers none
    proxy = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = proxy.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.getsockname()[1]}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, url)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    backend = open_etcd(etcd_server.endpoint, timeout=timedelta(seconds=3))
    try:
        # When the backend writes, reads, holds a leased key and watches it
        key = _key()
        assert backend.compare_set(key, None, b"x") is True
        assert backend.get(key) == b"x"
        leased = backend.lease_key(key + "/alive", b"1", 5)
        assert leased is not None
        leased.refresh()
        presence = backend.watch_presence(key + "/alive")
        assert presence is not None
        wait_until(lambda: presence.seen() is not None, timeout=10)
        # Then every request went straight to etcd
        assert accepted == []
    finally:
        backend.close()
        proxy.close()
        for conn in accepted:
            conn.close()
