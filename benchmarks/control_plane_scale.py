"""Control plane at scale: N simulated agents (no workers) against a c10d TCPStore and against etcd.

    python benchmarks/control_plane_scale.py [--sizes 64,128,256,512,1024] [--backends c10d,etcd]
        [--modes scalable,scalable-cas,all-to-all] [--procs 8] [--threads 8] [--budget-s 900]
        [--out benchmarks/control_plane_scale]

What an agent does here is what the supervisor does, through the same code: its heartbeat starts
before it joins and beats on as ``HeartbeatSender`` does (``heartbeat.Heartbeat``: a counter bump
every heartbeat interval, 1 s; on etcd a renewal of its liveness lease three times per TTL,
through a connection of its own); it joins with the rendezvous client's own join steps
(``executor.Joining``); then every monitor interval (0.1 s) it reads the rendezvous state and
every heartbeat interval reads the heartbeats it watches (``read_heartbeats``: counters, or on
etcd liveness keys followed by watch) into a ``StalenessJudge`` (5 s timeout). One agent then
stops; the time until another agent judges it stale (detection) and until one of them has opened
the next round with ``next_round`` (decision) is measured.

Modes: ``all-to-all`` is the supervisor before issue 15 (every agent reads the whole state
document every tick and every other agent's counter every interval: O(N^2) store traffic);
``scalable`` is the agent today: it reads the document only when its version counter moves
(``RendezvousClient(refresh_s=...)``; on etcd the document itself is pushed by a watch, one stream per
agent, counted as two operations when opened), watches two ring successors (``heartbeat.watched_nodes``),
and joins through the arrivals lane (rendezvous/executor.py: O(1) store operations per joining
agent, one write admits every arrival so far); ``scalable-cas`` is ``scalable`` with every agent
compare-and-setting itself into the document instead (before the lane), for the lane's ratio.
Joining runs the client's own ``Joining.step``, the code ``RendezvousClient.join`` loops over.

``--backends torchrun`` runs the same N agents through **torchrun's own** c10d rendezvous handler
(``torch.distributed.elastic.rendezvous.dynamic_rendezvous``, unchanged; ``_torchrun_rdzv_agents.py``)
against the same kind of hosted TCPStore, for the rendezvous row's ratio: its agents are threads
in ``TORCHRUN_PROCS`` processes (its API blocks), started together on a ``go`` key.

Agents are tasks on a small pool of threads (one store connection per thread) in ``--procs``
processes (``_scale_agents.py``, driven phase by phase from here), scheduled on the monotonic
clock; when the store (or this 2-core machine) cannot keep up, ticks run late and the lag is
reported. On etcd with leases each agent holds a lease and three watch streams (its document and
two successors), a thread each: a thousand agents' threads in one process run its ticks seconds
late under the GIL (renewals then miss their TTL), hence 8 processes by default; and etcd's
requests are served best by few in flight on these shared cores (2 pool threads per process).
Every phase has a deadline and the whole run a budget, so it stops by itself. Store operations
are counted at the RendezvousBackend interface (the contract calls).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.etcd_server starts etcd

from _scale_agents import (  # noqa: E402
    DETECT_DEADLINE_S,
    FANOUT,
    HEARTBEAT_S,
    MONITOR_S,
    REFRESH_S,
    RENDEZVOUS_DEADLINE_S,
    THREADS,
    TIMEOUT_S,
)
from _scale_agents import cpu_s as _cpu  # noqa: E402

from resilrun.agent.liveness.heartbeat import lease_ttl_s  # noqa: E402

WARMUP_S, MEASURE_S = 2.0, 4.0
TORCHRUN_PROCS = 8  # processes the torchrun agents' threads are spread over (at most N)
TORCHRUN_MODE = "torchrun's handler"


class Fleet:
    """The agent processes of one cell, driven phase by phase over their stdin and stdout."""

    def __init__(self, spec: dict[str, Any], n: int, procs: int) -> None:
        import queue
        import subprocess

        self.inbox: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.last: collections.defaultdict[str, dict[int, dict[str, Any]]] = collections.defaultdict(dict)
        self.events: dict[str, list[float]] = {"detected": [], "decided": []}
        self.children = []
        script = str(Path(__file__).with_name("_scale_agents.py"))
        first = 0
        for p in range(procs):
            count = n // procs + (1 if p < n % procs else 0)
            mine = json.dumps({**spec, "n": n, "first": first, "count": count})
            pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
            child = subprocess.Popen([sys.executable, script, mine], **pipes)
            self.children.append(child)
            threading.Thread(target=self._read, args=(p, child), daemon=True).start()
            first += count

    def _read(self, index: int, child: Any) -> None:
        for line in child.stdout:
            self.inbox.put((index, json.loads(line)))
        self.inbox.put((index, {"exited": child.wait()}))

    def tell(self, command: dict[str, Any]) -> None:
        for child in self.children:
            if child.poll() is None:
                child.stdin.write(json.dumps(command) + "\n")
                child.stdin.flush()

    def answers(self, key: str, timeout_s: float) -> list[Any]:
        """Each process's answer to the last command (its ``key`` value), in process order.

        Raises:
            RuntimeError: a process exited or did not answer in time.
        """
        import queue

        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.children):
            try:
                index, message = self.inbox.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"agent processes did not answer {key!r} in {timeout_s:g} s") from None
            for event in self.events:
                if event in message:
                    self.events[event].append(message[event])
            if "exited" in message and index not in got:
                raise RuntimeError(f"agent process {index} exited ({message['exited']}) before answering {key!r}")
            if key in message:
                got[index] = message[key]
                self.last[key][index] = message
        return [got[index] for index in range(len(self.children))]

    def answered(self, key: str) -> list[dict[str, Any]]:
        """The whole messages of the last ``answers(key)``."""
        return list(self.last[key].values())

    def close(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
            child.wait(10)


def run_cell(store: dict[str, Any], store_pid: int, n: int, mode: str, procs: int, threads: int) -> dict[str, Any]:
    """One (backend, mode, N) measurement, its agents spread over ``procs`` processes of ``threads``
    pool threads each; every phase bounded."""
    run_id = f"scale-{uuid.uuid4().hex[:8]}"
    result: dict[str, Any] = {"n": n, "mode": mode, "procs": procs, "threads": threads}
    fleet = Fleet({**store, "run_id": run_id, "mode": mode, "threads": threads}, n, procs)
    try:
        fleet.answers("ready", 120)
        fleet.tell({"sample": 0})
        before = fleet.answers("sample", 60)
        started, store0 = time.monotonic() + 0.5, _cpu(store_pid)
        fleet.tell({"go": started})
        joins = fleet.answers("joined", RENDEZVOUS_DEADLINE_S + 30)
        if any(t is None for t in joins):
            note = f"rendezvous not complete in {RENDEZVOUS_DEADLINE_S:g} s"
            result.update(rendezvous_s=None, note=note)
            return result
        result["rendezvous_s"] = max(joins) - started
        # When the agents joined (seconds after the start): the tenth, fiftieth and ninetieth percentile
        times = sorted(t for answer in fleet.answered("joined") for t in answer.get("join_times", []))
        result["join_s_p10_p50_p90"] = [round(times[int(len(times) * q)], 2) for q in (0.1, 0.5, 0.9)] or None
        fleet.tell({"sample": 0})
        after, took = fleet.answers("sample", 60), time.monotonic() - started
        # Where the rendezvous's time went on this one machine: the store's CPU, and the
        # simulated agents' own (their joins, and their heartbeats, which run throughout)
        result["rendezvous_store_cpu_pct"] = 100 * (_cpu(store_pid) - store0) / took
        result["rendezvous_sim_cpu_pct"] = 100 * (sum(a["cpu"] for a in after) - sum(b["cpu"] for b in before)) / took

        # and the store operations it asked, per agent (O(1) each, heartbeats included)
        def asked(samples: list[dict[str, Any]], kind: str) -> int:
            return sum(sample["kinds"].get(kind, 0) for sample in samples)

        result["rendezvous_ops_per_agent"] = {
            kind: round((asked(after, kind) - asked(before, kind)) / n, 2)
            for kind in sorted({kind for a in after for kind in a["kinds"]})
        }
        begin = time.monotonic() + 0.2
        fleet.tell({"tick": begin})
        warm = fleet.answers("warm", DETECT_DEADLINE_S + 30)
        result["warmup_s"] = time.monotonic() - begin + WARMUP_S
        if not all(warm):
            result["note"] = "not every agent started its heartbeat"
        time.sleep(WARMUP_S)
        fleet.tell({"sample": 1})
        first, window, store1 = fleet.answers("sample", 60), time.monotonic(), _cpu(store_pid)
        time.sleep(MEASURE_S)
        fleet.tell({"sample": 2})
        second, elapsed, store_cpu = fleet.answers("sample", 60), time.monotonic() - window, _cpu(store_pid) - store1
        ops = sum(b["ops"] for b in second) - sum(a["ops"] for a in first)
        result["store_cpu_pct"] = 100 * store_cpu / elapsed
        result["store_cpu_us_per_op"] = 1e6 * store_cpu / max(ops, 1)
        result["sim_cpu_pct"] = 100 * (sum(b["cpu"] for b in second) - sum(a["cpu"] for a in first)) / elapsed
        result["ops_per_s"] = ops / elapsed
        result["ops_per_agent_s"] = ops / elapsed / n
        read = sum(b["bytes"] for b in second) - sum(a["bytes"] for a in first)
        result["kib_read_per_agent_s"] = read / elapsed / n / 1024
        kinds = {kind for b in second for kind in b["kinds"]}
        result["ops_per_agent_s_by_call"] = {
            kind: sum(b["kinds"].get(kind, 0) for b in second) - sum(a["kinds"].get(kind, 0) for a in first)
            for kind in sorted(kinds)
        }
        for kind, ops in list(result["ops_per_agent_s_by_call"].items()):
            result["ops_per_agent_s_by_call"][kind] = round(ops / elapsed / n, 3)
        fleet.tell({"kill": True})
        killed = next(t for t in fleet.answers("killed", 60) if t is not None)
        fleet.tell({"finish": killed + DETECT_DEADLINE_S})
        done = fleet.answers("done", DETECT_DEADLINE_S + 60)
        detected, decided = fleet.events["detected"], fleet.events["decided"]
        result["detect_s"] = min(detected) - killed if detected else None
        result["decide_s"] = min(decided) - killed if decided else None
        if detected and min(detected) < killed:  # (the window measured a round already over, too)
            result.update(detect_s=None, decide_s=None, ops_per_s=None, ops_per_agent_s=None)
            result["note"] = "the victim was judged lost before it stopped: its renewals ran late on a saturated host"
        lags = [d["lag_p99_s"] for d in done if d["lag_p99_s"] is not None]
        # the slowest process's p99 over the measurement window (from the first sample to the kill)
        result["tick_lag_p99_ms"] = 1000 * max(lags) if lags else None
        p50 = [d["lag_p50_s"] for d in done if d["lag_p50_s"] is not None]
        result["tick_lag_p50_ms"] = 1000 * max(p50) if p50 else None
        result["document_pushed"] = any(d["document_pushed"] for d in done)
        result["leased"] = any(d["leased"] for d in done)
        result["doc_kib"] = done[0]["doc_bytes"] / 1024
        errors = sum(d["errors"] for d in done)
        if errors:
            first_error = next(d["first_error"] for d in done if d["first_error"])
            result["note"] = f"{errors} store errors, first: {first_error}"
        return result
    except RuntimeError as exc:
        result["note"] = str(exc)
        return result
    finally:
        fleet.close()


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


def c10d_store() -> tuple[dict[str, Any], int, Callable[[], None]]:
    """A TCPStore hosted by a child process, as an agent would host it, so its CPU can be measured."""
    port, child = _hosted_store()

    def stop() -> None:
        child.kill()
        child.wait(10)

    return {"backend": "c10d", "port": port}, child.pid, stop


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
            workers.append(subprocess.Popen([*argv, str(RENDEZVOUS_DEADLINE_S)], stdout=subprocess.PIPE, text=True))
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


def etcd_store() -> tuple[dict[str, Any], int, Callable[[], None]]:
    from tests.etcd_server import EtcdCluster

    # tmpfs when there is one: this measures etcd's CPU cost, not this VM's disk (production etcd
    # runs on SSDs with fsync; expect higher write latency there, the same op counts).
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = Path(tempfile.mkdtemp(prefix="resilrun-bench-etcd-", dir=base))
    cluster = EtcdCluster(root).start()

    popen = cluster.members[0].popen
    assert popen is not None

    def stop() -> None:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)

    return {"backend": "etcd", "endpoint": cluster.endpoint}, popen.pid, stop


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _pool(row: dict[str, Any]) -> str:
    if row["mode"] == TORCHRUN_MODE:
        return "—"
    return f"{row.get('procs', 1)} × {row.get('threads', THREADS[row['backend']])}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | mode | N | agent procs × threads | rendezvous (s) | its CPU %: store / agents | detect (s) "
        "| decide (s) | store ops/s | ops/agent/s (demanded) | KiB read/agent/s | tick lag p99 (ms) | store CPU % "
        "| store CPU µs/op | simulator CPU % |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cpu = (
            f"{_fmt(r.get('rendezvous_store_cpu_pct'), 0)} / {_fmt(r.get('rendezvous_sim_cpu_pct'), 0)}"
            if r.get("rendezvous_store_cpu_pct") is not None
            else "—"
        )
        lines.append(
            f"| {r['backend']} | {r['mode']} | {r['n']} | {_pool(r)} "
            f"| {_fmt(r.get('rendezvous_s'))} | {cpu} | {_fmt(r.get('detect_s'))} "
            f"| {_fmt(r.get('decide_s'))} | {_fmt(r.get('ops_per_s'), 0)} "
            f"| {_fmt(r.get('ops_per_agent_s'), 1)} ({_demanded(r)}) "
            f"| {_fmt(r.get('kib_read_per_agent_s'), 1)} | {_fmt(r.get('tick_lag_p99_ms'), 0)} "
            f"| {_fmt(r.get('store_cpu_pct'), 0)} | {_fmt(r.get('store_cpu_us_per_op'), 0)} "
            f"| {_fmt(r.get('sim_cpu_pct'), 0)} |" + (f" {r['note']}" if r.get("note") else "")
        )
    return "\n".join(lines)


def _demanded(row: dict[str, Any]) -> str:
    if row["mode"] == TORCHRUN_MODE or row.get("ops_per_agent_s") is None:
        return "—"
    pushed = bool(row.get("document_pushed") or row.get("version_pushed"))  # (older runs pushed the version)
    asked = demand(row["mode"], row["n"], pushed=pushed, leased=bool(row.get("leased")))
    return f"{asked:.2g}" if asked < 1 else f"{asked:.0f}"


def demand(mode: str, n: int, *, pushed: bool = False, leased: bool = False) -> float:
    """Store ops per agent per second the protocol asks for (what a store that keeps up serves);
    ``pushed``: the document comes by watch, not by a version read every tick and a re-read
    every ``REFRESH_S``; ``leased``: liveness by lease renewals (three per TTL) and watches, not
    counter bumps and reads."""
    reads = 0 if pushed else 1 / MONITOR_S + (1 / REFRESH_S if mode.startswith("scalable") else 0)
    if leased:
        return reads + 3 / lease_ttl_s(HEARTBEAT_S, TIMEOUT_S)
    watched = n - 1 if mode == "all-to-all" else min(FANOUT, n - 1)
    return reads + (1 + watched) / HEARTBEAT_S


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
    parser.add_argument(
        "--procs", type=int, default=8, help="processes the simulated agents are spread over (at most N)"
    )
    parser.add_argument(
        "--threads", type=int, help="pool threads per process (default: c10d 8, etcd 2; _scale_agents.py says why)"
    )
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
        store, store_pid, stop = {"c10d": c10d_store, "etcd": etcd_store}[backend]()
        try:
            for mode in args.modes.split(","):
                saturated = False
                for n in sizes:
                    if time.monotonic() > deadline or saturated:
                        why = "budget spent" if not saturated else "skipped: smaller N already saturated"
                        rows.append({"backend": backend, "mode": mode, "n": n, "note": why})
                        continue
                    threads = args.threads or THREADS[backend]
                    row = {"backend": backend, **run_cell(store, store_pid, n, mode, args.procs, threads)}
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
