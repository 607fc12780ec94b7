"""Child of ``control_plane_scale.py``: one process's share of its N simulated agents.

    python benchmarks/_scale_agents.py SPEC_JSON

SPEC_JSON names the store (``{"backend": "c10d", "port": P}`` or ``{"backend": "etcd", "endpoint":
URL}``), the run, N, the mode and this process's agents (``first``, ``count``). The parent drives
every process through the same phases over stdin and stdout, one JSON object per line: the child
says ``ready``; ``go`` (a monotonic time: the clock is the machine's, shared by its processes)
starts the joins, answered by ``joined``; ``tick`` starts the agents' monitor loops, answered by
``warm`` once each agent's loop has run once; ``sample`` is answered with the operation and CPU
counts so far; ``kill`` stops the victim (in the process that holds it, answered by ``killed``);
``finish`` waits for the agents to see the next round and is answered by ``done``. ``detected``
and ``decided`` come unasked, when one of this process's agents judges the victim stale and when
it has opened the next round.

What an agent does is what the supervisor does, through the same code: its heartbeat starts before
it joins and beats on as ``HeartbeatSender`` does (``heartbeat.Heartbeat``: a counter bump every
interval, or a renewal of its liveness lease three times per TTL); it joins with the rendezvous
client's own join steps (``executor.Joining``); then every monitor interval it reads the
rendezvous state (where the document is pushed, only at its heartbeat reads: the ticks between
would read memory) and every heartbeat interval reads the heartbeats it watches
(``read_heartbeats``) into a ``StalenessJudge``. Agents are tasks on a small pool of threads (one
store connection per thread; on a store with leases each agent also has a connection of its own
for its lease and watches, as a real agent has), scheduled on the monotonic clock; how late each
task ran is recorded.
"""

from __future__ import annotations

import heapq
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from resilrun.agent.liveness.heartbeat import (  # noqa: E402
    SILENT,
    Heartbeat,
    StalenessJudge,
    read_heartbeats,
    watched_nodes,
)
from resilrun.rendezvous.api import KeyView, LeasedKey, Presence, RendezvousBackend  # noqa: E402
from resilrun.rendezvous.executor import Joining, RendezvousClient  # noqa: E402
from resilrun.rendezvous.protocol import NodeInfo  # noqa: E402

MONITOR_S, HEARTBEAT_S, TIMEOUT_S = 0.1, 1.0, 5.0  # the agent's defaults
# Pool threads per process (one store connection each), by backend. A few, not one per agent: more
# only add GIL contention while the store answers in microseconds (c10d). On etcd every request
# waits milliseconds on a store that shares these 2 cores with the agents, and more requests in
# flight only make each cost more (at 1,024 agents, 8 threads x 8 processes: 17-18 s to rendezvous,
# both sides' CPU per request about twice what it is with 2 threads; 2: 11.8 s, the ticks still on
# time, p99 21 ms). Real agents are processes on their own hosts: what they do per request is the
# same, only the simulator's contention differs.
THREADS = {"c10d": 8, "etcd": 2}
RENDEZVOUS_DEADLINE_S = 120.0
DETECT_DEADLINE_S = TIMEOUT_S + 20.0
REFRESH_S = 10.0  # the scalable mode's safety-net re-read of the whole document
FANOUT = 2


class CountingBackend(RendezvousBackend):
    """Counts contract calls and bytes read; one per thread, so no lock is needed."""

    def __init__(self, inner: RendezvousBackend) -> None:
        self.inner = inner
        self.ops = 0
        self.kinds: dict[str, int] = {}
        self.bytes_read = 0
        self.watched: set[str] = set()

    def count(self, kind: str, ops: int) -> None:
        self.ops += ops
        self.kinds[kind] = self.kinds.get(kind, 0) + ops

    def get(self, key: str) -> bytes | None:
        self.count("get", 1)
        value = self.inner.get(key)
        self.bytes_read += len(value or b"")
        return value

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self.count("get_many", 1)  # one contract call (the backend answers it in one or two requests)
        values = self.inner.get_many(keys)
        self.bytes_read += sum(len(value or b"") for value in values)
        return values

    def set(self, key: str, value: bytes) -> None:
        self.count("set", 1)
        self.inner.set(key, value)

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bool:
        self.count("compare_set", 1)
        return self.inner.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        self.count("add", 1)
        return self.inner.add(key, amount)

    def watch_key(self, key: str) -> KeyView | None:
        watch = self.inner.watch_key(key)
        if watch is not None:
            self.count("watch_key", 2)  # its range and watch requests (what it pushes is no request)
        return watch

    def watch_counter(self, key: str) -> KeyView | None:
        watch = self.inner.watch_counter(key)
        if watch is not None:
            self.count("watch_counter", 2)  # its range and watch requests
        return watch

    def leases(self) -> bool:
        return self.inner.leases()

    def lease_key(self, key: str, value: bytes, ttl_s: int) -> LeasedKey | None:
        leased = self.inner.lease_key(key, value, ttl_s)
        if leased is None:
            return None
        self.count("lease_key", 2)  # the grant and the put
        return CountedLease(leased, self)

    def watch_presence(self, key: str) -> Presence | None:
        presence = self.inner.watch_presence(key)  # (one stream per key and connection)
        if presence is not None and key not in self.watched:
            self.watched.add(key)
            self.count("watch_presence", 2)  # a new stream: its range and its watch request
        return presence

    def close(self) -> None:
        self.inner.close()


