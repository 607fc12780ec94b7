"""torchtitan with a rank killed mid-run: torchrun against resilrun, side by side (issue 46).

    python benchmarks/torchtitan_recovery.py [--kills 3] [--steps 40] [--kill-at 15] [--json out.json]
    python benchmarks/torchtitan_recovery.py --kills 1          # one kill per row: about 5 minutes
    python benchmarks/torchtitan_recovery.py --host-loss        # a lost host on network-namespace hosts (root)
    python benchmarks/torchtitan_recovery.py --kills 0 --clean-runs 4 --rows torchrun-dcp10,resilrun
                                                                # failure-free step time only

What runs is torchtitan's own trainer with its registered ``llama3_debugmodel`` config (FSDP2 over 2
ranks, its torchdata loader, a fixed seed), unmodified, on this machine's CPU through the tests'
shim (tests/helpers/torchtitan_on_cpu, on the PYTHONPATH: gloo, what a CPU cannot do replaced),
with torchtitan from ``build/torchtitan-site`` (``make test-torchtitan``). Rows, each
``--clean-runs`` failure-free runs and ``--kills`` runs in which the benchmark SIGKILLs rank 1 (the
process whose RANK is 1, not a warm spare) ``--kill-delay`` seconds after the line of step
``--kill-at - 1`` arrives, so while step ``--kill-at`` runs (torchtitan logs a step before the step
is over):

- ``torchrun-dcp10``: ``torchrun --max-restarts 1``, torchtitan's own DCP checkpoint every 10 steps;
- ``torchrun-dcp1``: the same, a checkpoint every step (what it takes torchrun to redo nothing);
- ``resilrun-restart``: ``resilrun --no-integrations --max-restarts 1``, a checkpoint every 10 steps
  (what resilrun did before the integration);
- ``resilrun``: ``resilrun --spares 1 --max-restarts 0`` with the integration, the user's checkpoint
  every 10 steps left on;
- ``resilrun-auto``: the same with ``--snapshot-every auto`` (a snapshot as often as the
  ``--max-overhead`` budget allows: 3 % of step time by default).

Columns: kill -> next step (the first step line after the kill), kill -> progress regained (the
first line of a step beyond the newest before the kill), steps redone (the newest step before the
kill minus the step resumed at), the failure-free run's step time (its steps 5 to N, checkpoint
saves included), and whether every step's loss (its last logged value) equals the failure-free
``torchrun-dcp10`` run's. Times are arrival times of the launchers' output lines, on one clock
with the kill. The issue's targets: progress regained <= 0.15x torchrun-dcp10's, 0 steps redone,
the losses identical, and the failure-free step time <= 1.05x torchrun's.

``--host-loss`` runs the rows ``torchrun-dcp10``, ``resilrun`` and ``resilrun-auto``
(``--snapshot-every auto --replicate-every auto``: a replica as often as its cost allows) on three
hosts in network namespaces (tests/helpers/netns_cluster.py, root only), one rank each: h0 (the
rendezvous endpoint) and h1 train, h2 is started once training runs and stands by (resilrun: a
spare node with ``--replicas 1 --heartbeat-timeout 3``; torchrun: an agent waiting for the next
rendezvous round, its only form of spare, given ``--local-addr`` and ``GLOO_SOCKET_IFNAME`` as its
users must). Instead of a rank, h1 is lost: its link goes down (the others see silence, as when a
machine loses power), then every process on it is SIGKILLed. The working folder, and with it
torchtitan's DCP checkpoints, is shared by the three hosts: torchrun's replacement host needs a
shared file system to resume at all, while resilrun's takes the lost rank from the survivor's
replica. The columns are the same; the losses are compared with the failure-free
``torchrun-dcp10`` run on the same hosts.

Why interleaved: on 2 cores timings drift with load, so run i of every row runs before run i+1 of
any; figures are medians with min-max. Every launch is bounded (``--timeout``) and its whole
process tree is killed on every exit path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from captured_checkpoints import Launch
from launch_overhead import clean_env, fmt

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from tests.helpers.netns_cluster import Cluster, available  # noqa: E402 - the tests' hosts
from tests.torchtitan_assets import make, torchtitan_site  # noqa: E402 - the tests' assets

SHIM = ROOT / "tests" / "helpers" / "torchtitan_on_cpu"  # a sitecustomize (what a CPU cannot do)
PY = sys.executable
STEP = re.compile(r"step:\s+(\d+)\s+(?:\x1b\[[0-9;]*m)?loss:\s+([0-9.]+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
ROWS = ("torchrun-dcp10", "torchrun-dcp1", "resilrun-restart", "resilrun", "resilrun-auto")
# --host-loss: torchrun's restart against the spare host, with a replica every step or as ``auto`` chooses
HOST_ROWS = ("torchrun-dcp10", "resilrun", "resilrun-auto")
NPROC = 2
PORT = 29400  # the rendezvous endpoint on h0 under --host-loss (every host has a network of its own)


def titan(row: str, steps: int) -> list[str]:
    """torchtitan's own command line: the debug model, a fixed seed, its DCP checkpoint on."""
    interval = "1" if row == "torchrun-dcp1" else "10"
    return [
        "-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", str(steps),
        "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.mixed_precision_param",
        "float32", "--debug.seed", "42", "--parallelism.spmd_backend", "partial_dtensor",
        "--checkpoint.enable", "--checkpoint.interval", interval,
    ]  # fmt: skip


