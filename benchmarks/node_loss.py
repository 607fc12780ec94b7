"""Node loss: a whole node (agent + workers) SIGKILLed mid-training, with a spare node standing by.

    python benchmarks/node_loss.py [--timeouts 2,5] [--runs 2] [--mib 16] [--json out.json]
    python benchmarks/node_loss.py --quick        # smoke check: one run per launcher
    python benchmarks/node_loss.py --tiers none,persistent    # with and without a persistent tier
    python benchmarks/node_loss.py --netns        # hosts in network namespaces, the link cut (root)
    python benchmarks/node_loss.py --netns --loss 1,3,5   # no kill: packet loss on every link, timed
    python benchmarks/node_loss.py --netns --faults kill,partition,one-way,data-plane,store-host

Three agents on loopback, ``--nnodes 2 --nproc-per-node 2``: two run the job, the third finds it
full and waits (resilrun: a spare node with warm workers; torchrun: an agent waiting for the next
rendezvous round, torchrun's only form of spare). When rank 0 has done ``--kill-at`` steps, every
process of the node that neither hosts the rendezvous store nor stands by is SIGKILLed at once.

resilrun (``_recovery_resilrun.py``, ``--replicas 1``) must notice the silence (``--heartbeat-timeout``,
one row per value), give the node's place to the spare node, which takes the lost ranks from the
survivor's replicas, while the survivor's workers stay in their processes. torchrun
(``_recovery_torchrun.py``, DCP every 10 steps, ``--max-restarts 1``,
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) learns it from its workers' broken collectives, restarts every
worker and reloads the newest DCP checkpoint. Reported, medians with min-max: kill → the survivor
declares the node lost (resilrun: detection vs the timeout), → next step done by rank 0, → progress
regained (the first step beyond the ones done before the kill), steps redone, whether the final
parameters equal a failure-free run of the same launcher, leftover processes.

``--tiers none,persistent`` runs resilrun with and without a persistent tier (``--checkpoint-uri``
in the run's directory, ``--persist-every 5``), one row each: a lost node's replicas lagging
behind training make the resume fall back to an older step (the persistent one, when there is
one), the case issue 14 item 1 is about; ``--launchers`` picks resilrun, torchrun or both.

``--netns`` runs each launch on three "hosts" in network namespaces (tests/helpers/netns_cluster.py,
root only): their own addresses, hostnames that mean 127.0.1.1 in their /etc/hosts, the endpoint
named by host name; the doomed host's link goes down just before its processes are killed, so the
others see silence (no refused connections), as when a machine loses power. resilrun starts
unassisted; torchrun cannot start there at all without ``--local-addr`` and ``GLOO_SOCKET_IFNAME``,
which it is given (what its users must add by hand).

``--faults`` (with ``--netns``) picks the network faults, one table row per launcher and fault, all
at the same moment (rank 0 at ``--kill-at``) and on the same host (the worker host without the store):

- ``kill``: the host's link goes down and its processes are SIGKILLed (a machine lost; the default).
- ``partition``: the link goes down for ``--heal-after`` seconds, every process alive, then back up.
  resilrun must judge the host lost, give its place to the spare host and fence it once healed (it
  stands by as a spare node); torchrun has no notion of it: its collectives wait for TCP to deliver.
- ``one-way``: as ``partition``, but only what reaches the host is dropped (nftables): it can still
  send, nothing comes back, the asymmetric case.
- ``data-plane``: the survivor's pushes to the host's replica server are dropped for ``--heal-after``
  seconds; the store, heartbeats and collectives get through. resilrun only (torchrun has no data
  plane of its own): nobody may be judged lost, training goes on, replication resumes.
- ``store-host``: the store's host (h0, the c10d store lives in its agent) loses its link, processes
  alive. No c10d job survives that; what is measured is how fast and how cleanly both sides stop
  (every process gone, an exit code that says so) instead of hanging.

Reported per fault: fault → the survivor declares the host lost, → next step, → progress regained,
steps redone, final parameters equal to a failure-free run, leftovers, and, for ``store-host``,
fault → the last process of the job exited, with the exit codes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from launch_overhead import clean_env, fmt

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from recovery import parse_events  # noqa: E402 - benchmarks/ is not a package

from tests.helpers.netns_cluster import Cluster, available, nft_available  # noqa: E402 - the test suite's fixture

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1"]
LOST_MARK = {"resilrun": "node lost: no heartbeat", "torchrun": "failed (exitcode"}
# resilrun's variants for --loss, by the flags they add: the defaults, and the intervals chosen under
# --max-overhead (which counts a replica's wait at the commit gate in its cost).
RESILRUN_VARIANTS = {"resilrun": [], "resilrun-auto": ["--snapshot-every", "auto", "--replicate-every", "auto"]}
# --loss also reports training time from this step on: the first steps allocate node memory's slots
# and replica buffers, and a spare's head start (its set-up) shares the cores with them.
STEADY_FROM = 5
FAULTS = ("kill", "partition", "one-way", "data-plane", "store-host")
HEALED = ("partition", "one-way", "data-plane")  # faults that end after --heal-after seconds


class Agent:
    """One launcher process; stderr lines stamped with their arrival time."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, host: str | None = None) -> None:
        self.host = host  # its network namespace host (--netns)
        self.lines: list[tuple[float, str]] = []
        self._sink = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            text=True, start_new_session=True,
        )  # fmt: skip
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.lines.append((time.time(), line.rstrip("\n")))
            self._sink.write(line)
        self._sink.close()

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def track(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault((child.pid, child.create_time()), child)
        return list(self.seen.values())

    def listens_on(self, port: int) -> bool:
        with contextlib.suppress(psutil.Error):
            return any(
                c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
                for c in psutil.Process(self.proc.pid).net_connections()
            )
        return False

    def kill_node(self) -> float:
        """SIGKILL the agent and every worker it ever had, all at once (a node going away)."""
        victims = [psutil.Process(self.proc.pid), *self.track()]
        at = time.time()
        for proc in victims:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        return at

    def stop(self) -> int:
        """Kill whatever is left of this agent's tree; returns how many processes were still alive."""
        left = 0
        for proc in [psutil.Process(self.proc.pid), *self.track()] if self.proc.poll() is None else self.track():
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    left += 1
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        return left


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_one(
    launcher: str,
    timeout_s: float | None,
    fault: str | None,
    args: argparse.Namespace,
    tag: str,
    tier: str = "none",
    loss: float = 0.0,
) -> dict[str, Any]:
    """One launch of three agents; ``fault`` (one of FAULTS, or None: failure-free) strikes once
    rank 0 has done ``--kill-at`` steps."""
    killed = fault is not None
    run_dir = args.out_dir / tag
    run_dir.mkdir(parents=True)
    events, ckpt = run_dir / "events.log", Path(tempfile.mkdtemp(prefix="dcp-"))
    cluster = Cluster(3).__enter__() if args.netns else None
    if cluster is not None and loss:
        cluster.lose(loss)  # every host drops this share of what it receives, for the whole run
    port = 29400 if cluster is not None else free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    common += ["--rdzv-endpoint", f"h0:{port}" if cluster is not None else f"127.0.0.1:{port}"]
    script_args = ["--mib", str(args.mib), "--steps", str(args.steps), "--events", str(events), "--ckpt-dir", str(ckpt)]
    script_args += ["--sleep", str(args.sleep)] if args.sleep else []
    if launcher in RESILRUN_VARIANTS:
        cmd = [sys.executable, "-m", "resilrun", *common, "--replicas", "1", "--heartbeat-timeout", str(timeout_s)]
        cmd += RESILRUN_VARIANTS[launcher]
        if tier == "persistent":
            cmd += ["--checkpoint-uri", str(run_dir / "persistent"), "--persist-every", "5"]
        cmd += [str(HERE / "_recovery_resilrun.py"), *script_args]
        env = clean_env({})
    else:
        cmd = [*TORCHRUN, *common, str(HERE / "_recovery_torchrun.py"), *script_args]
        env = clean_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    if cluster is None:
        agents = [Agent(cmd, env, run_dir / f"agent{i}.err") for i in range(3)]
    else:
        agents = []
        for i, host in enumerate(cluster.hosts):
            argv, host_env = cmd, env
            if launcher == "torchrun":  # it cannot start on these hosts without both
                argv = [*cmd[: len(TORCHRUN)], "--local-addr", host.addr, *cmd[len(TORCHRUN) :]]
                host_env = {**env, "GLOO_SOCKET_IFNAME": "eth0"}
            agents.append(Agent(cluster.command(host, argv), host_env, run_dir / f"agent{i}.err", host.name))
    res: dict[str, Any] = {
        "launcher": launcher, "timeout": timeout_s, "killed": killed, "tag": tag, "status": "ok", "tier": tier,
        "loss": loss, "fault": fault,
    }  # fmt: skip
    started = time.time()
    try:
        kill_at, healed = None, False
        while True:
            for agent in agents:
                agent.track()
            parsed = parse_events(events)
            done = [n for n, _ in parsed["steps"]]
            if fault is not None and kill_at is None and done and max(done) + 1 >= args.kill_at:
                res["doomed"], kill_at = _strike(fault, agents, port, cluster)
                res["kill"] = kill_at
            if fault in HEALED and kill_at is not None and not healed and time.time() - kill_at >= args.heal_after:
                _heal(fault, res["doomed"], cluster)
                healed = True
            # the lost host's processes are gone (kill); a partitioned one must end with the job
            waited = [a for a in agents if fault != "kill" or a is not res.get("doomed")]
            if all(a.proc.poll() is not None for a in waited):
                res["all_exited"] = time.time()
                break
            if time.time() - started > args.timeout:
                res["status"] = "timeout"
                break
            time.sleep(0.1)
        # (torchrun's waiting agent may exit non-zero once the job is over: the training decides)
        res["exit_codes"] = [a.proc.poll() for a in agents if fault != "kill" or a is not res.get("doomed")]
        if fault == "store-host":
            _judge_store_loss(res, launcher)
        elif res["status"] == "ok" and launcher == "resilrun" and any(code != 0 for code in res["exit_codes"]):
            res["status"] = f"failed (exit codes {res['exit_codes']})"
        if res.get("doomed") is not None and fault in HEALED:
            res["fenced"] = _fenced(res["doomed"], launcher, fault)
    finally:
        res["leftovers"] = sum(a.stop() for a in agents)
        shutil.rmtree(ckpt, ignore_errors=True)
        if cluster is not None:
            cluster.close()
    parsed = parse_events(events)
    res.update(steps=parsed["steps"], checksum=parsed["checksum"], state_mib=parsed["state_mib"])
    res["phases"] = parsed["phases"]
    complete = parsed["checksum"] is not None and len({n for n, _ in parsed["steps"]}) >= args.steps
    if res["status"] == "ok" and fault != "store-host" and not complete:
        res["status"] = "incomplete"
    if killed and res.get("kill") and fault != "store-host":
        _analyze(res, agents, launcher)
        after = sorted(t for _, t in res["steps"] if t >= res["kill"])
        gaps = [b - a for a, b in zip([res["kill"], *after], after, strict=False)]
        res["longest_gap"] = max(gaps) if gaps else None
        survivors = [a for a in agents if a is not res.get("doomed")]
        res["judged_lost"] = any(
            LOST_MARK[launcher] in line for a in survivors for t, line in a.lines if t >= res["kill"]
        )
    res.pop("doomed", None)
    print(f"  {tag}: {res['status']}, {_summary(res)}", file=sys.stderr, flush=True)
    return res


def _strike(fault: str, agents: list[Agent], port: int, cluster: Cluster | None) -> tuple[Agent, float]:
    """Apply ``fault``; returns the agent it strikes and when. The struck host is one running workers
    that does not host the store (losing that ends any c10d job), except for ``store-host``."""
    if fault == "store-host":
        assert cluster is not None
        doomed = next(a for a in agents if a.host == "h0")
        cluster.cut("h0")
        return doomed, time.time()
    hosts = [a for a in agents if a.listens_on(port) or (cluster is not None and a.host == "h0")]
    with_workers = [a for a in agents if len([p for p in a.track() if p.is_running()]) >= 2 and a not in hosts]
    resilrun_spares = [a for a in agents if "standing by as a spare node" in a.text()]
    candidates = [a for a in with_workers if a not in resilrun_spares] or with_workers
    doomed = candidates[0]
    if fault == "kill":
        # On --netns its link goes down first: the others see silence, not a refused connection.
        if cluster is not None and doomed.host is not None:
            cluster.cut(doomed.host)
        return doomed, doomed.kill_node()
    assert cluster is not None and doomed.host is not None
    if fault == "partition":
        cluster.cut(doomed.host)
    elif fault == "one-way":
        for other in cluster.hosts:
            if other.name != doomed.host:
                cluster.block(other, doomed.host)
    elif fault == "data-plane":
        survivor = next(a for a in agents if a.host == "h0")
        cluster.block(survivor.host, doomed.host, port=_replica_port(doomed))
    return doomed, time.time()


def _heal(fault: str, doomed: Agent, cluster: Cluster | None) -> None:
    assert cluster is not None and doomed.host is not None
    if fault == "partition":
        cluster.heal(doomed.host)
    else:
        cluster.clear()


def _replica_port(agent: Agent) -> int:
    """The TCP port of ``agent``'s replica server, from its ``agent_started`` event (docs/status.md)."""
    said = [line.split("logs in ", 1)[1].strip() for _, line in agent.lines if "logs in " in line]
    logs = said[-1]
    for line in (Path(logs) / "events.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("event") == "agent_started" and record.get("replica_server"):
            return int(str(record["replica_server"]).rsplit(":", 1)[1])
    raise RuntimeError(f"no replica server in {logs}/events.jsonl")


def _fenced(doomed: Agent, launcher: str, fault: str) -> str:
    """What became of the struck host once healed (resilrun: it must stand by as a spare node)."""
    if launcher != "resilrun" or fault == "data-plane":
        return "—"
    if "standing by as a spare node" in doomed.text():  # it was active before: this is after the heal
        return "stood by as a spare"
    return f"exit {doomed.proc.poll()}"


def _judge_store_loss(res: dict[str, Any], launcher: str) -> None:
    """``store-host``: the job cannot go on; it must stop on both sides, every process gone."""
    if res["status"] != "ok":
        return
    res["to_stopped"] = res["all_exited"] - res["kill"] if res.get("all_exited") and res.get("kill") else None
    if launcher == "resilrun" and 0 in res["exit_codes"]:
        res["status"] = f"unexpected exit 0 (exit codes {res['exit_codes']})"


def _analyze(res: dict[str, Any], agents: list[Agent], launcher: str) -> None:
    kill = res["kill"]
    survivors = [a for a in agents if a is not res["doomed"]]
    lost = [t for a in survivors for t, line in a.lines if t >= kill and LOST_MARK[launcher] in line]
    if lost:
        res["detected"] = min(lost) - kill
    # Recovery starts where rank 0 next begins a first step (its "first" phase after the kill); a
    # step stamped before that (the one in flight, whose collective had completed) was not recovered.
    firsts = [at for rank, name, at in res["phases"] if rank == 0 and name == "first" and at >= kill]
    resumed = min(firsts, default=None)
    if resumed is None:
        return
    steps = res["steps"]
    before = {n for n, t in steps if t < resumed}
    after = sorted((t, n) for n, t in steps if t >= resumed)
    if after:
        res["to_next"] = after[0][0] - kill
        newest = max(before) if before else -1
        regained = [t for t, n in after if n > newest]
        if regained:
            res["to_regained"] = regained[0] - kill
        res["redone"] = sum(n in before for _, n in after)


def _summary(res: dict[str, Any]) -> str:
    if not res["killed"]:
        return "failure-free"
    if res.get("fault") == "store-host":
        stopped = res.get("to_stopped")
        return (
            f"stopped {stopped:.2f} s after, exit codes {res['exit_codes']}, leftovers {res['leftovers']}"
            if (stopped is not None)
            else f"exit codes {res['exit_codes']}"
        )
    parts = [f"{key} {res[key]:.2f} s" for key in ("detected", "to_next", "to_regained") if key in res]
    return ", ".join(parts + [f"redone {res.get('redone', '?')}", f"leftovers {res['leftovers']}"])


def report(runs: list[dict[str, Any]]) -> str:
    faults = {r.get("fault") for r in runs if r["killed"]}
    with_fault = faults != {"kill"}
    md = [
        ("| fault " if with_fault else "") + "| launcher | persistent tier | --heartbeat-timeout | recovered | "
        "fault → node declared lost (s) | fault → next step (s) | fault → progress regained (s) | steps redone | "
        "final params equal | leftover procs |"
        + (" longest step gap (s) | struck host afterwards |" if with_fault else ""),
        ("|---" if with_fault else "")
        + "|---|---|---|---|---|---|---|---|---|---|"
        + ("---|---|" if with_fault else ""),
    ]
    clean = {r["launcher"]: r["checksum"] for r in runs if not r["killed"] and r["status"] == "ok"}
    groups: dict[tuple[str, str, Any, str], list[dict[str, Any]]] = {}
    for r in runs:
        if r["killed"] and r.get("fault") != "store-host":
            key = (r.get("fault", "kill"), r["launcher"], r["timeout"], r.get("tier", "none"))
            groups.setdefault(key, []).append(r)
    for (fault, name, timeout, tier), rows in groups.items():
        ok = [r for r in rows if r["status"] == "ok"]
        ref = clean.get(name)
        equal = f"{sum(r['checksum'] == ref for r in ok)}/{len(rows)}" if ref else "—"
        redone = sorted(r["redone"] for r in ok if r.get("redone") is not None)
        persistent = "—" if name == "torchrun" else ("DIR, every 5" if tier == "persistent" else "none")
        after = "/".join(sorted({r.get("fenced", "—") for r in rows}))
        if fault == "data-plane":
            after = f"judged lost in {sum(bool(r.get('judged_lost')) for r in rows)}/{len(rows)}"
        gap = fmt([r["longest_gap"] for r in ok if r.get("longest_gap") is not None])
        md.append(
            (f"| {fault} " if with_fault else "")
            + f"| {name} | {persistent} | {timeout if timeout is not None else '— (worker errors)'} | "
            f"{len(ok)}/{len(rows)} | "
            f"{fmt([r['detected'] for r in ok if 'detected' in r])} | "
            f"{fmt([r['to_next'] for r in ok if 'to_next' in r])} | "
            f"{fmt([r['to_regained'] for r in ok if 'to_regained' in r])} | {'/'.join(map(str, redone)) or '—'} | "
            f"{equal} | {sum(r['leftovers'] for r in rows)} |" + (f" {gap} | {after} |" if with_fault else "")
        )
    for fault in sorted(f for f in faults if f != "store-host"):
        theirs = [r["to_regained"] for r in runs if r.get("fault") == fault and r["launcher"] == "torchrun"
                  and r["status"] == "ok" and "to_regained" in r]  # fmt: skip
        if not theirs:
            continue
        base = statistics.median(theirs)
        md.append("")
        for (group_fault, name, timeout, _), rows in groups.items():
            vals = [r["to_regained"] for r in rows if "to_regained" in r and r["status"] == "ok"]
            if group_fault == fault and name == "resilrun" and vals:
                md.append(
                    f"- {fault}: resilrun (--heartbeat-timeout {timeout}) / torchrun, fault → progress regained: "
                    f"{statistics.median(vals) / base:.2f}×"
                )
    stopped = [r for r in runs if r.get("fault") == "store-host"]
    if stopped:
        md += [
            "",
            "| fault | launcher | runs | stopped, every process gone | fault → last process exited (s) | exit codes |",
            "|---|---|---|---|---|---|",
        ]
        for name in sorted({r["launcher"] for r in stopped}):
            rows = [r for r in stopped if r["launcher"] == name]
            clean_stop = [r for r in rows if r["status"] == "ok" and r["leftovers"] == 0]
            codes = "; ".join(",".join(map(str, r["exit_codes"])) for r in rows)
            md.append(
                f"| store-host | {name} | {len(rows)} | {len(clean_stop)}/{len(rows)} | "
                f"{fmt([r['to_stopped'] for r in rows if r.get('to_stopped') is not None])} | {codes} |"
            )
    return "\n".join(md)


def loss_report(runs: list[dict[str, Any]]) -> str:
    """Training time (first to last step) per launcher and loss, against no loss and against torchrun."""
    md = [
        "| launcher | packet loss on every link | finished | training s (median, range) | vs no loss | "
        f"from step {STEADY_FROM} s | final params equal |",
        "|---|---|---|---|---|---|---|",
    ]
    seconds: dict[tuple[str, float], list[float]] = {}
    steady: dict[tuple[str, float], list[float]] = {}
    clean = {r["launcher"]: r["checksum"] for r in runs if r["loss"] == 0 and r["status"] == "ok"}
    for r in runs:
        steps = [t for _, t in r["steps"]]
        if r["status"] == "ok" and len(steps) > 1:
            seconds.setdefault((r["launcher"], r["loss"]), []).append(max(steps) - min(steps))
            later = [t for step, t in r["steps"] if step >= STEADY_FROM]
            if len(later) > 1:
                steady.setdefault((r["launcher"], r["loss"]), []).append(max(later) - min(later))
    for launcher, loss in sorted({(r["launcher"], r["loss"]) for r in runs}):
        rows = [r for r in runs if (r["launcher"], r["loss"]) == (launcher, loss)]
        ok = seconds.get((launcher, loss), [])
        base = seconds.get((launcher, 0.0))
        ratio = f"{statistics.median(ok) / statistics.median(base):.2f}×" if ok and base else "—"
        equal = sum(r["checksum"] == clean.get(launcher) for r in rows if r["status"] == "ok")
        later = fmt(steady.get((launcher, loss), []))
        md.append(
            f"| {launcher} | {loss:g} % | {len(ok)}/{len(rows)} | {fmt(ok)} | {ratio} | {later} | {equal}/{len(rows)} |"
        )
    md.append("")
    for loss in sorted({r["loss"] for r in runs}):
        for variant in RESILRUN_VARIANTS:
            ours, theirs = seconds.get((variant, loss)), seconds.get(("torchrun", loss))
            if ours and theirs:
                ratio = statistics.median(ours) / statistics.median(theirs)
                line = f"- {loss:g} % loss: {variant} / torchrun training time {ratio:.2f}×"
                ours, theirs = steady.get((variant, loss)), steady.get(("torchrun", loss))
                if ours and theirs:
                    line += f", from step {STEADY_FROM} {statistics.median(ours) / statistics.median(theirs):.2f}×"
                md.append(line)
    return "\n".join(md)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeouts", default="2,5", help="resilrun --heartbeat-timeout values (seconds)")
    parser.add_argument("--runs", type=int, default=2, help="killed runs per launcher and timeout")
    parser.add_argument("--mib", type=float, default=16.0, help="state per rank (params + AdamW moments)")
    parser.add_argument(
        "--steps", type=int, default=None, help="default 30; 120 when --faults has more than kill (the job must "
        "outlast a fault that heals and the struck host's return)"
    )  # fmt: skip
    parser.add_argument(
        "--sleep", type=float, default=None, help="extra seconds per step; default 0, 0.15 when --faults has more "
        "than kill"
    )  # fmt: skip
    parser.add_argument("--kill-at", type=int, default=15, help="kill once rank 0 has done this many steps")
    parser.add_argument("--timeout", type=float, default=300.0, help="per launch, seconds")
    parser.add_argument("--quick", action="store_true", help="one run per launcher, first timeout only")
    parser.add_argument("--tiers", default="none", help="resilrun runs: none and/or persistent (comma-separated)")
    parser.add_argument("--launchers", default="resilrun,torchrun", help="which launchers to run")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--netns", action="store_true", help="three hosts in network namespaces (root)")
    parser.add_argument(
        "--faults", default="kill", help=f"with --netns: which faults, comma-separated, of {', '.join(FAULTS)}"
    )
    parser.add_argument(
        "--heal-after", type=float, default=None, help="partition, one-way, data-plane: seconds until the fault "
        "ends (default: twice resilrun's first --heartbeat-timeout plus 2 s, so that the host is judged lost first)"
    )  # fmt: skip
    parser.add_argument(
        "--loss", default=None, help="with --netns: no kill; --runs jobs per launcher at 0 %% and each of these "
        "packet-loss percentages on every link (comma-separated), timed"
    )  # fmt: skip
    args = parser.parse_args()
    if args.netns and (why := available()) is not None:
        parser.error(f"--netns: {why}")
    if args.loss is not None and not args.netns:
        parser.error("--loss needs --netns")
    known = {*RESILRUN_VARIANTS, "torchrun"} if args.loss is not None else {"resilrun", "torchrun"}
    if unknown_launchers := set(args.launchers.split(",")) - known:
        choices = ", ".join(sorted(known))
        parser.error(f"--launchers: unknown {', '.join(sorted(unknown_launchers))} (choose from {choices})")
    if args.loss is not None and (why := nft_available()) is not None:
        parser.error(f"--loss: {why}")
    faults = args.faults.split(",")
    if unknown := [f for f in faults if f not in FAULTS]:
        parser.error(f"--faults: unknown {', '.join(unknown)} (choose from {', '.join(FAULTS)})")
    if faults != ["kill"] and not args.netns:
        parser.error("--faults other than kill need --netns")
    if {"one-way", "data-plane"} & set(faults) and (why := nft_available()) is not None:
        parser.error(f"--faults one-way/data-plane: {why}")
    timeouts = [float(t) for t in args.timeouts.split(",")]
    long_faults = faults != ["kill"]
    args.steps = args.steps if args.steps is not None else (120 if long_faults else 30)
    args.sleep = args.sleep if args.sleep is not None else (0.15 if long_faults else 0.0)
    args.heal_after = args.heal_after if args.heal_after is not None else 2 * timeouts[0] + 2
    if args.quick:
        args.runs, timeouts = 1, timeouts[:1]
    args.out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="resilrun-node-loss-"))
    print(f"logs under {args.out_dir}", file=sys.stderr)
    launchers, tiers = args.launchers.split(","), args.tiers.split(",")
    if args.loss is not None:
        losses = [0.0, *(float(p) for p in args.loss.split(","))]
        plan = [(name, loss) for loss in losses for name in launchers]
        runs = []
        for i in range(args.runs):
            for name, loss in plan[i % len(plan) :] + plan[: i % len(plan)]:  # rotate against drift
                timeout = timeouts[0] if name in RESILRUN_VARIANTS else None
                runs.append(run_one(name, timeout, None, args, f"{len(runs):03d}-{name}-loss{loss:g}", loss=loss))
        print("Three hosts in network namespaces (two train), packet loss on every link:\n\n" + loss_report(runs))
        if args.json:
            args.json.write_text(json.dumps(runs, indent=1, default=str), encoding="utf-8")
        return 0 if all(r["status"] == "ok" for r in runs if r["launcher"] in RESILRUN_VARIANTS) else 1
    runs = [run_one(name, timeouts[0] if name == "resilrun" else None, None, args, f"00{i}-{name}-clean")
            for i, name in enumerate(launchers)]  # fmt: skip
    index = len(runs)
    plan: list[tuple[str, str, float | None, str]] = []
    for fault in faults:
        plan += [("resilrun", fault, t, tier) for t in timeouts for tier in tiers if "resilrun" in launchers]
        if "torchrun" in launchers and fault != "data-plane":  # torchrun has no data plane to cut
            plan.append(("torchrun", fault, None, "none"))
    for i in range(args.runs):
        for launcher, fault, timeout, tier in plan[i % len(plan) :] + plan[: i % len(plan)]:  # rotate against drift
            tag = f"{index:03d}-{launcher}-{fault}-{timeout}-{tier}"
            runs.append(run_one(launcher, timeout, fault, args, tag, tier))
            index += 1
    text = report(runs)
    if args.netns:
        text = "Three hosts in network namespaces (two train, one stands by), endpoint by host name:\n\n" + text
    print(text)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1, default=str), encoding="utf-8")
    return 0 if all(r["status"] == "ok" for r in runs if r["launcher"] == "resilrun") else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
