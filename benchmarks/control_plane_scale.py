"""Control plane at scale: N simulated agents (no workers) against a c10d TCPStore and against etcd.

    python benchmarks/control_plane_scale.py [--sizes 64,128,256,512,1024] [--backends c10d,etcd]
        [--modes scalable,scalable-cas,all-to-all] [--budget-s 900] [--out benchmarks/control_plane_scale]

What an agent does here is what the supervisor does, through the same code: it joins with the
rendezvous client's own join steps (``executor.Joining``),
then every monitor interval (0.1 s) reads the rendezvous state, and beats as ``HeartbeatSender``
does (``heartbeat.Heartbeat``: a counter bump every heartbeat interval, 1 s; on etcd a renewal of
its liveness lease three times per TTL, through a connection of its own) and every heartbeat
interval reads the heartbeats it watches (``read_heartbeats``: counters, or on etcd liveness keys
followed by watch) into a ``StalenessJudge`` (5 s timeout). One agent then stops; the time
until another agent judges it stale (detection) and until one of them has opened the next round
with ``next_round`` (decision) is measured.

Modes: ``all-to-all`` is the supervisor before issue 15 (every agent reads the whole state
document every tick and every other agent's counter every interval: O(N^2) store traffic);
``scalable`` is the agent today: it reads the document only when its version counter moves
(``RendezvousClient(refresh_s=...)``; on etcd that counter is pushed by a watch, one stream per
agent, counted as two operations when opened), watches two ring successors (``heartbeat.watched_nodes``),
and joins through the arrivals lane (rendezvous/executor.py: O(1) store operations per joining
agent, one write admits every arrival so far); ``scalable-cas`` is ``scalable`` with every agent
compare-and-setting itself into the document instead (before the lane), for the lane's ratio.
Joining runs the client's own ``Joining.step``, the code ``RendezvousClient.join`` loops over.

``--backends torchrun`` runs the same N agents through **torchrun's own** c10d rendezvous handler
(``torch.distributed.elastic.rendezvous.dynamic_rendezvous``, unchanged; ``_torchrun_rdzv_agents.py``)
against the same kind of hosted TCPStore, for the rendezvous row's ratio: its agents are threads
in ``TORCHRUN_PROCS`` processes (its API blocks), started together on a ``go`` key.

Agents are tasks on a small pool of threads (one store connection per thread), scheduled on the
monotonic clock; when the store (or this 2-core machine) cannot keep up, ticks run late and the
lag is reported. Every phase has a deadline and the whole run a budget, so it stops by itself.
Store operations are counted at the RendezvousBackend interface (the contract calls).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.etcd_server starts etcd

from resilrun.agent.heartbeat import (  # noqa: E402
    Heartbeat,
    StalenessJudge,
    lease_ttl_s,
    read_heartbeats,
    watched_nodes,
)
from resilrun.rendezvous.api import CounterWatch, LeasedKey, Presence, RendezvousBackend  # noqa: E402
from resilrun.rendezvous.executor import Joining, RendezvousClient  # noqa: E402
from resilrun.rendezvous.protocol import NodeInfo  # noqa: E402

MONITOR_S, HEARTBEAT_S, TIMEOUT_S = 0.1, 1.0, 5.0  # the agent's defaults
# Pool threads (one store connection each): more only adds GIL contention on 2 cores.
THREADS = 4
RENDEZVOUS_DEADLINE_S = 120.0
WARMUP_S, MEASURE_S = 2.0, 4.0
DETECT_DEADLINE_S = TIMEOUT_S + 20.0
REFRESH_S = 10.0  # the scalable mode's safety-net re-read of the whole document
FANOUT = 2
TORCHRUN_PROCS = 8  # processes the torchrun agents' threads are spread over (at most N)
TORCHRUN_MODE = "torchrun's handler"


class CountingBackend(RendezvousBackend):
    """Counts contract calls and bytes read; one per thread, so no lock is needed."""

    def __init__(self, inner: RendezvousBackend) -> None:
        self.inner = inner
        self.ops = 0
        self.bytes_read = 0
        self.watched: set[str] = set()

    def get(self, key: str) -> bytes | None:
        self.ops += 1
        value = self.inner.get(key)
        self.bytes_read += len(value or b"")
        return value

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self.ops += 1  # one contract call (the backend answers it in one or two requests)
        values = self.inner.get_many(keys)
        self.bytes_read += sum(len(value or b"") for value in values)
        return values

    def set(self, key: str, value: bytes) -> None:
        self.ops += 1
        self.inner.set(key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        self.ops += 1
        return self.inner.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        self.ops += 1
        return self.inner.add(key, amount)

    def watch_counter(self, key: str) -> CounterWatch | None:
        watch = self.inner.watch_counter(key)
        if watch is not None:
            self.ops += 2  # its range and its watch request (the pushed changes are not requests)
        return watch

    def leases(self) -> bool:
        return self.inner.leases()

    def lease_key(self, key: str, value: bytes, ttl_s: int) -> LeasedKey | None:
        leased = self.inner.lease_key(key, value, ttl_s)
        if leased is None:
            return None
        self.ops += 2  # the grant and the put
        return CountedLease(leased, self)

    def watch_presence(self, key: str) -> Presence | None:
        presence = self.inner.watch_presence(key)  # (one stream per key and connection)
        if presence is not None and key not in self.watched:
            self.watched.add(key)
            self.ops += 2  # a new stream: its range and its watch request
        return presence

    def close(self) -> None:
        self.inner.close()


class CountedLease:
    """A liveness lease whose renewals count as store operations."""

    def __init__(self, inner: LeasedKey, counter: CountingBackend) -> None:
        self.inner, self.counter = inner, counter
        self.ttl_s = inner.ttl_s

    def refresh(self) -> None:
        self.counter.ops += 1
        self.inner.refresh()

    def close(self) -> None:
        self.inner.close()


class ThreadBackend(RendezvousBackend):
    """Routes each call to the calling pool thread's own connection."""

    def __init__(self, connect: Callable[[], RendezvousBackend]) -> None:
        self.connect = connect
        self.local = threading.local()
        self.all: list[CountingBackend] = []
        self.lock = threading.Lock()

    def _mine(self) -> CountingBackend:
        mine = getattr(self.local, "backend", None)
        if mine is None:
            mine = CountingBackend(self.connect())
            self.local.backend = mine
            with self.lock:
                self.all.append(mine)
        return mine

    def get(self, key: str) -> bytes | None:
        return self._mine().get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._mine().get_many(keys)

    def set(self, key: str, value: bytes) -> None:
        self._mine().set(key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        return self._mine().compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self._mine().add(key, amount)

    def watch_counter(self, key: str) -> CounterWatch | None:
        return self._mine().watch_counter(key)  # one stream per agent, as each agent would hold

    def leases(self) -> bool:
        return self._mine().leases()

    def own(self) -> CountingBackend:
        """A connection of one agent's own (its liveness lease and watches, on a store with leases)."""
        mine = CountingBackend(self.connect())
        with self.lock:
            self.all.append(mine)
        return mine

    def totals(self) -> tuple[int, int]:
        with self.lock:
            return sum(b.ops for b in self.all), sum(b.bytes_read for b in self.all)

    def close(self) -> None:
        for backend in self.all:
            backend.close()


@dataclass
class Agent:
    client: RendezvousClient
    judge: StalenessJudge
    watched: list[str] = field(default_factory=list)
    next_heartbeat: float = 0.0
    next_beat: float = 0.0
    heartbeat: Heartbeat | None = None
    liveness: RendezvousBackend | None = None  # where its heartbeat and its watches go
    joined: bool = False
    stopped: bool = False


class Scheduler:
    """A heap of (due, seq, task) run by a pool of threads; records how late each task ran."""

    def __init__(self, threads: int) -> None:
        self.heap: list[tuple[float, int, Callable[[], float | None]]] = []
        self.cond = threading.Condition()
        self.seq = 0
        self.lags: list[float] = []
        self.errors: list[BaseException] = []
        self.closing = False
        self.pool = [threading.Thread(target=self._work, daemon=True) for _ in range(threads)]
        for thread in self.pool:
            thread.start()

    def at(self, due: float, task: Callable[[], float | None]) -> None:
        with self.cond:
            self.seq += 1
            heapq.heappush(self.heap, (due, self.seq, task))
            self.cond.notify()

    def _work(self) -> None:
        while True:
            with self.cond:
                while not self.closing and (not self.heap or self.heap[0][0] > time.monotonic()):
                    wait = self.heap[0][0] - time.monotonic() if self.heap else None
                    self.cond.wait(wait)
                if self.closing:
                    return
                due, _, task = heapq.heappop(self.heap)
            self.lags.append(time.monotonic() - due)
            try:
                again = task()  # returns when to run next, or None to stop
            except BaseException as exc:  # noqa: BLE001 - reported by the cell
                self.errors.append(exc)
                again = None
            if again is not None and not self.closing:
                self.at(again, task)

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        for thread in self.pool:
            thread.join(10)


def _cpu(pid: int | None) -> float:
    """CPU seconds used so far by a process (the store's, or this simulator's)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def run_cell(connect: Callable[[], RendezvousBackend], store_pid: int, n: int, mode: str) -> dict[str, Any]:
    """One (backend, mode, N) measurement; every phase bounded."""
    run_id = f"scale-{uuid.uuid4().hex[:8]}"
    shared = ThreadBackend(connect)
    scalable = mode.startswith("scalable")
    agents = []
    for index in range(n):
        me = NodeInfo(node_id=f"node-{index:05d}", addr=f"10.0.{index // 256}.{index % 256}", local_world_size=8)
        client = RendezvousClient(
            shared, run_id, me, min_nodes=n, max_nodes=n,
            join_timeout=timedelta(seconds=RENDEZVOUS_DEADLINE_S), last_call_timeout=timedelta(seconds=1),
            refresh_s=REFRESH_S if scalable else None, arrivals=mode == "scalable",
        )  # fmt: skip
        agents.append(Agent(client, StalenessJudge(TIMEOUT_S)))
    result: dict[str, Any] = {"n": n, "mode": mode}
    sched = Scheduler(THREADS)
    done = threading.Event()
    joined = [0]
    lock = threading.Lock()
    started = time.monotonic()

    def join_step(agent: Agent) -> Callable[[], float | None]:
        attempt = Joining(agent.client)

        def step() -> float | None:
            if attempt.step() is not None:
                with lock:
                    joined[0] += 1
                    if joined[0] == n:
                        done.set()
                return None
            return time.monotonic() + (attempt.poll_s if attempt.waits else 0.0)

        return step

    for agent in agents:
        sched.at(started, join_step(agent))
    if not done.wait(RENDEZVOUS_DEADLINE_S):
        sched.close()
        note = f"rendezvous not complete in {RENDEZVOUS_DEADLINE_S:g} s ({joined[0]}/{n})"
        result.update(rendezvous_s=None, note=note)
        return result
    result["rendezvous_s"] = time.monotonic() - started
    ops0, bytes0 = shared.totals()
    result["rendezvous_ops"] = ops0
    sched.lags.clear()
    state = agents[0].client.state()
    ids = [p.node_id for p in state.participants]
    victim = ids[len(ids) // 2]
    detected: dict[str, float] = {}

    def tick_step(agent: Agent) -> Callable[[], float | None]:
        me = agent.client.me.node_id
        agent.watched = watched_nodes(ids, me, FANOUT if scalable else 0)

        def tick() -> float | None:
            if agent.stopped or done.is_set():
                return None
            now = time.monotonic()
            current = agent.client.state()
            if current.round != state.round:
                return None  # the decision was made: the cell is over for this agent
            if agent.heartbeat is None:  # the agent's own heartbeat, as HeartbeatSender beats
                # On a store with leases each agent has its own connection for it (its lease and
                # its watch streams, as a real agent has); counters go through the pool's.
                agent.liveness = shared.own() if shared.leases() else shared
                agent.heartbeat = Heartbeat(agent.liveness, run_id, me, interval_s=HEARTBEAT_S, timeout_s=TIMEOUT_S)
            if now >= agent.next_beat:
                agent.heartbeat.beat()
                agent.next_beat = now + agent.heartbeat.period_s
            if now >= agent.next_heartbeat:
                assert agent.liveness is not None
                for node, reading in read_heartbeats(agent.liveness, run_id, agent.watched).items():
                    agent.judge.observe_reading(node, reading)
                agent.next_heartbeat = now + HEARTBEAT_S
                if victim in agent.judge.stale():
                    detected.setdefault("detected", time.monotonic())
                    new = agent.client.next_round(state.round, failure={"message": "lost"}, max_restarts=100)
                    if new.round != state.round:
                        detected.setdefault("decided", time.monotonic())
                        done.set()
                    return None
            return now + MONITOR_S

        return tick

    done.clear()
    begin = time.monotonic()
    for index, agent in enumerate(agents):  # spread the first ticks over one interval, as real agents
        agent.next_heartbeat = begin + HEARTBEAT_S * index / n
        sched.at(begin + MONITOR_S * index / n, tick_step(agent))
    # Warm: every agent has started its heartbeat (on etcd: its lease granted, its watches being
    # opened), then WARMUP_S more; the start-up requests are not the steady state.
    settle_by = time.monotonic() + DETECT_DEADLINE_S
    while any(agent.heartbeat is None for agent in agents) and time.monotonic() < settle_by:
        time.sleep(0.1)
    result["warmup_s"] = time.monotonic() - begin + WARMUP_S
    time.sleep(WARMUP_S)
    ops1, bytes1 = shared.totals()
    window, store1, sim1 = time.monotonic(), _cpu(store_pid), _cpu(None)
    time.sleep(MEASURE_S)
    ops2, bytes2 = shared.totals()
    elapsed = time.monotonic() - window
    store_cpu = _cpu(store_pid) - store1
    result["store_cpu_pct"] = 100 * store_cpu / elapsed
    result["store_cpu_us_per_op"] = 1e6 * store_cpu / max(ops2 - ops1, 1)
    result["sim_cpu_pct"] = 100 * (_cpu(None) - sim1) / elapsed
    lags = sorted(sched.lags)
    result["ops_per_s"] = (ops2 - ops1) / elapsed
    result["ops_per_agent_s"] = result["ops_per_s"] / n
    result["kib_read_per_agent_s"] = (bytes2 - bytes1) / elapsed / n / 1024
    result["tick_lag_p99_ms"] = 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else None
    result["version_pushed"] = any(agent.client.version_watched for agent in agents)  # opened at the first tick
    result["leased"] = any(agent.heartbeat is not None and agent.heartbeat.lease is not None for agent in agents)
    # Now the victim stops: no more ticks, no more heartbeats
    next(a for a in agents if a.client.me.node_id == victim).stopped = True
    killed = time.monotonic()
    done.wait(DETECT_DEADLINE_S)
    sched.close()
    result["detect_s"] = detected["detected"] - killed if "detected" in detected else None
    result["decide_s"] = detected["decided"] - killed if "decided" in detected else None
    result["doc_kib"] = len(state.to_bytes()) / 1024
    if sched.errors:
        result["note"] = f"{len(sched.errors)} store errors, first: {sched.errors[0]}"
    shared.close()
    return result


_HOST_STORE = (
    "import sys, time\n"
    "from datetime import timedelta\n"
    "from resilrun.rendezvous.c10d import host_store\n"
    "store = host_store('127.0.0.1', 0, timedelta(seconds=30))\n"
    "print(store.port, flush=True)\n"
    "sys.stdin.read()\n"  # until the benchmark closes our stdin (or dies)
)


def _hosted_store() -> tuple[int, Any]:
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", _HOST_STORE], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None
    return int(child.stdout.readline()), child


def c10d_store() -> tuple[Callable[[], RendezvousBackend], int, Callable[[], None]]:
    """A TCPStore hosted by a child process, as an agent would host it, so its CPU can be measured."""
    from resilrun.rendezvous.c10d import C10dBackend, connect_store

    port, child = _hosted_store()

    def connect() -> RendezvousBackend:
        return C10dBackend(connect_store("127.0.0.1", port, timedelta(seconds=30)), "bench")

    def stop() -> None:
        child.kill()
        child.wait(10)

    return connect, child.pid, stop


def torchrun_cell(n: int) -> dict[str, Any]:
    """N agents through torchrun's DynamicRendezvousHandler on a fresh hosted TCPStore: the time from
    the common start until the last one's ``next_rendezvous()`` returned."""
    import subprocess

    from torch.distributed import TCPStore

    port, child = _hosted_store()
    run_id = f"torchrun-{uuid.uuid4().hex[:8]}"
    procs = min(TORCHRUN_PROCS, n)
    script = str(Path(__file__).with_name("_torchrun_rdzv_agents.py"))
    workers = []
    result: dict[str, Any] = {"n": n, "mode": TORCHRUN_MODE}
    try:
        store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=RENDEZVOUS_DEADLINE_S))
        first = 0
        for p in range(procs):
            count = n // procs + (1 if p < n % procs else 0)
            argv = [sys.executable, script, str(port), run_id, str(n), str(first), str(count)]
            workers.append(
                subprocess.Popen([*argv, str(RENDEZVOUS_DEADLINE_S)], stdout=subprocess.PIPE, text=True)
            )
            first += count
        ready_by = time.monotonic() + RENDEZVOUS_DEADLINE_S
        while store.add(f"{run_id}/ready", 0) < n:
            if time.monotonic() > ready_by or any(w.poll() is not None for w in workers):
                result["note"] = "torchrun's agents did not all start"
                return result
            time.sleep(0.1)
        cpu0 = _cpu(child.pid)
        started = time.time()
        store.set(f"{run_id}/go", "1")
        lines: list[str] = []
        for worker in workers:
            try:
                out, _ = worker.communicate(timeout=max(1.0, started + RENDEZVOUS_DEADLINE_S + 30 - time.time()))
            except subprocess.TimeoutExpired:
                worker.kill()
                out, _ = worker.communicate()
            lines += [line for line in out.splitlines() if line.strip()]
        done = [json.loads(line) for line in lines]
        finished = [d["t"] for d in done if "t" in d]
        errors = [d["error"] for d in done if "error" in d]
        if len(finished) < n:
            why = f": {errors[0]}" if errors else ""
            result["note"] = f"rendezvous not complete in {RENDEZVOUS_DEADLINE_S:g} s ({len(finished)}/{n}){why}"
            return result
        result["rendezvous_s"] = max(finished) - started
        result["store_cpu_pct"] = 100 * (_cpu(child.pid) - cpu0) / result["rendezvous_s"]
        return result
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(10)
        child.kill()
        child.wait(10)


