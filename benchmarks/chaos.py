"""Chaos: a long job on loopback hit by randomized faults from a seed, and what each one cost.

    python benchmarks/chaos.py --seed 1 --faults 20 --time-budget 900 [--kinds worker_kill,hang] [--json out.json]
    python benchmarks/chaos.py --seeds 1,2,3 --faults 30 --time-budget 3600

One job per seed: ``--nnodes 3 --nproc-per-node 1`` with a hot spare per node, ``--replicas 1``, an
S3 persistent tier (moto's HTTP server behind a fault-injecting proxy, ``_chaos_s3.py``) every
``--persist-every`` steps, and two spare nodes standing by (a lost node is replaced by starting a
new agent, which stands by in turn). The node hosting the rendezvous store is never killed (the
c10d store is a single point of failure by design). Every few steps (``--gap``), after the previous
fault has been recovered, one fault drawn from the seed:

- worker_kill: SIGKILL of a training worker; its node's hot spare takes the rank in-process.
- hang: SIGSTOP of a training worker; the heartbeat timeout catches it, the spare takes over.
- node_loss: SIGKILL of a whole node (agent + workers); a spare node takes its place, restoring
  the lost ranks from peer replicas.
- s3: the next 3-8 S3 requests fail (500, 503 SlowDown, a dropped connection, a 2 s delay);
  uploads retry and a later step is persisted.
- corrupt_replica: node loss, then bytes flipped in every replica of its ranks held by the other
  nodes; the crc32s catch it, the restore plans again and falls back to the persistent tier.
- shm_full: the standby nodes' node-memory allocations fail (RLIMIT_FSIZE on their agents), then
  a node loss; a clear "node memory is full" error, the limit is lifted once it shows, recovery.
- adjacent_nodes: two active nodes SIGKILLed at once (in a ring of three any two are adjacent);
  the job resumes from the persistent tier and says which steps were lost.

Recovery seconds run from the fault to rank 0's first step done in the next generation; steps
redone = the newest step done before the recovery minus the step resumed from. At the end the
final parameters are compared with a failure-free run's, and every process the run ever had,
every memfd of the run held by any process, and /dev/shm are checked for leftovers. Loopback only;
every wait has a deadline; the run stops by itself after ``--faults`` faults or ``--time-budget``.
The seed fixes which fault comes next and whom it hits among the candidates at that moment; the
moments themselves follow the run's timing, so two runs of a seed are alike, not identical.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _chaos_inject import (  # noqa: E402 - benchmarks/ is not a package
    Node,
    alive,
    corrupt_replicas,
    limit_memory,
    memfd_holders,
    memfds,
    node_ranks,
    shm_files,
    stop_process,
)
from _chaos_report import report  # noqa: E402
from _chaos_s3 import FAKE_ENV, S3Chaos  # noqa: E402
from launch_overhead import clean_env  # noqa: E402

KINDS = ("worker_kill", "hang", "node_loss", "s3", "corrupt_replica", "shm_full", "adjacent_nodes")
NODE_KINDS = {"node_loss": 1, "corrupt_replica": 1, "shm_full": 1, "adjacent_nodes": 2}
RECOVERY_TIMEOUT_S = 180.0
_STEP = re.compile(r"^BENCH (\w+) (\d+) (\S+) ([\d.]+)$")


class Job:
    """One chaos job: its nodes, its event log, and the faults injected so far."""

    def __init__(self, seed: int, args: argparse.Namespace, s3: S3Chaos) -> None:
        self.seed, self.args, self.s3 = seed, args, s3
        self.rng = random.Random(seed)
        self.run_id = f"chaos{seed}x{os.getpid()}"
        self.dir = args.out_dir / self.run_id
        self.dir.mkdir(parents=True)
        self.events = self.dir / "events.log"
        port = _free_port()
        self.port = port
        flags = [
            "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", self.run_id,
            "--local-addr", "127.0.0.1", "--replicas", "1", "--spares", "1", "--max-restarts", "3",
            "--heartbeat-timeout", str(args.heartbeat_timeout), "--checkpoint-uri", f"s3://{s3.bucket}/{self.run_id}",
            "--s3-endpoint-url", s3.endpoint_url, "--persist-every", str(args.persist_every), "--keep-last", "2",
        ]  # fmt: skip
        self.cmd = [
            sys.executable,
            "-m",
            "resilrun",
            *flags,
            str(HERE / "_chaos_worker.py"),
            *_script(args, self.events),
        ]
        self.env = clean_env({**FAKE_ENV, "PYTHONUNBUFFERED": "1"})
        self.nodes: list[Node] = []
        self.faults: list[dict[str, Any]] = []
        self.shm_before = shm_files()
        for _ in range(3 + args.spare_nodes):
            self.add_node()

    def add_node(self) -> Node:
        node = Node(self.cmd, self.env, self.dir / f"node{len(self.nodes)}.err", HERE.parent)
        self.nodes.append(node)
        return node

    # -- observation ------------------------------------------------------------------------------
    def parse(self) -> dict[str, list[tuple[str, float]]]:
        out: dict[str, list[tuple[str, float]]] = {"step": [], "first": [], "done": []}
        if not self.events.exists():
            return out
        for line in self.events.read_text(encoding="utf-8", errors="replace").splitlines():
            match = _STEP.match(line)
            if match and match.group(2) == "0":
                event, value, at = match.group(1), match.group(3), float(match.group(4))
                key = "first" if event == "phase" and value == "first" else event
                if key in out:
                    out[key].append((value, at))
        return out

    def newest_step(self, before: float | None = None) -> int:
        steps = [int(v) for v, at in self.parse()["step"] if before is None or at < before]
        return max(steps, default=-1)

    def host(self) -> Node | None:
        return next((n for n in self.nodes if not n.lost and "hosting store" in n.text()), None)

    def active(self) -> list[Node]:
        """Nodes running a training worker (a worker holding node-memory fds)."""
        return [n for n in self.nodes if not n.lost and n.proc.poll() is None and self.training_workers(n)]

    def training_workers(self, node: Node) -> list[Any]:
        return [
            p for p in node.workers() if any(name.startswith(f"resilrun-{self.run_id}-r") for _, name in memfds(p.pid))
        ]

    def standby(self) -> list[Node]:
        return [
            n for n in self.nodes
            if not n.lost and n.proc.poll() is None and "standing by as a spare node" in n.text()
            and not self.training_workers(n)
        ]  # fmt: skip

    def persisted(self, since: float) -> float | None:
        times = [t for n in self.nodes if (t := n.first("persisted for all", since)) is not None]
        return min(times, default=None)

    def finished(self) -> bool:
        return all(n.proc.poll() is not None for n in self.nodes if not n.lost)

    # -- faults ------------------------------------------------------------------------------------
    def eligible(self) -> list[str]:
        kinds = []
        active, spare, host = self.active(), self.standby(), self.host()
        killable = [n for n in active if n is not host]
        persisted = self.persisted(0.0) is not None
        for kind in self.args.kinds:
            need = NODE_KINDS.get(kind, 0)
            if need and (len(spare) < need or len(killable) < need or len(active) < 3):
                continue
            if kind in ("corrupt_replica", "adjacent_nodes") and not persisted:
                continue
            if kind in ("worker_kill", "hang") and len(active) < 3:
                continue
            kinds.append(kind)
        return kinds

    def inject(self, kind: str) -> dict[str, Any]:
        host = self.host()
        killable = [n for n in self.active() if n is not host]
        fault: dict[str, Any] = {"kind": kind, "seed": self.seed, "victims": []}
        fault["step_before"] = self.newest_step()
        if kind in ("worker_kill", "hang"):
            candidates = [w for n in self.active() for w in self.training_workers(n)]
            victim = self.rng.choice(candidates)  # eligible() saw three active nodes just before
            fault["at"] = time.time()
            with contextlib.suppress(psutil.Error):  # it may have died meanwhile: then the fault is that
                victim.kill() if kind == "worker_kill" else stop_process(victim)
            fault["victims"] = [victim]
        elif kind == "s3":
            fault["at"] = time.time()
            fault["modes"] = self.s3.inject(self.rng.randint(3, 8), self.rng)
        else:
            doomed = self.rng.sample(killable, NODE_KINDS[kind])
            ranks = set().union(*(node_ranks(n.pid, self.run_id) for n in doomed))
            if kind == "shm_full":
                fault["limited"] = [n.pid for n in self.standby()]
                for pid in fault["limited"]:
                    limit_memory(pid, 4096)
            fault["at"] = time.time()
            for node in doomed:
                fault["victims"] += node.kill_tree()
            if kind == "corrupt_replica":
                fault["corrupted"] = sum(
                    corrupt_replicas(n.pid, self.run_id, ranks)
                    for n in self.nodes
                    if not n.lost and n.proc.poll() is None
                )
        self.faults.append(fault)
        return fault

    def await_recovery(self, fault: dict[str, Any]) -> None:
        """Until rank 0 has done a step of a generation begun after the fault (or S3 persisted again)."""
        at, deadline = fault["at"], time.time() + RECOVERY_TIMEOUT_S
        lifted = False
        while time.time() < deadline and not self.finished():
            if fault["kind"] == "s3":
                if self.s3.pending() == 0 and (done := self.persisted(at)) is not None:
                    fault["recovered_at"] = done
                    break
            else:
                parsed = self.parse()
                firsts = [t for _, t in parsed["first"] if t > at]
                nxt = [t for _, t in parsed["step"] if firsts and t > min(firsts)]
                if nxt:
                    fault["recovered_at"] = min(nxt)
                    fault["step_resumed_from"] = self.newest_step(before=min(firsts))
                    break
            if fault["kind"] == "shm_full" and not lifted:
                seen = [n.first("node memory is full", at) for n in self.nodes]
                if any(seen) or time.time() - at > 60:
                    for pid in fault["limited"]:
                        limit_memory(pid, None)
                    lifted = True
            time.sleep(0.2)
        if fault["kind"] == "shm_full" and not lifted:
            for pid in fault["limited"]:
                limit_memory(pid, None)
        self.annotate(fault)

    def annotate(self, fault: dict[str, Any]) -> None:
        at = fault["at"]
        text = "\n".join(n.text(at) for n in self.nodes)
        fault["recovered"] = "recovered_at" in fault
        if fault["recovered"]:
            fault["recovery_s"] = fault["recovered_at"] - at
        resumed = [int(m) for m in re.findall(r"rank 0 resumed from step (\d+)", text)]
        if resumed and fault["kind"] != "s3":
            fault["resumed"] = min(resumed)
            fault["redone"] = max(0, fault.get("step_resumed_from", fault["step_before"]) - min(resumed))
        elif fault["kind"] == "s3":
            fault["redone"] = 0
        fault["restarts"] = text.count("restarting the job")
        decided = re.search(r"recovery decided in ([\d.]+) s", text)
        fault["decided_s"] = float(decided.group(1)) if decided else None  # > 1 s: waited for a warming spare
        fault["crc_detected"] = "fail their crc32" in text or "is corrupt" in text
        fault["fell_back"] = "planning the restore again" in text
        fault["clear_error"] = "node memory is full" in text
        fault["from_persistent"] = "(persistent storage)" in text
        time.sleep(1.0)  # an agent reaps a killed worker within a monitor interval
        fault["victims_left"] = len(alive(fault.pop("victims")))

    # -- the run ------------------------------------------------------------------------------------
    def run(self, budget: int, deadline: float) -> dict[str, Any]:
        started = time.time()
        status = "ok"
        try:
            while not self.finished():
                if time.time() > deadline + 600:
                    status = "timeout"
                    break
                injected = len(self.faults)
                if injected < budget and time.time() < deadline and self.ready_for_fault():
                    kinds = self.eligible()
                    if self.args.plan:  # a fixed order (the test suite's run); wait until it is possible
                        planned = self.args.plan[injected % len(self.args.plan)]
                        kinds = [planned] if planned in kinds else []
                    if kinds:
                        fault = self.inject(self.rng.choice(kinds))
                        print(f"  [{self.run_id}] {fault['kind']} at step {fault['step_before']}", file=sys.stderr)
                        self.await_recovery(fault)
                        self.replace_lost()
                        self.next_at = self.newest_step() + self.rng.randint(*self.args.gap)
                        continue
                time.sleep(0.5)
        finally:
            result = self.finish(status, started)
        return result

    next_at = 8

    def ready_for_fault(self) -> bool:
        return self.newest_step() >= self.next_at and self.newest_step() < self.args.steps - 15

    def replace_lost(self) -> None:
        """Start a new agent for each lost node, so spare nodes keep standing by."""
        if self.finished() or any(n.proc.poll() is not None for n in self.nodes if not n.lost):
            return  # an agent that exited by itself means the job ended: new agents would start a new one
        while sum(1 for n in self.nodes if not n.lost) < 3 + self.args.spare_nodes:
            self.add_node()

    def finish(self, status: str, started: float) -> dict[str, Any]:
        end = time.time() + 60  # one allowance for all nodes to exit, not one per node
        codes = []
        for node in (n for n in self.nodes if not n.lost):
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(max(0.1, end - time.time()) if status == "ok" else 0.1)
            codes.append(node.proc.poll())
        time.sleep(2.0)
        procs_left = sum(n.stop() for n in self.nodes)
        holders = memfd_holders(self.run_id)
        done = self.parse()["done"]
        return {
            "seed": self.seed,
            "run_id": self.run_id,
            "status": status if all(c == 0 for c in codes) else f"{status}, exit codes {codes}",
            "wall_s": time.time() - started,
            "checksum": done[-1][0] if done else None,
            "faults": self.faults,
            "leftover_procs": procs_left,
            "leftover_memfd_holders": len(holders),
            "leftover_shm_files": sorted(shm_files() - self.shm_before),
            "steps": self.args.steps,
        }


def _script(args: argparse.Namespace, events: Path) -> list[str]:
    return ["--steps", str(args.steps), "--mib", str(args.mib), "--sleep", str(args.sleep), "--events", str(events)]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_run(args: argparse.Namespace) -> str | None:
    """The failure-free run's final checksum (standalone, same world size and script)."""
    run_dir = args.out_dir / "clean"
    run_dir.mkdir()
    events = run_dir / "events.log"
    cmd = [sys.executable, "-m", "resilrun", "--standalone", "--nproc-per-node", "3", str(HERE / "_chaos_worker.py")]
    node = Node([*cmd, *_script(args, events)], clean_env({}), run_dir / "node.err", HERE.parent)
    try:
        node.proc.wait(600)
    finally:
        node.stop()
    done = [line.split()[3] for line in events.read_text().splitlines() if line.startswith("BENCH done 0 ")]
    return done[-1] if done else None