def command(row: str, steps: int) -> list[str]:
    if row.startswith("torchrun"):
        return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                *titan(row, steps)]  # fmt: skip
    flags = (
        ["--no-integrations", "--max-restarts", "1"]
        if row == "resilrun-restart"
        else ["--spares", "1", "--max-restarts", "0"]
    )
    if row == "resilrun-auto":
        flags += ["--snapshot-every", "auto"]
    return [PY, "-m", "resilrun", "--standalone", "--nproc-per-node", "2", *flags, *titan(row, steps)]


def host_command(row: str, steps: int, address: str) -> list[str]:
    """One host's launcher under --host-loss: 2 nodes x 1 rank, the endpoint on h0 by its name."""
    nodes = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"h0:{PORT}"]
    if row.startswith("torchrun"):  # it cannot start on these hosts without its address (and gloo's interface)
        return [PY, "-m", "torch.distributed.run", *nodes, "--local-addr", address, "--max-restarts", "1",
                *titan(row, steps)]  # fmt: skip
    flags = ["--rdzv-id", "titan", "--replicas", "1", "--heartbeat-timeout", "3", "--max-restarts", "0"]
    if row == "resilrun-auto":
        flags += ["--snapshot-every", "auto", "--replicate-every", "auto"]
    return [PY, "-m", "resilrun", *nodes, *flags, *titan(row, steps)]


def steps_seen(launch: Launch) -> list[tuple[float, int, str]]:
    """(arrival time, step, loss) of every step line, in arrival order (each rank logs each step)."""
    found = []
    for at, line in sorted(launch.out + launch.err):
        match = STEP.search(ANSI.sub("", line))
        if match:
            found.append((at, int(match[1]), match[2]))
    return found