class CountedLease:
    """A liveness lease whose renewals count as store operations."""

    def __init__(self, inner: LeasedKey, counter: CountingBackend) -> None:
        self.inner, self.counter = inner, counter
        self.ttl_s = inner.ttl_s

    def refresh(self) -> None:
        self.counter.count("refresh", 1)
        self.inner.refresh()

    def close(self) -> None:
        self.inner.close()


class ThreadBackend(RendezvousBackend):
    """Routes each call to the calling pool thread's own connection."""

    def __init__(self, connect: Callable[[], RendezvousBackend], connections: int) -> None:
        """``connections``: opened now, one for each pool thread, so that the timed phases do not
        include a connection storm: 64 TCPStore clients connecting at once from 8 processes here
        see a few connects take 5 s in torch's client, which would then be all a 64-agent
        rendezvous measures (real agents connect once, at start-up, before they join)."""
        self.connect = connect
        self.local = threading.local()
        self.all: list[CountingBackend] = []
        self.lock = threading.Lock()
        self.spare = [CountingBackend(connect()) for _ in range(connections)]

    def _mine(self) -> CountingBackend:
        mine = getattr(self.local, "backend", None)
        if mine is None:
            with self.lock:
                mine = self.spare.pop() if self.spare else CountingBackend(self.connect())
                self.all.append(mine)
            self.local.backend = mine
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

    def watch_key(self, key: str) -> KeyView | None:
        return self._mine().watch_key(key)  # one stream per agent, as each agent would hold

    def watch_counter(self, key: str) -> KeyView | None:
        return self._mine().watch_counter(key)

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

    def kinds(self) -> dict[str, int]:
        with self.lock:
            kinds: dict[str, int] = {}
            for backend in self.all:
                for kind, ops in backend.kinds.items():
                    kinds[kind] = kinds.get(kind, 0) + ops
            return kinds

    def close(self) -> None:
        for backend in self.all:
            backend.close()


@dataclass
class Agent:
    client: RendezvousClient
    judge: StalenessJudge
    watched: list[str] = field(default_factory=list)
    next_heartbeat: float = 0.0
    heartbeat: Heartbeat | None = None
    liveness: RendezvousBackend | None = None  # where its heartbeat and its watches go
    joined: bool = False
    ticked: bool = False  # its monitor loop has run once (on etcd: its watches are opening)
    stopped: bool = False  # killed: no more beats, no more ticks
    over: bool = False  # it saw the next round: its part of the cell is over


class Scheduler:
    """A heap of (due, seq, task) run by a pool of threads; records how late each task ran."""

    def __init__(self, threads: int) -> None:
        self.heap: list[tuple[float, int, Callable[[], float | None]]] = []
        self.cond = threading.Condition()
        self.seq = 0
        self.lags: list[tuple[float, float]] = []  # (when it ran, how late)
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
            ran = time.monotonic()
            self.lags.append((ran, ran - due))
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