def merge(args: argparse.Namespace) -> int:
    """One report over several runs' ``--json`` files (a long run done in chunks)."""
    jobs = []
    for path in args.merge:
        data = json.loads(path.read_text(encoding="utf-8"))
        jobs += [{"clean": data["clean"], **job} for job in data["jobs"]]
    args.kinds = list(KINDS)
    print(report(jobs, None, args))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--seeds", default="1", help="comma-separated; one job per seed")
    parser.add_argument("--faults", type=int, default=20, help="faults in total, spread over the seeds")
    parser.add_argument("--time-budget", type=float, default=900.0, help="seconds; no fault starts after it")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--plan", default="", help="fault kinds in this order instead of drawn (repeats)")
    parser.add_argument("--spare-nodes", type=int, default=2, help="agents standing by (adjacent_nodes needs 2)")
    parser.add_argument("--steps", type=int, default=0, help="steps per job (default: from --faults)")
    parser.add_argument("--gap", default="3:8", help="steps between a recovery and the next fault, min:max")
    parser.add_argument("--mib", type=float, default=2.0)
    parser.add_argument("--sleep", type=float, default=0.1)
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0)
    parser.add_argument("--persist-every", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--clean", default=None, help="the failure-free checksum, when already known (same args)")
    parser.add_argument("--merge", type=Path, nargs="*", default=None, help="report on earlier --json files")
    args = parser.parse_args()
    if args.merge:
        return merge(args)
    seeds = [args.seed] if args.seed is not None else [int(s) for s in args.seeds.split(",")]
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.plan = [k for k in args.plan.split(",") if k]
    args.kinds = args.kinds if not args.plan else list(dict.fromkeys(args.plan))
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown --kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    args.gap = tuple(int(x) for x in args.gap.split(":"))
    per_job = -(-args.faults // len(seeds))
    args.steps = args.steps or 40 + per_job * (args.gap[1] + 12)
    args.out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="resilrun-chaos-"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs under {args.out_dir}", file=sys.stderr)
    end = time.time() + args.time_budget
    clean = args.clean or clean_run(args)
    s3 = S3Chaos()
    jobs = []
    try:
        for index, seed in enumerate(seeds):
            left = len(seeds) - index
            budget = min(per_job, args.faults - sum(len(j["faults"]) for j in jobs))
            deadline = time.time() + max(0.0, end - time.time()) / left
            jobs.append({**Job(seed, args, s3).run(budget, deadline), "clean": clean})
            print(f"  seed {seed}: {jobs[-1]['status']}, {len(jobs[-1]['faults'])} faults", file=sys.stderr)
    finally:
        s3.close()
    text = report(jobs, clean, args)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"clean": clean, "jobs": jobs}, indent=1, default=str), encoding="utf-8")
    ok = all(j["status"] == "ok" and j["checksum"] == clean for j in jobs)
    return 0 if ok and all(f["recovered"] for j in jobs for f in j["faults"]) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # unwind: the nodes get stopped
    sys.exit(main())
