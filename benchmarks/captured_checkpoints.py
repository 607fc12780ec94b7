"""Scripts that checkpoint themselves (issue 45, ``--capture-dir``): torchrun vs resilrun, side by side.

    python benchmarks/captured_checkpoints.py [--runs 3] [--json out.json]     # about 15 minutes
    python benchmarks/captured_checkpoints.py --quick          # 1 run each, 16 MiB: about 4 minutes
    python benchmarks/captured_checkpoints.py --scenarios a,b  # leave out the network namespaces
    python benchmarks/captured_checkpoints.py --launchers torchrun,resilrun-capture

Every launch runs the script PyTorch's DDP fault-tolerance tutorial teaches
(examples/train_snapshot_torchrun.py: every node's local rank 0 ``torch.save``s ``snapshot.pt``
every ``save_every`` epochs, every worker loads it at start if it exists) from a fresh folder of
its own, unmodified, under three launchers: ``torchrun`` (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1:
its shared store breaks its restarts, see recovery.py), ``resilrun`` (what it did before issue 45)
and ``resilrun-capture`` (``--capture-dir . --capture-pattern snapshot.pt``). Three scenarios:

A. One host, ``--standalone --nproc-per-node 2 --max-restarts 1``, the model widened
   (``--hidden``) so that a snapshot is ``--mib`` MiB and its save takes measurable time. The
   benchmark SIGKILLs rank 1 (the worker process whose RANK is 1, found under the launcher) the
   moment its "Epoch ``--kill-after`` done" line arrives, between two saves. Reported: recovered
   (exit 0, both ranks finished), kill -> training again (both ranks printed the tutorial's
   "Epoch E | Batchsize" line of the epoch they resumed at: its first batch runs next; the
   tutorial's granularity is an epoch, this is its "next step"), kill -> the next "Epoch E done"
   after the restart (one whole epoch more), epochs
   redone (epochs done before the kill minus the epoch it resumed at; the tutorial saves
   ``EPOCHS_RUN = epoch`` after an epoch, so it redoes the saved one), the save time (median of
   the script's "saved in X s" lines) and, for reference, a memcpy of as many bytes as the
   snapshot file into pre-faulted memory, in this process (median of 5). The issue's targets: a
   save stalls training <= 1.5x that memcpy, and no more epochs are redone than the save interval.
B. One host, the same script with its epoch-``--torn-epoch`` save torn by the writer's death
   (tests/helpers/torn_save.py: half the bytes written over the previous snapshot, then SIGKILL),
   ``--max-restarts 2``. Recovered or not, and why: without capture every restart's ``torch.load``
   meets the truncated zip; with it, the agent puts the last complete snapshot back first.
C. Three hosts in network namespaces (tests/helpers/netns_cluster.py; root only, else skipped
   with the reason), each running from a folder of its own (no shared file system), two training
   (``--nnodes 2 --nproc-per-node 1``, rendezvous on h0); once h0 has saved epoch ``--c-drop-at``,
   h1 drops off (its link cut, then its processes SIGKILLed). The replacement: for torchrun a
   third agent started on h2 right after the loss (``--nnodes 1:2 --max-restarts 1``, c10d on h0:
   the survivor's agent sees it waiting and re-rendezvouses; torchrun also needs ``--local-addr``
   and ``GLOO_SOCKET_IFNAME`` there); for resilrun-capture h2 started beforehand as a spare node
   (``--replicas 1 --heartbeat-timeout 3 --max-restarts 2``), as in
   tests/integration/test_captured_checkpoints.py. Reported: finished or not (both launchers exit
   0, ranks 0 and 1 print their last line), the epoch each host's rank resumed at after the loss,
   loss -> every rank done with its first epoch after resuming, how long each launcher took to
   exit after its worker finished, whether the final checksums of all ranks are equal, and, per
   run, what each host's workers did (read from their own lines). A launcher whose worker finished
   and that stays silent for ``--linger`` seconds is killed and reported as such: torchrun's agent
   waits up to 300 s in its exit barrier for a node that is not coming back.

Why this shape: on a 2-core machine timings drift with load, so within a scenario the launchers
run interleaved (run i rotates the order, ``--runs`` each) and figures are medians with min-max.
Every launch is bounded (``--timeout``; ``--stall`` seconds without a new output line means hung),
its whole process tree is killed on every exit path (SIGTERM and Ctrl-C included) and counted, the
namespaces are removed, and every launch's output is kept under ``--out-dir``. Snapshots are
deleted after each run (their size is recorded). Exits 1 if a resilrun-capture run did not recover.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from launch_overhead import clean_env, fmt, median

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests.helpers.netns_cluster import Cluster, available  # noqa: E402 - the test suite's fixture

TUTORIAL = HERE.parent / "examples" / "train_snapshot_torchrun.py"
NANOGPT = HERE / "_nanogpt_resume.py"
DCP_LOOP = HERE.parent / "examples" / "train_dcp.py"
TORN = HERE.parent / "tests" / "helpers" / "torn_save.py"
CAPTURE = ["--capture-dir", ".", "--capture-pattern", "snapshot.pt"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RESILRUN = [sys.executable, "-m", "resilrun"]
# name -> (launcher argv up to its own flags, extra environment)
LAUNCHERS: dict[str, tuple[list[str], dict[str, str]]] = {
    "torchrun": (TORCHRUN, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
    "resilrun": (RESILRUN, {}),
    "resilrun-capture": ([*RESILRUN, *CAPTURE], {}),
    # the survivors re-run the script in their processes, a hot spare takes the killed rank
    "resilrun-rerun": ([*RESILRUN, *CAPTURE, "--spares", "1", "--rerun-in-process"], {}),
}
# What torchrun gives 2+ workers on a node; set for every launch so that all launchers compute alike.
ENV = {"OMP_NUM_THREADS": "1"}
PORT = 29400  # the rendezvous port in scenario C: every host has a network of its own
# Model width: parameters are 22 * hidden + 1 fp32 (Linear(20, h), Linear(h, 1)).
BYTES_PER_HIDDEN = 22 * 4

DONE = re.compile(r"\[rank (\d+)\] Epoch (\d+) done")
STARTED = re.compile(r"\[rank (\d+)\] Epoch (\d+) \| Batchsize")  # the tutorial's line as an epoch starts
SAVED = re.compile(r"Epoch (\d+) \| Training snapshot saved at \S+ in ([\d.]+) s")
RESUMED = re.compile(r"\[rank (\d+)\] Resuming training from snapshot at Epoch (\d+)")
FINISHED = re.compile(r"\[rank (\d+)\] finished at epoch \d+ checksum (\w+)")
LOADING = re.compile(r"\[rank (\d+)\] Loading snapshot")
TORN_LOAD = re.compile(r"PytorchStreamReader failed[^.\n]*")


class Launch:
    """One launcher process: stdout and stderr lines stamped on arrival (and kept in files), every
    descendant ever seen remembered, because torchrun puts its workers in a session of their own
    and a process group kill alone would leave them running."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: Path,
        log: Path,
        on_out: Callable[[Launch, float, str], None] | None = None,
    ) -> None:
        self.out: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self._seen_lock = threading.Lock()  # the main loop and a stdout callback both track
        self._on_out = on_out
        self.started = time.time()
        self.exited_at: float | None = None  # first seen exited (to within a poll)
        self.proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            text=True, errors="replace", start_new_session=True,
        )  # fmt: skip
        self._pumps = [
            threading.Thread(
                target=self._pump, args=(self.proc.stdout, self.out, log.with_suffix(".out")), daemon=True
            ),
            threading.Thread(
                target=self._pump, args=(self.proc.stderr, self.err, log.with_suffix(".err")), daemon=True
            ),
        ]
        for pump in self._pumps:
            pump.start()

    def _pump(self, stream: Any, lines: list[tuple[float, str]], path: Path) -> None:
        with path.open("w", encoding="utf-8") as sink:
            for line in stream:
                at = time.time()
                lines.append((at, line.rstrip("\n")))
                sink.write(line)
                if self._on_out is not None and lines is self.out:
                    self._on_out(self, at, line)

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.exited_at is None:
            self.exited_at = time.time()
        return code

    def lingers(self, quiet_s: float) -> bool:
        """Its workers printed "finished" last and it has said nothing for ``quiet_s``: a launcher
        waiting on others (torchrun's exit barrier waits up to 300 s for nodes that never come)."""
        lines = [lines[-1] for lines in (self.out, self.err) if lines]
        if not self.out or not FINISHED.search(self.out[-1][1]):
            return False
        return time.time() - max(at for at, _ in lines) > quiet_s

    def text(self, stream: str = "out") -> str:
        return "\n".join(line for _, line in (self.out if stream == "out" else self.err))

    def track(self) -> list[psutil.Process]:
        with self._seen_lock:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        self.seen.setdefault((child.pid, child.create_time()), child)
            return list(self.seen.values())

    def workers(self, rank: int) -> list[psutil.Process]:
        """The live processes running ``rank`` (its RANK in the environment; not a warm spare)."""
        found = []
        for proc in self.track():
            with contextlib.suppress(psutil.Error):
                env = proc.environ()
                if env.get("RANK") == str(rank) and env.get("RESILRUN_SPARE") != "1" and _running(proc):
                    found.append(proc)
        return found

    def kill_all(self) -> float:
        """SIGKILL the launcher and every process it ever had at once (a host going away)."""
        victims = [*self.track()]
        with contextlib.suppress(psutil.Error):
            victims.insert(0, psutil.Process(self.proc.pid))
        at = time.time()
        for proc in victims:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        return at

    def stop(self) -> int:
        """Kill whatever is left of the tree; returns how many processes still ran (a finding in itself)."""
        left = 0
        tree = self.track()
        if self.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                tree.insert(0, psutil.Process(self.proc.pid))
        else:  # a launcher that exited reaped its workers; give a dying one a moment
            deadline = time.time() + 3
            while time.time() < deadline and any(_running(p) for p in tree):
                time.sleep(0.1)
        for proc in tree:
            with contextlib.suppress(psutil.Error):
                if _running(proc):
                    proc.kill()
                    left += 1
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for pump in self._pumps:
            pump.join(timeout=10)
        return left