def etcd_store() -> tuple[Callable[[], RendezvousBackend], int, Callable[[], None]]:
    from resilrun.rendezvous.etcd import open_etcd
    from tests.etcd_server import EtcdCluster

    # tmpfs when there is one: this measures etcd's CPU cost, not this VM's disk (production etcd
    # runs on SSDs with fsync; expect higher write latency there, the same op counts).
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="resilrun-bench-etcd-", dir=base))
    cluster = EtcdCluster(root).start()

    def connect() -> RendezvousBackend:
        return open_etcd(cluster.endpoint, timeout=timedelta(seconds=30))

    popen = cluster.members[0].popen
    assert popen is not None

    def stop() -> None:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)

    return connect, popen.pid, stop


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | mode | N | rendezvous (s) | detect (s) | decide (s) | store ops/s | ops/agent/s (demanded) "
        "| KiB read/agent/s | tick lag p99 (ms) | store CPU % | store CPU µs/op | simulator CPU % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['mode']} | {r['n']} | {_fmt(r.get('rendezvous_s'))} | {_fmt(r.get('detect_s'))} "
            f"| {_fmt(r.get('decide_s'))} | {_fmt(r.get('ops_per_s'), 0)} "
            f"| {_fmt(r.get('ops_per_agent_s'), 1)} ({_demanded(r)}) "
            f"| {_fmt(r.get('kib_read_per_agent_s'), 1)} | {_fmt(r.get('tick_lag_p99_ms'), 0)} "
            f"| {_fmt(r.get('store_cpu_pct'), 0)} | {_fmt(r.get('store_cpu_us_per_op'), 0)} "
            f"| {_fmt(r.get('sim_cpu_pct'), 0)} |"
            + (f" {r['note']}" if r.get("note") else "")
        )
    return "\n".join(lines)