def environment(row: str, args: argparse.Namespace, work: Path) -> dict[str, str]:
    env = clean_env({
        "PYTHONPATH": f"{args.site}{os.pathsep}{SHIM}", "HF_HOME": str(work / "hf"), "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    })  # fmt: skip
    if row.startswith("torchrun"):  # its shared store breaks its own restarts (benchmarks/recovery.py)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def is_trigger(line: str, args: argparse.Namespace) -> bool:
    """The line of step ``--kill-at - 1``: the kill lands while step ``--kill-at`` runs."""
    return f"step: {args.kill_at - 1} " in ANSI.sub("", line).replace("step:  ", "step: ")


def wait(launches: list[Launch], args: argparse.Namespace) -> int | None:
    """Until every launch exited (the first one's code; None on ``--timeout``)."""
    deadline = time.time() + args.timeout
    while time.time() < deadline:
        codes = [launch.poll() for launch in launches]
        if all(code is not None for code in codes):
            return next((code for code in codes if code), 0)
        for launch in launches:
            launch.track()
        time.sleep(0.2)
    return None


def one_run(row: str, args: argparse.Namespace, tag: str, kill: bool) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"titan_{row}_", dir=args.out_dir))
    make(work)
    killed: dict[str, Any] = {}
    lock = threading.Lock()

    def on_out(launch: Launch, at: float, line: str) -> None:
        if not kill or not is_trigger(line, args):
            return
        with lock:
            if killed:
                return
            # Into the next step: the line is logged inside a step, before that step is over
            # (resilrun snapshots it as train_step returns), so a kill at the line itself would
            # land in the step it reports, for some rows and not others.
            time.sleep(args.kill_delay)
            victims = launch.workers(1)
            killed["at"] = time.time()
            for proc in victims:
                proc.send_signal(signal.SIGKILL)
            killed["pids"] = [p.pid for p in victims]

    env = environment(row, args, work)
    launch = Launch(command(row, args.steps), env, work, args.out_dir / f"{tag}", on_out=on_out)
    code = wait([launch], args)
    left = launch.stop()
    result = analyze(row, steps_seen(launch), killed.get("at"), args)
    result.update(rc=code, left=left)
    shutil.rmtree(work, ignore_errors=True)
    return result


def hosts_run(row: str, args: argparse.Namespace, tag: str, kill: bool) -> dict[str, Any]:
    """--host-loss: h0 and h1 train, h2 stands by; h1 is lost as step ``--kill-at`` starts."""
    work = Path(tempfile.mkdtemp(prefix=f"titan_{row}_", dir=args.out_dir))
    make(work)
    env = environment(row, args, work)
    if row.startswith("torchrun"):
        env["GLOO_SOCKET_IFNAME"] = "eth0"
    trigger: list[float] = []  # when the line of step --kill-at - 1 arrived (the readers only note it)
    launches: dict[str, Launch] = {}
    cluster = Cluster(3).__enter__()

    def on_out(launch: Launch, at: float, line: str) -> None:
        if kill and not trigger and is_trigger(line, args):
            trigger.append(at)

    def start(host: str) -> Launch:
        argv = cluster.command(host, host_command(row, args.steps, cluster.host(host).addr))
        launches[host] = Launch(argv, env, work, args.out_dir / f"{tag}_{host}", on_out=on_out)
        return launches[host]

    code: int | None = None
    killed_at: float | None = None
    lingered = late = False
    result: dict[str, Any] = {"row": row, "killed": False, "losses": {}}
    try:
        first = [start("h0"), start("h1")]
        until = time.time() + args.timeout
        while not any(STEP.search(ANSI.sub("", line)) for n in first for _, line in n.out + n.err):
            if time.time() > until or any(n.poll() is not None for n in first):
                raise TimeoutError("no step before the spare host was to start")
            time.sleep(0.2)
        spare = start("h2")  # once training runs: it finds the job full and stands by
        # resilrun says when its spare node stands by; torchrun's agent says nothing until a round
        # admits it: given the seconds its start and join take here.
        ready = (lambda: "standing by as a spare node" in spare.text("err")) if row.startswith("resilrun") else None
        joined = time.time() + 5
        while not (ready() if ready else time.time() > joined):
            if time.time() > until or spare.poll() is not None:
                raise TimeoutError("the spare host did not stand by")
            time.sleep(0.2)
        late = bool(trigger)  # the kill could not come as step --kill-at started: reported
        trainers = [launches["h0"], launches["h2" if kill else "h1"]]
        while kill and killed_at is None:  # the loss, from this thread, timed at the link's cut
            if trigger and time.time() >= trigger[0] + args.kill_delay:
                cluster.cut("h1")  # silence first, as when a machine loses power
                killed_at = time.time()
                launches["h1"].kill_all()
                cluster.kill_host("h1")
            elif time.time() > until or any(n.poll() is not None for n in first):
                raise TimeoutError("no step --kill-at - 1 before the end")
            time.sleep(0.01)
        code = wait(trainers, args)
        if not kill:  # the host standing by ends with the job (torchrun's waiting agent may not: stopped)
            lingered = wait([spare], argparse.Namespace(timeout=30.0)) is None
    except TimeoutError as exc:
        sys.stderr.write(f"{tag}: {exc}\n")
    finally:
        try:
            left = sum(launch.stop() for host, launch in launches.items() if not (lingered and host == "h2"))
            if lingered:
                launches["h2"].stop()
            seen = sorted(step for launch in launches.values() for step in steps_seen(launch))
            result = analyze(row, seen, killed_at, args)
            result.update(rc=code, left=left)
            if killed_at is not None:
                result["spare_host_trained"] = any(step > 0 for _, step, _ in steps_seen(launches["h2"]))
            if lingered:
                result["spare_lingered"] = True  # 30 s after the job ended, then stopped (not counted as left)
            if late:
                result["late_kill"] = True
        finally:
            cluster.kill_all()
            cluster.close()
            shutil.rmtree(work, ignore_errors=True)
    return result


