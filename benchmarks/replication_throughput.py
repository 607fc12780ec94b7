"""Peer replication throughput vs a plain loopback socket copy of the same bytes (target >= 0.5x).

    python benchmarks/replication_throughput.py [--size-mib 256] [--runs 7] [--json out.json]

Why this shape: the plain copy is the ceiling (one sendall into one recv_into a pre-faulted buffer,
no framing, no checksums), and both sides of every path run in this one process, as two agents
on one machine would, so the two cores are shared the same way. Paths:

- ``push``: ``resilrun.tiers.peer.push`` of the snapshot's bytes to a ReplicaServer (mutual HMAC
  handshake, messages with their HMACs, framing, per-tensor crc32 and the stream's GMAC on both
  ends, written straight into the replica slot);
- ``push, crc32 only``: the same with the stream's GMAC left out on both ends (what the stream
  carried before issue 19): the MAC's cost, in the same run;
- ``push, encrypted``: the same to a server run with ``--peer-encryption`` (AES-256-GCM over the
  data frames, in line on both ends): confidentiality's cost, in the same run;
- ``replicator``: a commit into node memory until ``Replicator.status()`` reports it replicated,
  streamed from the memfd slot under its seqlock (what the agent does every step).

Runs are interleaved (the order rotates) and reported as median and min-max, with the ratio taken
per round (each path against the plain copy of the same round) because this machine is shared
and noisy; the 1-minute load average is printed with the table. The first push, which
allocates and pre-faults the peer's replica buffer, is reported separately.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch

from resilrun.snapshot.layout import build_layout
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore, Replicator, push, wire

SECRET = os.urandom(32)
TENSORS = 4  # a few large tensors, so that per-tensor segments are exercised as in a real model


def make_snapshot(nbytes: int) -> bytes:
    per_tensor = nbytes // TENSORS // 4
    layout = build_layout([(f"layer{i}.weight", "F32", (per_tensor,)) for i in range(TENSORS)])
    buffer = bytearray(layout.total_bytes)
    buffer[: layout.data_start] = layout.header
    generator = torch.Generator().manual_seed(0)
    for entry in layout.entries:
        values = torch.randn(per_tensor, generator=generator)
        start = layout.data_start + entry.begin
        buffer[start : start + entry.nbytes] = values.numpy().tobytes()
    return bytes(buffer)


def plain_copy(data: bytes) -> float:
    """Seconds to move ``data`` through a loopback TCP socket into a pre-faulted buffer, acked."""
    target = bytearray(len(data))  # touched below, as the replica slot is pre-faulted
    target[::4096] = b"\0" * len(target[::4096])
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def receive() -> None:
            conn, _ = listener.accept()
            with conn:
                view, offset = memoryview(target), 0
                while offset < len(target):
                    offset += conn.recv_into(view[offset:])
                conn.sendall(b"k")

        thread = threading.Thread(target=receive)
        thread.start()
        started = time.perf_counter()
        with socket.create_connection(listener.getsockname(), timeout=60) as sock:
            sock.sendall(data)
            sock.recv(1)
        seconds = time.perf_counter() - started
        thread.join(60)
    return seconds


class _NoMac:
    """Stands in for wire.StreamMac on both ends: no GMAC, an empty tag (crc32 only)."""

    def __init__(self, key: bytes, nonce: bytes) -> None:
        del key, nonce

    def update(self, piece: memoryview) -> None:
        del piece

    def tag(self) -> bytes:
        return b""


@contextlib.contextmanager
def crc32_only() -> Iterator[None]:
    kept = wire.StreamMac
    wire.StreamMac = _NoMac  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        wire.StreamMac = kept  # type: ignore[misc]


class ReplicatorPath:
    """Commit into a node-memory slot, wait until the Replicator says the peer holds it.

    The wait is on the replicator's own confirmation callback, not a polling loop: a poll every few
    milliseconds would quantize the time and take the GIL from the pushing thread while it works.
    """

    def __init__(self, data: bytes, address: str) -> None:
        self.data = data
        self.memory = NodeMemoryTier(f"bench{uuid.uuid4().hex[:6]}")
        self.step = 0
        self._confirmed = threading.Condition()
        self._newest = 0
        self.replicator = Replicator(
            self.memory, SECRET, lambda: [address], timeout=timedelta(seconds=60), on_replicated=self._on_replicated
        )
        # Wired as the agent's commit pipeline wires it: node memory's announcements, the commit gate.
        self.memory.add_listener(self.replicator.on_commit)
        self.memory.add_commit_gate(self.replicator.hold_commit)
        for slot in (0, 1):
            buffer = self.memory.allocate(0, slot, len(data))
            buffer.view()[:] = data

    def _on_replicated(self, rank: int, step: int, nbytes: int, seconds: float) -> None:
        with self._confirmed:
            self._newest = max(self._newest, step)
            self._confirmed.notify_all()

    def __call__(self) -> float:
        self.step += 1
        slot = self.step % 2
        started = time.perf_counter()
        self.memory.commit(0, self.step, slot, len(self.data), None)
        with self._confirmed:
            if not self._confirmed.wait_for(lambda: self._newest >= self.step, timeout=120):
                raise TimeoutError("replication did not finish")
        return time.perf_counter() - started

    def close(self) -> None:
        self.replicator.close()
        self.memory.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args()

    data = make_snapshot(args.size_mib * 2**20)
    peer_memory = NodeMemoryTier(f"benchpeer{uuid.uuid4().hex[:6]}")
    store = ReplicaStore("bench")
    server = ReplicaServer(SECRET, store, peer_memory)
    sealed = wire.PeerKey(SECRET, encrypt=True)
    encrypted_server = ReplicaServer(sealed, store, peer_memory)
    replicator_path = ReplicatorPath(data, server.address)
    try:
        started = time.perf_counter()
        push(server.address, SECRET, 1, 0, 2, data, None, timeout=timedelta(seconds=120))
        first_push = time.perf_counter() - started
        push(server.address, SECRET, 1, 1, 2, data, None, timeout=timedelta(seconds=120))  # the second slot
        # The replicator's rank is another one, whose replica slots the peer allocates at its first
        # two pushes too: untimed, like the pushes' (else they counted as two 0.3 GB/s runs).
        replicator_path()
        replicator_path()

        step = iter(range(2, 1 << 30))

        def push_once() -> float:
            started = time.perf_counter()
            push(server.address, SECRET, 1, next(step), 2, data, None, timeout=timedelta(seconds=120))
            return time.perf_counter() - started

        def push_encrypted() -> float:
            started = time.perf_counter()
            push(encrypted_server.address, sealed, 1, next(step), 2, data, None, timeout=timedelta(seconds=120))
            return time.perf_counter() - started

        def push_crc32_only() -> float:
            with crc32_only():
                return push_once()

        paths: dict[str, Callable[[], float]] = {
            "plain loopback copy": lambda: plain_copy(data),
            "push (GMAC + crc32: the default)": push_once,
            "push, crc32 only (no MAC)": push_crc32_only,
            "push, encrypted (--peer-encryption)": push_encrypted,
            "replicator (memfd slot -> peer)": replicator_path,
        }
        seconds: dict[str, list[float]] = {name: [] for name in paths}
        names = list(paths)
        for run in range(args.runs):
            for name in names[run % len(names) :] + names[: run % len(names)]:
                seconds[name].append(paths[name]())
    finally:
        replicator_path.close()
        server.close()
        encrypted_server.close()
        store.close()
        peer_memory.close()

    size = len(data)
    plain = seconds["plain loopback copy"]
    print(f"\n{size / 2**20:.0f} MiB snapshot ({TENSORS} tensors), {args.runs} interleaved runs each, ", end="")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n")
    print("| path | median GB/s | min-max GB/s | median of per-run ratios to the plain copy |")
    print("| --- | --- | --- | --- |")
    for name, values in seconds.items():
        rates = sorted(size / s / 1e9 for s in values)
        # Each run is paired with the plain copy of the same round: slow drifts in the machine's load cancel.
        ratio = statistics.median(p / s for p, s in zip(plain, values, strict=True))
        print(f"| {name} | {statistics.median(rates):.2f} | {rates[0]:.2f}-{rates[-1]:.2f} | {ratio:.2f}x |")
    print(f"\nfirst push (allocates and pre-faults the peer's replica buffer): {size / first_push / 1e9:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"bytes": size, "seconds": seconds, "first_push_s": first_push}, out, indent=2)


if __name__ == "__main__":
    main()