def cpu_s(pid: int | None = None) -> float:
    """CPU seconds used so far by a process (the store's, or this one)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def connector(spec: dict[str, Any]) -> Callable[[], RendezvousBackend]:
    if spec["backend"] == "c10d":
        from resilrun.rendezvous.c10d import C10dBackend, connect_store

        return lambda: C10dBackend(connect_store("127.0.0.1", spec["port"], timedelta(seconds=30)), "bench")
    from resilrun.rendezvous.etcd import open_etcd

    return lambda: open_etcd(spec["endpoint"], timeout=timedelta(seconds=30))


class Shard:
    """This process's agents through the phases the parent drives; every wait bounded."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.n, self.mode, self.run_id = int(spec["n"]), str(spec["mode"]), str(spec["run_id"])
        self.scalable = self.mode.startswith("scalable")
        threads = int(spec.get("threads", THREADS[spec["backend"]]))
        self.shared = ThreadBackend(connector(spec), threads)
        self.agents: list[Agent] = []
        for index in range(int(spec["first"]), int(spec["first"]) + int(spec["count"])):
            me = NodeInfo(node_id=f"node-{index:05d}", addr=f"10.0.{index // 256}.{index % 256}", local_world_size=8)
            client = RendezvousClient(
                self.shared, self.run_id, me, min_nodes=self.n, max_nodes=self.n,
                join_timeout=timedelta(seconds=RENDEZVOUS_DEADLINE_S), last_call_timeout=timedelta(seconds=1),
                refresh_s=REFRESH_S if self.scalable else None, arrivals=self.mode == "scalable",
            )  # fmt: skip
            self.agents.append(Agent(client, StalenessJudge(TIMEOUT_S)))
        self.sched = Scheduler(threads)
        self.lock = threading.Lock()
        self.out_lock = threading.Lock()
        self.pending = len(self.agents)  # agents still joining, then agents still ticking
        self.settled = threading.Event()
        self.last_join = 0.0
        self.join_times: list[float] = []  # seconds from the start to each agent's join
        self.victim = ""
        self.killed_at = 0.0
        self.reported: set[str] = set()

    def send(self, message: dict[str, Any]) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def _one_settled(self) -> None:
        with self.lock:
            self.pending -= 1
            if self.pending == 0:
                self.settled.set()

    def join(self, start: float) -> dict[str, Any]:
        def join_step(agent: Agent) -> Callable[[], float | None]:
            attempt = Joining(agent.client)

            def step() -> float | None:
                if attempt.step() is not None:
                    attempt.close()
                    agent.joined = True
                    self.last_join = max(self.last_join, time.monotonic())
                    self.join_times.append(time.monotonic() - start)
                    self._one_settled()
                    return None
                return time.monotonic() + (attempt.poll_s if attempt.waits else 0.0)

            return step

        for agent in self.agents:
            # As the agent: its heartbeat starts before it joins and beats on its own thread
            # (HeartbeatSender), through the rendezvous and after it.
            self.sched.at(start, self._beat_step(agent))
            self.sched.at(start, join_step(agent))
        if not self.settled.wait(max(0.0, start + RENDEZVOUS_DEADLINE_S - time.monotonic())):
            return {"joined": None, "count": sum(agent.joined for agent in self.agents)}
        ops, _ = self.shared.totals()
        return {"joined": self.last_join, "ops": ops, "join_times": sorted(self.join_times)}

    def _beat_step(self, agent: Agent) -> Callable[[], float | None]:
        def beat() -> float | None:
            if agent.stopped or agent.over:
                return None
            if agent.heartbeat is None:  # On a store with leases: its own connection (lease, watches)
                agent.liveness = self.shared.own() if self.shared.leases() else self.shared
                me = agent.client.me.node_id
                agent.heartbeat = Heartbeat(
                    agent.liveness, self.run_id, me, interval_s=HEARTBEAT_S, timeout_s=TIMEOUT_S
                )
            else:
                agent.heartbeat.beat()
            return time.monotonic() + agent.heartbeat.period_s

        return beat

    def _report(self, event: str) -> None:
        with self.lock:
            if event in self.reported:
                return
            self.reported.add(event)
        self.send({event: time.monotonic()})

    def tick(self, begin: float) -> None:
        """Every agent's monitor loop from ``begin`` (the first ticks spread over one monitor
        interval, the first heartbeat reads over one heartbeat interval, as real agents are)."""
        state = self.agents[0].client.state()
        ids = [p.node_id for p in state.participants]
        self.victim = ids[len(ids) // 2]
        self.settled.clear()
        self.pending = len(self.agents)
        self.sched.lags.clear()
        first = int(self.agents[0].client.me.node_id.split("-")[1])

        def tick_step(agent: Agent) -> Callable[[], float | None]:
            me = agent.client.me.node_id
            agent.watched = watched_nodes(ids, me, FANOUT if self.scalable else 0)

            def tick() -> float | None:
                again = self._tick(agent, state.round)
                if again is None:
                    self._one_settled()
                return again

            return tick

        for offset, agent in enumerate(self.agents):
            index = first + offset
            agent.next_heartbeat = begin + HEARTBEAT_S * index / self.n
            self.sched.at(begin + MONITOR_S * index / self.n, tick_step(agent))

    def _tick(self, agent: Agent, round_: int) -> float | None:
        """One monitor tick, as the supervisor's: the round, then the heartbeats it watches, read
        at every heartbeat interval and, where the store pushes them, looked at in between."""
        if agent.stopped:
            return None
        agent.ticked = True
        now = time.monotonic()
        if agent.client.state().round != round_:
            agent.over = True
            return None  # the decision was made: the cell is over for this agent
        assert agent.liveness is not None
        full = now >= agent.next_heartbeat
        readings = read_heartbeats(agent.liveness, self.run_id, agent.watched, pushed_only=not full)
        for node, reading in readings.items():
            agent.judge.observe_reading(node, reading)
        if full:
            agent.next_heartbeat = now + HEARTBEAT_S
        if self.victim in agent.judge.stale():
            self._report("detected")
            new = agent.client.next_round(round_, failure={"message": "lost"}, max_restarts=100)
            if new.round != round_:
                self._report("decided")
            agent.over = True
            return None
        if not agent.client.document_watched:
            return now + MONITOR_S
        # The document is pushed, so a tick reads memory only; so does a look at pushed liveness.
        # Such ticks change nothing until the next heartbeat read, or until a watched node heard
        # expired goes stale (the judge knows when): the simulated agent wakes at the first tick
        # of its own grid after either, as the real one would act at that tick. (Ticking 10 times
        # a second costs this simulator, not the agent, what 1,024 agents cannot share 2 cores for.)
        wake = agent.next_heartbeat
        for node, reading in readings.items():
            age = agent.judge.age(node)
            if reading.counter == SILENT and age is not None:
                wake = min(wake, now + TIMEOUT_S - age)
        ticks = max(1, math.ceil((wake - now) / MONITOR_S - 1e-9))
        return min(agent.next_heartbeat, now + ticks * MONITOR_S)

    def warm(self, deadline: float) -> bool:
        """Whether every agent's monitor loop has run once (on etcd: its watches are opening)."""
        while not all(agent.ticked for agent in self.agents):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def sample(self, first: bool) -> dict[str, Any]:
        """Counts so far; the first sample opens the measurement window (the tick lags reported are
        those from then to the kill: the start-up burst is not the steady state)."""
        ops, read = self.shared.totals()
        if first:
            self.sched.lags.clear()
        return {"ops": ops, "bytes": read, "cpu": cpu_s(), "kinds": self.shared.kinds()}

    def kill(self) -> dict[str, Any] | None:
        self.killed_at = time.monotonic()
        for agent in self.agents:
            if agent.client.me.node_id == self.victim:
                agent.stopped = True  # no more ticks, no more heartbeats
                return {"killed": time.monotonic()}
        return None

    def finish(self, deadline: float) -> dict[str, Any]:
        self.settled.wait(max(0.0, deadline - time.monotonic()))
        self.sched.close()
        # How late the tasks ran in the measurement window (from the first sample to the kill: the
        # steady state the detection starts from; what runs after the decision is not steady)
        lags = sorted(lag for ran, lag in self.sched.lags if ran < self.killed_at)
        done: dict[str, Any] = {
            "lag_p99_s": lags[int(0.99 * (len(lags) - 1))] if lags else None,
            "lag_p50_s": lags[len(lags) // 2] if lags else None,
            "document_pushed": any(agent.client.document_watched for agent in self.agents),
            "leased": any(a.heartbeat is not None and a.heartbeat.lease is not None for a in self.agents),
            "doc_bytes": len(self.agents[0].client.state().to_bytes()),
            "errors": len(self.sched.errors),
            "first_error": repr(self.sched.errors[0])[:300] if self.sched.errors else None,
        }
        self.shared.close()
        return {"done": done}


def main() -> None:
    spec = json.loads(sys.argv[1])
    shard = Shard(spec)
    shard.send({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if "go" in command:
            shard.send(shard.join(command["go"]))
        elif "tick" in command:
            shard.tick(command["tick"])
            shard.send({"warm": shard.warm(command["tick"] + DETECT_DEADLINE_S)})
        elif "sample" in command:
            shard.send({"sample": shard.sample(command["sample"] == 1)})
        elif "kill" in command:
            killed = shard.kill()
            shard.send(killed or {"killed": None})
        elif "finish" in command:
            shard.send(shard.finish(command["finish"]))
            return


if __name__ == "__main__":
    main()
