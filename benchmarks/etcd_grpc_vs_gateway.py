"""What etcd's JSON gateway costs against its native gRPC API, per request, same etcd, same run.

    pip install -e '.[bench]'        # aetcd: a maintained gRPC client (grpcio + protobuf)
    python benchmarks/etcd_grpc_vs_gateway.py [--requests 2000] [--out benchmarks/etcd_grpc_vs_gateway.md]

resilrun talks to etcd through its v3 JSON gateway (``rendezvous/etcd.py``, over ``http.client``), so
it needs no gRPC stack: grpcio and protobuf would be the only compiled dependencies outside torch,
and a protobuf pinned by the launcher can clash with the one a training script's own stack wants
(torch itself does not depend on it). Issue 20 asks what that choice costs at scale: etcd's CPU per
request is what bounds a single etcd's agents. For each request kind resilrun sends at steady
state (a lease keep-alive: every agent's heartbeat; a range: a read; a put; a counter increment
as a compare-and-set txn), this sends ``--requests`` of them one after another through
resilrun's own backend (the gateway) and through ``aetcd`` (gRPC), and reports etcd's CPU per
request (its process's user+system time over the loop) and the client's. Sequential requests
measure cost, not throughput; etcd runs on tmpfs, as in control_plane_scale.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _scale_agents import cpu_s  # noqa: E402

from resilrun.rendezvous.etcd import open_etcd  # noqa: E402

KINDS = ("keep-alive", "range", "put", "counter add")


def _measure(etcd_pid: int, count: int, one: Callable[[int], Any]) -> tuple[float, float]:
    """(etcd CPU µs, client CPU µs) per request over ``count`` sequential requests."""
    one(-1)  # warm: connection open, lease granted
    etcd0, client0 = cpu_s(etcd_pid), cpu_s()
    for i in range(count):
        one(i)
    return 1e6 * (cpu_s(etcd_pid) - etcd0) / count, 1e6 * (cpu_s() - client0) / count


def gateway(endpoint: str, etcd_pid: int, count: int) -> dict[str, tuple[float, float]]:
    backend = open_etcd(endpoint, timeout=timedelta(seconds=30))
    leased = backend.lease_key("bench/gw/alive", b"4", 30)
    assert leased is not None
    ops: dict[str, Callable[[int], Any]] = {
        "keep-alive": lambda i: leased.refresh(),
        "range": lambda i: backend.get("bench/gw/alive"),
        "put": lambda i: backend.set(f"bench/gw/put/{i % 64}", b"x" * 64),
        "counter add": lambda i: backend.add("bench/gw/counter", 1),
    }
    try:
        return {kind: _measure(etcd_pid, count, ops[kind]) for kind in KINDS}
    finally:
        leased.close()
        backend.close()


def grpc(endpoint: str, etcd_pid: int, count: int) -> dict[str, tuple[float, float]]:
    import aetcd

    host, port = endpoint.rsplit(":", 1)
    loop = asyncio.new_event_loop()

    def run(coroutine: Awaitable[Any]) -> Any:
        return loop.run_until_complete(coroutine)

    client = aetcd.Client(host=host, port=int(port))
    lease = run(client.lease(30))
    run(client.put(b"bench/grpc/alive", b"4", lease=lease))

    known = [0, 0]  # the counter's value and revision as last seen (the gateway backend caches them too)

    def add(i: int) -> None:  # as the gateway backend adds: one txn comparing the cached revision
        key = b"bench/grpc/counter"
        while True:
            compare = [client.transactions.mod(key) == known[1]]
            put = [client.transactions.put(key, str(known[0] + 1).encode())]
            done, _ = run(client.transaction(compare, put, [client.transactions.get(key)]))
            if done:
                known[0] += 1
                known[1] = run(client.get(key)).mod_revision if i < 0 else known[1] + 1
                return
            current = run(client.get(key))  # lost a race (or the first call): read, then again
            known[:] = [int(current.value), current.mod_revision] if current is not None else [0, 0]

    ops: dict[str, Callable[[int], Any]] = {
        "keep-alive": lambda i: run(lease.refresh()),
        "range": lambda i: run(client.get(b"bench/grpc/alive")),
        "put": lambda i: run(client.put(f"bench/grpc/put/{i % 64}".encode(), b"x" * 64)),
        "counter add": add,
    }
    try:
        return {kind: _measure(etcd_pid, count, ops[kind]) for kind in KINDS}
    finally:
        run(client.close())
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/etcd_grpc_vs_gateway.md"))
    args = parser.parse_args()
    try:
        import aetcd  # noqa: F401
    except ImportError:
        sys.exit("aetcd is not installed: pip install -e '.[bench]' (a gRPC etcd client, for this benchmark only)")
    from tests.etcd_server import EtcdCluster

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="resilrun-bench-etcd-", dir=base))
    cluster = EtcdCluster(root).start()
    try:
        popen = cluster.members[0].popen
        assert popen is not None
        started = time.monotonic()
        via_gateway = gateway(cluster.endpoint, popen.pid, args.requests)
        via_grpc = grpc(cluster.endpoint, popen.pid, args.requests)
        took = time.monotonic() - started
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    lines = [
        "| request | etcd CPU µs: gateway | etcd CPU µs: gRPC | gateway ÷ gRPC "
        "| client CPU µs: gateway | client CPU µs: gRPC |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind in KINDS:
        (gw_etcd, gw_client), (rpc_etcd, rpc_client) = via_gateway[kind], via_grpc[kind]
        lines.append(
            f"| {kind} | {gw_etcd:.0f} | {rpc_etcd:.0f} | {gw_etcd / max(rpc_etcd, 1e-9):.1f}× "
            f"| {gw_client:.0f} | {rpc_client:.0f} |"
        )
    text = "\n".join(lines) + f"\n\n{args.requests} sequential requests of each kind per client, {took:.0f} s in all.\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