def _demanded(row: dict[str, Any]) -> str:
    if row["mode"] == TORCHRUN_MODE or row.get("ops_per_agent_s") is None:
        return "—"
    asked = demand(row["mode"], row["n"], pushed=bool(row.get("version_pushed")), leased=bool(row.get("leased")))
    return f"{asked:.2g}" if asked < 1 else f"{asked:.0f}"


def demand(mode: str, n: int, *, pushed: bool = False, leased: bool = False) -> float:
    """Store ops per agent per second the protocol asks for (what a store that keeps up serves);
    ``pushed``: the version counter comes by watch, not by a read every tick; ``leased``:
    liveness by lease renewals (three per TTL) and watches, not counter bumps and reads."""
    if leased:
        return (0 if pushed else 1 / MONITOR_S) + 3 / lease_ttl_s(HEARTBEAT_S, TIMEOUT_S)
    watched = n - 1 if mode == "all-to-all" else min(FANOUT, n - 1)
    return (0 if pushed else 1 / MONITOR_S) + (1 + watched) / HEARTBEAT_S


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return False
    metrics = [
        ("rendezvous_s", "rendezvous complete (s)"),
        ("decide_s", "agent lost → recovery decided (s)"),
        ("ops_per_agent_s", "store ops per agent per s (dotted: demanded)"),
        ("tick_lag_p99_ms", "tick lag p99 (ms): how far behind the agents run"),
    ]
    series = {
        ("c10d", "all-to-all"): ("tab:blue", "o-"),
        ("c10d", "scalable"): ("tab:orange", "s-"),
        ("c10d", "scalable-cas"): ("tab:purple", "d-"),
        ("etcd", "all-to-all"): ("tab:green", "^-"),
        ("etcd", "scalable"): ("tab:red", "v-"),
        ("etcd", "scalable-cas"): ("tab:brown", "P-"),
        ("c10d", TORCHRUN_MODE): ("black", "x--"),
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (metric, title) in zip(axes.flat, metrics, strict=True):
        for (backend, mode), (color, style) in series.items():
            mine = [r for r in rows if (r["backend"], r["mode"]) == (backend, mode)]
            points = [(r["n"], r[metric]) for r in mine if r.get(metric)]
            if points:
                ax.plot(*zip(*points, strict=True), style, color=color, label=f"{backend}, {mode}")
            if metric == "ops_per_agent_s" and backend == "c10d" and mode != TORCHRUN_MODE and mine:
                sizes = [r["n"] for r in mine]
                ax.plot(sizes, [demand(mode, n) for n in sizes], ":", color="gray")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("simulated agents (N)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("resilrun control plane: N simulated agents on one 2-core machine (log-log; missing = saturated)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,128,256,512,1024")
    parser.add_argument("--backends", default="c10d,torchrun,etcd")
    parser.add_argument("--modes", default="scalable,scalable-cas")
    parser.add_argument("--budget-s", type=float, default=900.0, help="stop starting new cells after this long")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/control_plane_scale"))
    parser.add_argument("--from-json", type=Path, help="only redraw the table and plot of an earlier run")
    args = parser.parse_args()
    if args.from_json is not None:
        rows = json.loads(args.from_json.read_text())
        print(table(rows))
        plot(rows, args.out.with_suffix(".png"))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    deadline = time.monotonic() + args.budget_s
    rows: list[dict[str, Any]] = []
    for backend in args.backends.split(","):
        if backend == "torchrun":
            saturated = False
            for n in sizes:
                if time.monotonic() > deadline or saturated:
                    why = "budget spent" if not saturated else "skipped: smaller N already saturated"
                    rows.append({"backend": "c10d", "mode": TORCHRUN_MODE, "n": n, "note": why})
                    continue
                row = {"backend": "c10d", **torchrun_cell(n)}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                saturated = row.get("rendezvous_s") is None
            continue
        connect, store_pid, stop = {"c10d": c10d_store, "etcd": etcd_store}[backend]()
        try:
            for mode in args.modes.split(","):
                saturated = False
                for n in sizes:
                    if time.monotonic() > deadline or saturated:
                        why = "budget spent" if not saturated else "skipped: smaller N already saturated"
                        rows.append({"backend": backend, "mode": mode, "n": n, "note": why})
                        continue
                    row = {"backend": backend, **run_cell(connect, store_pid, n, mode)}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    saturated = row.get("rendezvous_s") is None or row.get("decide_s") is None
        finally:
            stop()
    load = os.getloadavg()[0]
    text = table(rows) + f"\n\n1-minute load average at the end: {load:.1f} ({os.cpu_count()} cores)\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    if plot(rows, args.out.with_suffix(".png")):
        print(f"plot: {args.out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