def _running(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False


def parse(lines: list[tuple[float, str]]) -> dict[str, list[tuple[float, int, Any]]]:
    """The script's lines, stamped: done/resumed/loading (t, rank, epoch), saved (t, epoch, seconds),
    finished (t, rank, checksum). Workers share one pipe, so two lines may arrive glued together."""
    found: dict[str, list[tuple[float, int, Any]]] = {
        k: [] for k in ("done", "started", "resumed", "loading", "saved", "finished")
    }
    for at, line in lines:
        found["done"] += [(at, int(m[1]), int(m[2])) for m in DONE.finditer(line)]
        found["started"] += [(at, int(m[1]), int(m[2])) for m in STARTED.finditer(line)]
        found["resumed"] += [(at, int(m[1]), int(m[2])) for m in RESUMED.finditer(line)]
        found["loading"] += [(at, int(m[1]), None) for m in LOADING.finditer(line)]
        found["saved"] += [(at, int(m[1]), float(m[2])) for m in SAVED.finditer(line)]
        found["finished"] += [(at, int(m[1]), m[2]) for m in FINISHED.finditer(line)]
    return found


def restored_from(launch: Launch) -> list[dict[str, Any]]:
    """resilrun's ``captured_restored`` events (docs/status.md), from the events file of the log
    folder its agent names ("logs in DIR")."""
    records = []
    for root in dict.fromkeys(re.findall(r"logs in (\S+)", launch.text("err"))):
        path = Path(root) / "events.jsonl"
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    record = json.loads(line)
                    if record.get("event") == "captured_restored":
                        records.append(record)
    return records


def wait_until(what: str, predicate: Callable[[], bool], launches: list[Launch], limit_s: float) -> None:
    """Poll ``predicate`` (tracking every launch's processes) until true; TimeoutError after ``limit_s``."""
    deadline = time.time() + limit_s
    while not predicate():
        for launch in launches:
            launch.track()
        if time.time() > deadline:
            raise TimeoutError(f"{what}: not within {limit_s:.0f} s")
        time.sleep(0.05)


def settle(launches: list[Launch], since: float, args: argparse.Namespace, linger_s: float | None = None) -> str:
    """Wait for every launch to exit: ok; lingered (with ``linger_s``: those not exited had finished
    their training and stayed silent that long); timeout; hung (no output line for ``--stall`` s)."""
    while True:
        for launch in launches:
            launch.track()
        exited = [launch.poll() is not None for launch in launches]
        if all(exited):
            return "ok"
        if linger_s is not None and all(
            done or launch.lingers(linger_s) for done, launch in zip(exited, launches, strict=True)
        ):
            return "lingered"
        now = time.time()
        if now - since > args.timeout:
            return "timeout"
        newest = max([since] + [lines[-1][0] for launch in launches for lines in (launch.out, launch.err) if lines])
        if now - newest > args.stall:
            return "hung"
        time.sleep(0.1)


def tutorial(epochs: int, every: int, hidden: int, sleep: float = 0.0) -> list[str]:
    """The tutorial script's arguments (after the script's path)."""
    argv = [str(epochs), str(every), "--hidden", str(hidden)]
    return argv + (["--sleep", str(sleep)] if sleep else [])


def summary(tag: str, res: dict[str, Any], keys: tuple[str, ...]) -> None:
    parts = [f"{k} {res[k]:.2f} s" if isinstance(res[k], float) else f"{k} {res[k]}" for k in keys if k in res]
    print(f"  {tag}: {res['status']} (rc {res.get('rc')}), {', '.join(parts)}", file=sys.stderr, flush=True)


# -- scenario A: rank 1 SIGKILLed between two saves ----------------------------------------------
def run_a(name: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One launch of the tutorial script, rank 1 killed as its "Epoch --kill-after done" arrives."""
    run_dir = args.out_dir / tag
    work = run_dir / "work"
    work.mkdir(parents=True)
    prefix, extra = LAUNCHERS[name]
    cmd = [*prefix, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    if name.startswith("resilrun"):
        cmd += ["--log-dir", str(run_dir / "logs")]
    cmd += [str(TUTORIAL), *tutorial(args.epochs, args.save_every, args.hidden), "--batch_size", str(args.batch)]
    trigger = f"[rank 1] Epoch {args.kill_after} done"
    res: dict[str, Any] = {"scenario": "A", "launcher": name, "tag": tag, "kill": None}

    def on_out(launch: Launch, at: float, line: str) -> None:
        if res["kill"] is None and "killed_pids" not in res and trigger in line:
            victims = launch.workers(1)
            res["killed_pids"] = [p.pid for p in victims]
            if victims:  # none found: the run goes on unharmed and is reported as "no kill"
                res["kill"] = time.time()
            for proc in victims:
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    launch = Launch(cmd, clean_env({**ENV, **extra}), work, run_dir / "launcher", on_out)
    try:
        res["status"] = settle([launch], launch.started, args)
    finally:
        res["leftovers"] = launch.stop()
    res["rc"], res["wall"] = launch.proc.returncode, time.time() - launch.started
    snapshot = work / "snapshot.pt"
    res["snapshot_bytes"] = snapshot.stat().st_size if snapshot.exists() else None
    shutil.rmtree(work, ignore_errors=True)
    _analyze_a(res, parse(launch.out), args)
    summary(tag, res, ("to_training", "to_next", "resumed_at", "redone", "save_s"))
    return res


def _analyze_a(res: dict[str, Any], seen: dict[str, list[tuple[float, int, Any]]], args: argparse.Namespace) -> None:
    kill = res["kill"]
    finished = {rank for _, rank, _ in seen["finished"]}
    if res["status"] == "ok" and (res["rc"] != 0 or finished != {0, 1}):
        res["status"] = "failed" if res["rc"] else "incomplete"
    res["save_s"] = statistics.median(s for _, _, s in seen["saved"]) if seen["saved"] else None
    rank0 = [t for t, rank, _ in seen["done"] if rank == 0 and (kill is None or t < kill)]
    res["epoch_s"] = (
        statistics.median(b - a for a, b in zip(rank0, rank0[1:], strict=False)) if len(rank0) > 2 else None
    )
    if kill is None:
        res["status"] = "no kill" if res["status"] == "ok" else res["status"]
        return
    before = [epoch for t, _, epoch in seen["done"] if t <= kill]
    res["done_before"] = max(before) + 1 if before else 0
    resumes = [(t, epoch) for t, _, epoch in seen["resumed"] if t > kill]
    # No resume line after the kill: the restart found no snapshot and began again at epoch 0.
    res["resumed_at"] = min(epoch for _, epoch in resumes) if resumes else 0
    res["redone"] = res["done_before"] - res["resumed_at"]
    start = resumes[0][0] if resumes else kill
    after = [t for t, _, epoch in seen["done"] if t > start and (resumes or epoch < args.kill_after)]
    if after:
        res["to_next"] = after[0] - kill
    # Training again: every rank has started the epoch it resumed at (its first batch runs next).
    again = {
        rank: min((t for t, r, epoch in seen["started"] if r == rank and t > start and epoch == res["resumed_at"]),
                  default=None)
        for rank in (0, 1)
    }  # fmt: skip
    if all(t is not None for t in again.values()):
        res["to_training"] = max(t for t in again.values() if t is not None) - kill


def memcpy_s(nbytes: int, reps: int = 5) -> float:
    """A memcpy of ``nbytes`` between two buffers already faulted in: the floor a save is held to."""
    src, dst = bytearray(b"\x5a") * nbytes, bytearray(nbytes)  # written: no page left to the zero page
    dst[:] = src
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        dst[:] = src
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# -- scenario B: a save torn by its writer's death -----------------------------------------------
def run_b(name: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One launch of the torn-save script with ``--max-restarts 2``."""
    run_dir = args.out_dir / tag
    work = run_dir / "work"
    work.mkdir(parents=True)
    prefix, extra = LAUNCHERS[name]
    cmd = [*prefix, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
    if name.startswith("resilrun"):
        cmd += ["--log-dir", str(run_dir / "logs")]
    cmd += [str(TORN), *tutorial(args.torn_epochs, args.torn_every, args.torn_hidden)]
    env = clean_env({**ENV, **extra, "TORN_SAVE_EPOCH": str(args.torn_epoch)})
    launch = Launch(cmd, env, work, run_dir / "launcher")
    res: dict[str, Any] = {"scenario": "B", "launcher": name, "tag": tag}
    try:
        res["status"] = settle([launch], launch.started, args)
    finally:
        res["leftovers"] = launch.stop()
    res["rc"], res["wall"] = launch.proc.returncode, time.time() - launch.started
    shutil.rmtree(work, ignore_errors=True)
    seen = parse(launch.out)
    finished = {rank for _, rank, _ in seen["finished"]}
    if res["status"] == "ok" and (res["rc"] != 0 or finished != {0, 1}):
        res["status"] = "failed" if res["rc"] else "incomplete"
    res["resumed_at"] = sorted({epoch for _, _, epoch in seen["resumed"]})
    res["loads"] = sum(rank == 0 for _, rank, _ in seen["loading"])  # attempts that found a snapshot
    res["load_failed"] = sorted(set(TORN_LOAD.findall(launch.text("out") + "\n" + launch.text("err"))))[:1]
    res["restored"] = [{"files": r.get("files"), "sources": r.get("sources")} for r in restored_from(launch)]
    res["why"] = _why_b(res)
    summary(tag, res, ("resumed_at", "loads", "why"))
    return res


def _why_b(res: dict[str, Any]) -> str:
    sources = ", ".join(f"{n} from {tier}" for r in res["restored"] for tier, n in (r["sources"] or {}).items())
    if res["status"] == "ok":
        put_back = f"; snapshot.pt put back before the restart ({sources})" if sources else ""
        return f"resumed at epoch {'/'.join(map(str, res['resumed_at'])) or '0'}{put_back}"
    if res["load_failed"]:
        return f"each of the {res['loads']} restarts failed in torch.load: {res['load_failed'][0]}"
    return f"{res['status']} (rc {res['rc']}), see the logs"


# -- scenario C: a host lost, each host with its own folder --------------------------------------
def run_c(name: str, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Two hosts train, h1 drops off after h0's epoch ``--c-drop-at`` save, h2 takes its place."""
    run_dir = args.out_dir / tag
    folders = {host: run_dir / f"{host}_folder" for host in ("h0", "h1", "h2")}
    for folder in folders.values():
        folder.mkdir(parents=True)
    res: dict[str, Any] = {"scenario": "C", "launcher": name, "tag": tag}
    train = [str(TUTORIAL), *tutorial(args.c_epochs, args.c_save_every, args.c_hidden, args.c_sleep)]
    launches: dict[str, Launch] = {}
    cluster = Cluster(3).__enter__()
    try:

        def start(host: str, *extra: str) -> Launch:
            address = cluster.host(host).addr
            if name == "torchrun":
                flags = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d"]
                flags += ["--rdzv-endpoint", f"h0:{PORT}", "--local-addr", address]
                env = clean_env({**ENV, **LAUNCHERS[name][1], "GLOO_SOCKET_IFNAME": "eth0"})
                argv = [*TORCHRUN, *flags, *train]
            else:
                flags = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1"]
                flags += ["--heartbeat-timeout", "3", "--max-restarts", "2", *CAPTURE]
                flags += ["--log-dir", str(run_dir / f"logs_{host}"), *extra]
                env, argv = clean_env(ENV), [*RESILRUN, *flags, *train]
            launches[host] = Launch(cluster.command(host, argv), env, folders[host], run_dir / host)
            return launches[host]

        first = [start("h0", "--node-rank", "0"), start("h1", "--node-rank", "1")]
        if name != "torchrun":
            wait_until("round 0", lambda: any("round 0 formed" in n.text("err") for n in first), first, args.timeout)
            spare = start("h2")
            wait_until("the spare", lambda: "standing by as a spare node" in spare.text("err"), first, args.timeout)
        saved = f"Epoch {args.c_drop_at} | Training snapshot saved"
        wait_until("h0's save", lambda: saved in launches["h0"].text(), list(launches.values()), args.timeout)
        cluster.cut("h1")
        res["loss"] = launches["h1"].kill_all()
        if name == "torchrun":
            start("h2")  # the replacement host, started after the loss as a scheduler would
        remaining = [launches["h0"], launches["h2"]]
        res["status"] = settle(remaining, res["loss"], args, linger_s=args.linger)
    except TimeoutError as exc:
        res["status"], res["error"] = "timeout", str(exc)
    finally:
        res["killed_at_end"] = [
            host for host, launch in launches.items() if host != "h1" and launch.proc.poll() is None
        ]
        res["leftovers"] = sum(launch.stop() for launch in launches.values())
        cluster.kill_all()
        cluster.close()
    res["exit_codes"] = {host: launch.proc.returncode for host, launch in launches.items() if host != "h1"}
    res["rc"] = res["exit_codes"]
    for folder in folders.values():
        shutil.rmtree(folder, ignore_errors=True)
    _analyze_c(res, launches)
    summary(tag, res, ("to_all_past", "resumed", "checksums_equal", "what"))
    return res


def sessions(lines: list[tuple[float, str]]) -> list[dict[str, Any]]:
    """The worker runs a host's output shows, in order: each starts with a resume line (or, with no
    snapshot to load, an "Epoch 0 done") and ends with its "finished" line or with the next start."""
    found: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for at, line in lines:
        for match in re.finditer(f"{RESUMED.pattern}|{DONE.pattern}|{FINISHED.pattern}", line):
            text = match[0]
            if (resumed := RESUMED.fullmatch(text)) is not None:
                current = {
                    "rank": int(resumed[1]),
                    "from": int(resumed[2]),
                    "snapshot": True,
                    "first_done": None,
                    "last": -1,
                }
                found.append(current)
            elif (done := DONE.fullmatch(text)) is not None:
                rank, epoch = int(done[1]), int(done[2])
                if epoch == 0 and (current is None or current["last"] > 0):  # a start with no snapshot
                    current = {"rank": rank, "from": 0, "snapshot": False, "first_done": None, "last": -1}
                    found.append(current)
                if current is not None:
                    current["first_done"] = current["first_done"] or at
                    current["last"] = epoch
            elif (finished := FINISHED.fullmatch(text)) is not None and current is not None:
                current["checksum"] = finished[2]
                current = None
    for run in found:
        run.setdefault("checksum", None)
    return found


def _analyze_c(res: dict[str, Any], launches: dict[str, Launch]) -> None:
    loss = res.get("loss")
    if loss is None or "h2" not in launches:
        res.update(finished=False, checksums_equal=False)
        return
    runs = {host: sessions([(t, line) for t, line in launches[host].out if t > loss]) for host in ("h0", "h2")}
    res["sessions"] = runs
    last = [found[-1] for found in runs.values() if found]
    ranks = {s["rank"] for s in last if s["checksum"] is not None}
    if res["status"] == "ok" and (any(res["exit_codes"].values()) or len(last) < 2 or ranks != {0, 1}):
        res["status"] = "not finished"
    res["finished"] = res["status"] == "ok"
    res["checksums_equal"] = len(last) == 2 and len({s["checksum"] for s in last} - {None}) == 1 and ranks == {0, 1}
    res["resumed"] = "; ".join(
        f"{host}: " + (", then ".join(f"{s['from']}{'' if s['snapshot'] else ' (no snapshot)'}" for s in found) or "—")
        for host, found in runs.items()
    )
    # How long each launcher took to exit after its worker's "finished" line (None: still running, killed).
    tails = {}
    for host in runs:
        ends = [at for at, line in launches[host].out if FINISHED.search(line)]
        exited = launches[host].exited_at
        tails[host] = exited - ends[-1] if ends and exited is not None else None
    res["exit_tails"] = tails
    firsts = [found[0]["first_done"] for found in runs.values() if found and found[0]["first_done"] is not None]
    if len(firsts) == len(runs):
        res["to_all_past"] = max(firsts) - loss
    res["what"] = "; ".join(
        _story(host, found, launches[host], host in res["killed_at_end"]) for host, found in runs.items()
    )


def _story(host: str, found: list[dict[str, Any]], launch: Launch, killed: bool) -> str:
    """What one host did after the loss, from its workers' lines and its launcher's exit."""
    steps = []
    for s in found:
        start = f"rank {s['rank']} from epoch {s['from']}{'' if s['snapshot'] else ' (no snapshot)'}"
        end = f"finished, checksum {s['checksum'][:8]}" if s["checksum"] else "did not finish"
        steps.append(f"{start}, last epoch done {s['last']}, {end}")
    exited = f"exit {launch.proc.returncode}"
    if killed:
        exited = "launcher still running at the end, killed"
        if found and found[-1]["checksum"]:
            exited = "launcher still running after its worker finished, killed"
    return f"{host}: {', '.join(steps) or 'no worker ran'}; {exited}"


# -- scenario D: loops that log every step (nanoGPT's shape, a DCP loop) ---------------------------
# name -> (script and its arguments, the folder its checkpoints go to, its step line, its resume line,
# its save line with the seconds a save took). Only rank 0 logs its steps, as both loops do.
STEP_LOOPS: dict[str, tuple[list[str], str, re.Pattern[str], re.Pattern[str], re.Pattern[str]]] = {
    "nanogpt": (
        [str(NANOGPT), "--max_iters=50", "--eval_interval=10", "--sleep=0.05"],
        "out",
        re.compile(r"^iter (\d+): loss"),
        re.compile(r"resuming training from \S+ at iter (\d+)"),
        re.compile(r"saving checkpoint to \S+ in ([\d.]+) s"),
    ),
    "dcp": (
        [str(DCP_LOOP), "--steps", "50", "--save-every", "10", "--hidden", "2048", "--log-every", "1",
         "--sleep", "0.05"],
        "ckpt",
        re.compile(r"^step (\d+) loss"),
        re.compile(r"\[rank 0\] resumed from \S+ at step (\d+)"),
        re.compile(r"saved step-\d+ in ([\d.]+) s"),
    ),
}  # fmt: skip


def launcher_argv(name: str, capture_dir: str) -> list[str]:
    """A launcher of LAUNCHERS, its captured folder the script's checkpoint folder."""
    prefix = LAUNCHERS[name][0]
    if CAPTURE[0] in prefix:
        at = prefix.index(CAPTURE[0])
        prefix = [*prefix[:at], "--capture-dir", capture_dir, *prefix[at + len(CAPTURE) :]]
    return prefix


def run_d(name: str, args: argparse.Namespace, tag: str, loop: str) -> dict[str, Any]:
    """One launch of a step-logging loop, rank 1 killed as rank 0 logs step ``--d-kill-at``."""
    script, folder, step_line, resume_line, save_line = STEP_LOOPS[loop]
    run_dir = args.out_dir / tag
    work = run_dir / "work"
    work.mkdir(parents=True)
    cmd = [*launcher_argv(name, folder), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    if name.startswith("resilrun"):
        cmd += ["--log-dir", str(run_dir / "logs")]
    res: dict[str, Any] = {"scenario": "D", "loop": loop, "launcher": name, "tag": tag, "kill": None}

    def on_out(launch: Launch, at: float, line: str) -> None:
        found = step_line.search(line)
        if res["kill"] is None and "killed_pids" not in res and found and int(found[1]) == args.d_kill_at:
            victims = launch.workers(1)
            res["killed_pids"] = [p.pid for p in victims]
            if victims:
                res["kill"] = time.time()
            for proc in victims:
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    launch = Launch([*cmd, *script], clean_env({**ENV, **LAUNCHERS[name][1]}), work, run_dir / "launcher", on_out)
    try:
        res["status"] = settle([launch], launch.started, args)
    finally:
        res["leftovers"] = launch.stop()
    res["rc"] = launch.proc.returncode
    shutil.rmtree(work, ignore_errors=True)
    if res["status"] == "ok" and res["rc"] != 0:
        res["status"] = "failed"
    lines = [(t, line) for t, text in launch.out for line in text.split("\n")]
    steps = [(t, int(m[1])) for t, line in lines if (m := step_line.search(line))]
    saves = [float(m[1]) for _, line in lines if (m := save_line.search(line))]
    res["save_s"] = statistics.median(saves) if saves else None
    kill = res["kill"]
    if kill is None:
        res["status"] = "no kill" if res["status"] == "ok" else res["status"]
    else:
        newest = max((step for t, step in steps if t <= kill), default=-1)
        resumes = [(t, int(m[1])) for t, line in lines if t > kill and (m := resume_line.search(line))]
        res["resumed_at"] = resumes[0][1] if resumes else 0
        res["redone"] = newest + 1 - res["resumed_at"]
        start = resumes[0][0] if resumes else kill
        again = [t for t, step in steps if t > start and (resumes or step <= newest)]
        if again:
            res["to_training"] = again[0] - kill
        beyond = [t for t, step in steps if t > kill and step > newest]
        if beyond:
            res["to_progress"] = beyond[0] - kill
    summary(tag, res, ("to_training", "to_progress", "resumed_at", "redone", "save_s"))
    return res


def report_d(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    md = [
        f"D. loops that log every step, one host, 2 workers, rank 1 SIGKILLed as rank 0 logs step {args.d_kill_at} "
        "(a checkpoint every 10 steps)",
        "",
        "| loop | launcher | recovered | kill → next step (s) | ÷ torchrun | kill → progress regained (s) "
        "| ÷ torchrun | resumed at | steps redone | save (ms) | leftover procs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for loop in dict.fromkeys(r["loop"] for r in runs):
        mine = [r for r in runs if r["loop"] == loop]
        theirs = torchrun_medians(mine, ("to_training", "to_progress"))
        for name in LAUNCHERS:
            rows = [r for r in mine if r["launcher"] == name]
            ok = [r for r in rows if r["status"] == "ok"]
            bad = ", ".join(r["status"] for r in rows if r["status"] != "ok")
            again, progress = ([r[key] for r in ok if key in r] for key in ("to_training", "to_progress"))
            md.append(
                f"| {loop} | {name} | {len(ok)}/{len(rows)}{f' ({bad})' if bad else ''} | {fmt(again)} | "
                f"{median(again) / theirs['to_training']:.2f}x | {fmt(progress)} | "
                f"{median(progress) / theirs['to_progress']:.2f}x | {_set(ok, 'resumed_at')} | {_set(ok, 'redone')} | "
                f"{fmt([r['save_s'] for r in rows if r.get('save_s') is not None], 1e3, 0)} | "
                f"{sum(r['leftovers'] for r in rows)} |"
            )
    return "\n".join(md)


# -- report --------------------------------------------------------------------------------------
def report_a(runs: list[dict[str, Any]], memcpy: dict[int, float], args: argparse.Namespace) -> str:
    sizes = sorted({r["snapshot_bytes"] for r in runs if r.get("snapshot_bytes")})
    copy = statistics.median(memcpy[s] for s in sizes) if sizes else float("nan")
    md = [
        f"A. one host, 2 workers, rank 1 SIGKILLed after epoch {args.kill_after} (saves every {args.save_every} "
        f"epochs), snapshot {sizes[0] / 2**20 if sizes else float('nan'):.1f} MiB, memcpy of as many bytes "
        f"{copy * 1e3:.1f} ms; targets: save <= 1.5x memcpy, redone <= {args.save_every}",
        "",
        "| launcher | recovered | kill → training again (s) | ÷ torchrun | kill → next epoch done (s) | ÷ torchrun | "
        "epochs done before kill | resumed at | epochs redone | save (ms) | save / memcpy | epoch before kill (s) | "
        "leftover procs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in LAUNCHERS:
        rows = [r for r in runs if r["launcher"] == name]
        ok = [r for r in rows if r["status"] == "ok"]
        bad = ", ".join(r["status"] for r in rows if r["status"] != "ok")
        saves = [r["save_s"] for r in rows if r.get("save_s") is not None]
        ratio = [r["save_s"] / memcpy[r["snapshot_bytes"]] for r in rows if r.get("save_s") and r.get("snapshot_bytes")]
        again, nxt = ([r[key] for r in ok if key in r] for key in ("to_training", "to_next"))
        theirs = torchrun_medians(runs, ("to_training", "to_next"))
        md.append(
            f"| {name} | {len(ok)}/{len(rows)}{f' ({bad})' if bad else ''} | "
            f"{fmt(again)} | {median(again) / theirs['to_training']:.2f}x | "
            f"{fmt(nxt)} | {median(nxt) / theirs['to_next']:.2f}x | {_set(rows, 'done_before')} | "
            f"{_set(ok, 'resumed_at')} | {_set(ok, 'redone')} | {fmt(saves, 1e3, 0)} | {fmt(ratio, 1, 1)} | "
            f"{fmt([r['epoch_s'] for r in rows if r.get('epoch_s')])} | {sum(r['leftovers'] for r in rows)} |"
        )
    return "\n".join(md)


def torchrun_medians(runs: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    """The median of each figure over torchrun's recovered runs: what the ratios divide by."""
    ok = [r for r in runs if r["launcher"] == "torchrun" and r["status"] == "ok"]
    return {key: median([r[key] for r in ok if key in r]) for key in keys}


def _set(rows: list[dict[str, Any]], key: str) -> str:
    return "/".join(str(v) for v in sorted({r[key] for r in rows if r.get(key) is not None})) or "—"


def report_b(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    md = [
        f"B. one host, 2 workers, the epoch-{args.torn_epoch} save torn by the writer's death, --max-restarts 2",
        "",
        "| launcher | recovered | wall (s) | why | leftover procs |",
        "|---|---|---|---|---|",
    ]
    for name in LAUNCHERS:
        rows = [r for r in runs if r["launcher"] == name]
        ok = [r for r in rows if r["status"] == "ok"]
        why = " / ".join(dict.fromkeys(r["why"] for r in rows))
        md.append(
            f"| {name} | {len(ok)}/{len(rows)} | {fmt([r['wall'] for r in rows])} | {why} | "
            f"{sum(r['leftovers'] for r in rows)} |"
        )
    return "\n".join(md)


def report_c(runs: list[dict[str, Any]], args: argparse.Namespace, skipped: str | None) -> str:
    head = "C. three hosts in network namespaces, each with its own folder, h1 lost after h0's epoch-"
    head += f"{args.c_drop_at} save ({args.c_epochs} epochs, a save every {args.c_save_every})"
    if skipped:
        return f"{head}: skipped ({skipped})"
    md = [
        head,
        "",
        "| launcher | replacement | finished | resumed at (after the loss) | loss → every rank past its resume "
        "epoch (s) | worker finished → its launcher exited (s, slowest host) | final checksums equal | "
        "leftover procs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    replacement = {"torchrun": "h2 started after the loss", "resilrun-capture": "h2 a spare node beforehand"}
    stories = []
    for name in replacement:
        rows = [r for r in runs if r["launcher"] == name]
        if not rows:
            continue
        done = [r for r in rows if r["finished"]]
        resumed = " / ".join(dict.fromkeys(r.get("resumed", "—") for r in rows))
        tails = [r.get("exit_tails") or {} for r in rows]
        complete = [max(t.values()) for t in tails if t and None not in t.values()]
        killed = sum(1 for t in tails if None in t.values())
        equal = sum(bool(r["checksums_equal"]) for r in rows)
        bad = ", ".join(r["status"] for r in rows if r["status"] != "ok")
        md.append(
            f"| {name} | {replacement[name]} | {len(done)}/{len(rows)}{f' ({bad})' if bad else ''} | {resumed} | "
            f"{fmt([r['to_all_past'] for r in rows if 'to_all_past' in r])} | "
            f"{fmt(complete)}{f' ({killed} killed, still running)' if killed else ''} | {equal}/{len(rows)} | "
            f"{sum(r['leftovers'] for r in rows)} |"
        )
        stories += [f"- {r['tag']}: {r.get('what', r.get('error', r['status']))}" for r in rows]
    return "\n".join([*md, "", "What each host did after the loss:", "", *stories])


# -- main ----------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="launches per launcher and scenario")
    parser.add_argument("--quick", action="store_true", help="smoke check: 1 run each, a 16 MiB snapshot")
    parser.add_argument("--scenarios", default="a,b,c,d", help="which of a, b, c, d (comma-separated)")
    parser.add_argument("--mib", type=float, default=64.0, help="A: snapshot size (sets the script's --hidden)")
    parser.add_argument("--epochs", type=int, default=10, help="A: total epochs")
    parser.add_argument(
        "--batch", type=int, default=64, help="A: the script's --batch_size (2 batches per rank and epoch: every batch "
        "all-reduces the whole model, so this sets the epoch time)"
    )  # fmt: skip
    parser.add_argument("--save-every", type=int, default=3, help="A: the script's save interval (epochs)")
    parser.add_argument("--kill-after", type=int, default=7, help="A: kill rank 1 once it has done this epoch")
    parser.add_argument("--torn-epochs", type=int, default=10, help="B: total epochs")
    parser.add_argument("--torn-every", type=int, default=2, help="B: save interval")
    parser.add_argument("--torn-epoch", type=int, default=4, help="B: the save torn by its writer's death")
    parser.add_argument("--torn-hidden", type=int, default=64, help="B: the script's --hidden")
    parser.add_argument("--c-epochs", type=int, default=24, help="C: total epochs")
    parser.add_argument("--c-save-every", type=int, default=2, help="C: save interval")
    parser.add_argument("--c-drop-at", type=int, default=6, help="C: h1 drops once h0 saved this epoch")
    parser.add_argument("--c-sleep", type=float, default=0.08, help="C: the script's --sleep per batch")
    parser.add_argument("--c-hidden", type=int, default=64, help="C: the script's --hidden")
    parser.add_argument("--d-loops", default=",".join(STEP_LOOPS), help=f"D: which of {', '.join(STEP_LOOPS)}")
    parser.add_argument("--d-kill-at", type=int, default=25, help="D: kill rank 1 as rank 0 logs this step")
    parser.add_argument("--timeout", type=float, default=240.0, help="per launch, seconds")
    parser.add_argument("--stall", type=float, default=60.0, help="seconds without an output line = hung")
    parser.add_argument(
        "--linger", type=float, default=45.0, help="C: a launcher silent this long after its workers finished is "
        "waiting on a node that will not come (torchrun's exit barrier: 300 s); it is killed"
    )  # fmt: skip
    parser.add_argument("--launchers", default="", help="comma-separated subset of the launchers (default: all)")
    parser.add_argument("--out-dir", type=Path, default=None, help="run logs (default: a new temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's figures here")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.mib = 1, 16.0
    scenarios = [s.strip().lower() for s in args.scenarios.split(",") if s.strip()]
    if unknown := sorted(set(scenarios) - {"a", "b", "c", "d"}):
        parser.error(f"--scenarios: unknown {', '.join(unknown)} (choose from a, b, c, d)")
    loops = [n.strip() for n in args.d_loops.split(",") if n.strip()]
    if unknown := sorted(set(loops) - set(STEP_LOOPS)):
        parser.error(f"--d-loops: unknown {', '.join(unknown)} (choose from {', '.join(STEP_LOOPS)})")
    if not args.save_every <= args.kill_after < args.epochs - 1 or args.kill_after % args.save_every == 0:
        parser.error(f"--kill-after {args.kill_after}: must fall between two saves, before the last epoch")
    if args.launchers:
        chosen = [n.strip() for n in args.launchers.split(",") if n.strip()]
        if unknown := sorted(set(chosen) - set(LAUNCHERS)):
            parser.error(f"--launchers: unknown {', '.join(unknown)} (choose from {', '.join(LAUNCHERS)})")
        for name in [n for n in LAUNCHERS if n not in chosen]:
            del LAUNCHERS[name]
    args.hidden = max(64, round(args.mib * 2**20 / BYTES_PER_HIDDEN))
    skipped = available() if "c" in scenarios else None
    args.out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="resilrun-captured-"))
    print(f"logs under {args.out_dir}", file=sys.stderr, flush=True)
    if skipped:
        print(f"scenario C skipped: {skipped}", file=sys.stderr, flush=True)
    # SIGTERM unwinds like Ctrl-C, so that every launch's finally kills its tree and the namespaces go.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started, runs, texts = time.time(), [], []
    memcpy: dict[int, float] = {}
    plans: list[tuple[str, Callable[[str, argparse.Namespace, str], dict[str, Any]], list[str]]] = []
    if "a" in scenarios:
        plans.append(("a", run_a, list(LAUNCHERS)))
    if "b" in scenarios:
        plans.append(("b", run_b, list(LAUNCHERS)))
    if "c" in scenarios and skipped is None:
        plans.append(("c", run_c, [n for n in ("torchrun", "resilrun-capture") if n in LAUNCHERS]))
    for loop in loops if "d" in scenarios else []:
        plans.append((f"d-{loop}", lambda name, a, tag, loop=loop: run_d(name, a, tag, loop), list(LAUNCHERS)))
    for key, run, names in plans:
        for i in range(args.runs if names else 0):
            for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate who goes first
                runs.append(run(name, args, f"{len(runs):03d}-{key}-{name}"))
        if key == "a":  # measured here, with no launch running
            for size in {r["snapshot_bytes"] for r in runs if r.get("snapshot_bytes")}:
                memcpy[size] = memcpy_s(size)
    if "a" in scenarios:
        texts.append(report_a([r for r in runs if r["scenario"] == "A"], memcpy, args))
    if "b" in scenarios:
        texts.append(report_b([r for r in runs if r["scenario"] == "B"], args))
    if "c" in scenarios:
        texts.append(report_c([r for r in runs if r["scenario"] == "C"], args, skipped))
    if "d" in scenarios:
        texts.append(report_d([r for r in runs if r["scenario"] == "D"], args))
    print(
        f"{os.cpu_count()} cores, {args.runs} run(s) per launcher and scenario, launchers interleaved; "
        f"total {time.time() - started:.0f} s; logs in {args.out_dir}\n"
    )
    print("\n\n".join(texts))
    if args.json:
        payload = {"args": vars(args), "memcpy_s": {str(k): v for k, v in memcpy.items()}, "runs": runs}
        args.json.write_text(json.dumps(payload, indent=1, default=str), encoding="utf-8")
    return 1 if any(r["status"] != "ok" for r in runs if r["launcher"] == "resilrun-capture") else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