def analyze(row: str, seen: list[tuple[float, int, str]], at: float | None, args: argparse.Namespace) -> dict[str, Any]:
    """The columns from the step lines (arrival time, step, loss) and the moment of the kill."""
    losses: dict[int, str] = {}
    for _, step, loss in seen:
        losses[step] = loss  # the last logged value of each step (after a recovery: the redone one)
    result: dict[str, Any] = {"row": row, "killed": at is not None, "losses": losses}
    first = {}
    for when, step, _ in seen:
        first.setdefault(step, when)
    timed = [first[s] for s in range(5, args.steps + 1) if s in first]
    if at is None and len(timed) > 1:
        result["step_s"] = (timed[-1] - timed[0]) / (len(timed) - 1)
    if at is not None:
        newest = max((step for t, step, _ in seen if t < at), default=0)
        # A step's line from the rank that was not killed can arrive just after the kill: a line is
        # training after the kill only once its step has been logged by every rank (a step trained
        # again), or if its step is beyond the newest before the kill.
        count: dict[int, int] = {}
        trained: list[tuple[float, int]] = []
        for t, step, _ in seen:
            if t >= at and (count.get(step, 0) >= NPROC or step > newest):
                trained.append((t, step))
            count[step] = count.get(step, 0) + 1
        if trained:
            result["kill_to_next_step_s"] = trained[0][0] - at
            result["steps_redone"] = newest - trained[0][1] + 1
            beyond = [t for t, step in trained if step > newest]
            result["kill_to_progress_s"] = beyond[0] - at if beyond else float("nan")
    return result


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    reference = next((r["losses"] for r in runs if r["row"] == "torchrun-dcp10" and not r["killed"]), {})
    base = {}
    what = "host h1 lost (link down, every process killed)" if args.host_loss else "rank 1 killed"
    where = "2 network-namespace hosts x 1 rank, a third standing by" if args.host_loss else "2 ranks"
    lines = [
        f"torchtitan llama3_debugmodel, FSDP2 over {where} (CPU, gloo), {args.steps} steps, {what} as step "
        f"{args.kill_at} starts; medians (min-max) of {args.kills} kill(s) and {args.clean_runs} failure-free "
        "run(s) per row",
        "",
        "| row | kill -> next step (s) | kill -> progress regained (s) | vs torchrun-dcp10 | steps redone "
        "| failure-free step (s) | vs torchrun | losses equal | finished |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in args.row_list:
        mine = [r for r in runs if r["row"] == row]
        faulty = [r for r in mine if r["killed"]]
        clean = [r for r in mine if not r["killed"]]
        progress = [r.get("kill_to_progress_s", float("nan")) for r in faulty]
        step_s = [r["step_s"] for r in clean if "step_s" in r]
        base.setdefault("progress", statistics.median(progress) if progress else float("nan"))
        base.setdefault("step", statistics.median(step_s) if step_s else float("nan"))
        equal = all(r["losses"] == reference for r in mine) if reference else False
        finished = sum(1 for r in mine if r.get("rc") == 0 and r.get("left") == 0)
        ratio = statistics.median(progress) / base["progress"] if progress and base["progress"] else float("nan")
        step_ratio = statistics.median(step_s) / base["step"] if step_s and base["step"] else float("nan")
        lines.append(
            f"| {row} | {fmt([r.get('kill_to_next_step_s', float('nan')) for r in faulty])} | {fmt(progress)} "
            f"| {ratio:.2f}x | {fmt([float(r.get('steps_redone', float('nan'))) for r in faulty], digits=0)} "
            f"| {fmt(step_s, digits=3)} | {step_ratio:.2f}x | {'yes' if equal else 'no'} | {finished}/{len(mine)} |"
        )
    if late := [r["row"] for r in runs if r.get("late_kill")]:
        lines.append(f"\nkilled after step {args.kill_at} started (the spare host stood by late): {', '.join(late)}")
    if lingered := [r["row"] for r in runs if r.get("spare_lingered")]:
        lines.append(f"a host standing by stayed 30 s after the job ended and was stopped: {', '.join(lingered)}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=3, help="killed runs per row")
    parser.add_argument("--clean-runs", type=int, default=1, help="failure-free runs per row (step time, losses)")
    parser.add_argument("--host-loss", action="store_true", help="lose a host of three network namespaces (root)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-at", type=int, default=15, help="rank 1 is killed as this step starts")
    parser.add_argument("--kill-delay", type=float, default=0.15, help="seconds after the line of step kill-at - 1")
    parser.add_argument("--rows", default=None, help=f"of {', '.join(ROWS)} (--host-loss: {', '.join(HOST_ROWS)})")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    parser.add_argument("--out-dir", type=Path, default=None, help="where every launch's output is kept")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    known = HOST_ROWS if args.host_loss else ROWS
    args.row_list = [row for row in (args.rows or ",".join(known)).split(",") if row]
    if unknown := [row for row in args.row_list if row not in known]:
        parser.error(f"unknown row(s) {', '.join(unknown)}: pick from {', '.join(known)}")
    if args.host_loss and (why := available()) is not None:
        parser.error(f"--host-loss: {why}")
    args.site = torchtitan_site()
    if args.site is None:
        sys.stderr.write("torchtitan is not installed in build/torchtitan-site: run make test-torchtitan\n")
        return 2
    args.out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="torchtitan_recovery_"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    run = hosts_run if args.host_loss else one_run
    for index in range(args.clean_runs + args.kills):  # the failure-free runs first, then kill i of every row
        for row in args.row_list:
            kill = index >= args.clean_runs
            tag = f"{row}_{'kill' + str(index - args.clean_runs + 1) if kill else 'clean' + str(index + 1)}"
            result = run(row, args, tag, kill)
            sys.stdout.write(f"{tag}: {json.dumps({k: v for k, v in result.items() if k != 'losses'})}\n")
            sys.stdout.flush()
            runs.append(result)
    text = report(runs, args)
    sys.stdout.write(text + f"\n\noutputs: {args.out_dir}\n")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "table": text}, indent=2))
    ok = all(r.get("rc") == 0 and r.get("left") == 0 for r in runs if r["row"].startswith("resilrun"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
