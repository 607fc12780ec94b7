"""Recovery from a SIGKILLed worker: resilrun (hot spare, in-process) vs torchrun (restart + DCP), side by side.

    python benchmarks/recovery.py [--sizes 64,256] [--kills 3] [--steps 40] [--json out.json]
    python benchmarks/recovery.py --quick        # smoke check: 64 MiB, 1 kill
    python benchmarks/recovery.py --spares 0     # resilrun without a hot spare (a new process)
    python benchmarks/recovery.py --launchers resilrun --baseline ../old-checkout   # before/after
    python benchmarks/recovery.py --spares 0 --launchers resilrun,resilrun-spawn,torchrun-noshare  # template
    python benchmarks/recovery.py --setup 10 --launchers resilrun,resilrun-setup-after,torchrun-noshare

``--setup S``: every worker spends S seconds (a sleep) in its set-up before it builds its model.
``resilrun`` runs it in a ``@resilrun.once`` function with the spare's head start (issue 47: the spare
runs the set-up before any failure, a survivor's re-run reuses it); ``resilrun-setup-after`` is
resilrun without either (``--no-spare-head-start``, plain set-up code), as before;
``resilrun-rank-first`` is ``resilrun`` with a script that reads ``RANK`` at its first line (no head
start for the spare; the survivors still reuse their set-up); torchrun's restarted workers pay it
again. ``--setup-cpu``: the set-up computes on one core instead of sleeping (the spare refilled after
a take-over then competes with the survivors: see their step time after the recovery).

What it measures (DESIGN.md §3, issue 4): 4 ranks (``--standalone --nproc-per-node 4``, gloo), a
toy MLP whose params + AdamW moments are ``--sizes`` MiB per rank, rank 1 SIGKILLed when step
``--kill-step`` starts. resilrun runs ``_recovery_resilrun.py`` (three-call API) with
``--spares 1`` (``--spares 0``: no hot spare, a new process is started for the killed rank while the
survivors wait in theirs) and its own fault plan; torchrun, plain and with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (plain torchrun's shared store breaks its restarts, see
shared/anchors/measured_here.md), runs ``_recovery_torchrun.py`` (plain DDP, DCP save every 10
steps) with ``--max-restarts 1``. Rank 0 stamps the end of every step; the killed rank stamps the
kill. Reported per launcher and size: recovered (exit 0 in time), time from the kill to the next
completed step and to the first step beyond the ones done before the kill (progress regained,
which includes redoing lost steps), steps redone, and whether the final parameters equal a
failure-free run of the same launcher and script. resilrun keeps ``--max-restarts 0`` so that a
failed in-process recovery shows as a failure instead of hiding behind a restart.

Defaults (18 steps, kill when step 15 starts) keep the one thing that matters about the kill
point: the newest DCP save before it was 5 steps earlier (after 10 completed steps), so torchrun
redoes 5 steps, exactly as with saves at 10/20 and a kill at 25. More steps only add steady-state
steps, 1.2-1.7 s each at 256 MiB on 2 cores, and would take the default run far past ~15 minutes
(it takes ~17 as it is: 24 launches of 4-5 processes); ``--steps 40 --kill-step 25`` gives the
longer form. Exits 1 if any resilrun run did not finish.

``--baseline DIR`` adds ``resilrun-baseline``: the same runs with the resilrun of another checkout
(a ``git worktree`` of an older commit), launched from that directory so that the agent and its
workers import it, interleaved with the others: a change's effect on recovery, measured in the same
run. ``--launchers`` picks which of the launchers run (default: all).

Why this shape: on a 2-core machine timings drift with load, so launchers run interleaved (run i
rotates the order) and figures are medians with min-max. Every run is bounded (``--timeout``, and
``--stall`` without progress), its whole process tree is killed, its logs are kept under
``--out-dir``; a hung resilrun run also gets ``py-spy dump`` stacks there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

from _recovery_runner import launch
from launch_overhead import clean_env, fmt

HERE = Path(__file__).resolve().parent
NPROC = 4
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1"]
# name -> (launcher argv up to the script, extra environment, worker script)
LAUNCHERS: dict[str, tuple[list[str], dict[str, str], Path]] = {
    "resilrun": ([sys.executable, "-m", "resilrun", "--spares", "1"], {}, HERE / "_recovery_resilrun.py"),
    "torchrun": (TORCHRUN, {}, HERE / "_recovery_torchrun.py"),
    "torchrun-noshare": (TORCHRUN, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, HERE / "_recovery_torchrun.py"),
}
# Run only when --launchers names them: resilrun starting every worker as a new process, as it did
# before the worker template (the template's effect, measured in the same run).
OPTIONAL = {
    "resilrun-rank-first": (
        [sys.executable, "-m", "resilrun", "--spares", "1"],
        {"RECOVERY_READ_RANK_FIRST": "1"},
        HERE / "_recovery_resilrun.py",
    ),
    "resilrun-setup-after": (
        [sys.executable, "-m", "resilrun", "--no-spare-head-start", "--spares", "1"],
        {"RECOVERY_SETUP_ONCE": "0"},
        HERE / "_recovery_resilrun.py",
    ),
    "resilrun-spawn": (
        [sys.executable, "-m", "resilrun", "--no-worker-template", "--spares", "1"],
        {},
        HERE / "_recovery_resilrun.py",
    ),
}
# stderr markers stamped on arrival (first one after the kill): resilrun's agent and bootstrap,
# torchrun's agent, and the torchrun script's own resume line.
MARKS = {
    "agent acted (resilrun: 'hot spare takes over'; torchrun: 'failed (exitcode: -9)')": (
        "hot spare takes over",
        "failed (exitcode",
    ),
    "first survivor: recovering in-process": ("recovering in-process",),
    "first rank: resumed from step": ("resumed from step",),
}
NEXT, REGAINED, EXITED = "rank 0: next step done", "rank 0: first new step done (progress regained)", "launcher exited"
PHASES = {
    "start": "script (re-)entered",
    "imported": "imports done",
    "init": "init()/init_process_group returned",
    "ddp": "model + DDP + optimizer built",
    "first": "state restored, first step begins",
}


def parse_events(path: Path) -> dict[str, Any]:
    """The BENCH lines of one run: steps [(n, t)], kill t, phases [(rank, name, t)], checksum, MiB."""
    out: dict[str, Any] = {"steps": [], "kill": None, "phases": [], "checksum": None, "state_mib": None}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        words = line.split()
        if len(words) != 5 or words[0] != "BENCH":
            continue
        event, rank, value, at = words[1], int(words[2]), words[3], float(words[4])
        if event == "step":
            out["steps"].append((int(value), at))
        elif event == "kill":
            out["kill"] = at
        elif event == "phase":
            out["phases"].append((rank, value, at))
        elif event == "done":
            out["checksum"] = value
        elif event == "config":
            out["state_mib"] = float(value)
        elif event == "note":
            out.setdefault("notes", []).append(f"rank {rank}: {value}")
    out["steps"].sort(key=lambda s: s[1])
    return out


def analyze(res: dict[str, Any], kill_step: int) -> None:
    """Add the recovery figures of a killed run to ``res`` (in place).

    Recovery starts where rank 0 next begins a first step (its ``first`` phase after the kill):
    a step stamped after the kill but before that (rank 0 finishing the step in flight, whose
    collective had already completed) was not recovered, so it counts as done before the kill.
    Steps redone: steps done before the recovery and done again after it.
    """
    kill, steps = res["kill"], res["steps"]
    resumed = min(
        (at for rank, name, at in res["phases"] if rank == 0 and name == "first" and at >= (kill or 0)), default=None
    )
    if kill is None or resumed is None:
        return
    before = {n for n, t in steps if t < resumed}
    after = [(n, t) for n, t in steps if t >= resumed]
    res["redone"] = sum(n in before for n, _ in after) if res["status"] == "ok" else None
    if after:
        res["to_next"] = after[0][1] - kill
    regained = [t for n, t in after if n >= kill_step]
    if regained:
        res["to_regained"] = regained[0] - kill
    timeline: dict[str, float] = {}
    for rank, name, at in sorted(res["phases"], key=lambda p: p[2]):
        key = f"rank {rank}: {PHASES.get(name, name)}"
        if at >= kill and rank in (0, 1) and key not in timeline:
            timeline[key] = at - kill
    for label, needles in MARKS.items():
        hit = next((at for at, line in res["stderr"] if at >= kill and any(n in line for n in needles)), None)
        if hit is not None:
            timeline[label] = hit - kill
    if "to_next" in res:
        timeline[NEXT] = res["to_next"]
    if "to_regained" in res:
        timeline[REGAINED] = res["to_regained"]
    if res.get("exited") is not None and res["status"] == "ok":
        timeline[EXITED] = res["exited"] - kill
    res["timeline"] = timeline
    # The survivors' pace before the kill and after the recovery, while the node refills its spare
    # (a new process whose start, and with a head start its set-up, competes for the node's cores).
    res["step_before"] = _median_interval([t for n, t in steps if 2 <= n < kill_step and t < kill])
    res["step_after"] = _median_interval([t for _, t in after])


def _median_interval(times: list[float]) -> float | None:
    times = sorted(times)
    return statistics.median(b - a for a, b in pairwise(times)) if len(times) > 2 else None


def timeline_rows() -> list[str]:
    """Row order of the timeline table: detection, then each phase for rank 0 and 1, then steps."""
    labels = list(MARKS)[:2]
    labels += [f"rank {rank}: {text}" for text in PHASES.values() for rank in (0, 1)]
    return [*labels, list(MARKS)[2], NEXT, REGAINED, EXITED]


def run_one(name: str, mib: int, killed: bool, args: argparse.Namespace, index: int) -> dict[str, Any]:
    """One bounded launch of ``name`` at ``mib``; returns its parsed events and status."""
    prefix, extra, script = LAUNCHERS[name]
    tag = f"{index:03d}-{name}-{mib}-{'kill' if killed else 'clean'}"
    run_dir = args.out_dir / tag
    run_dir.mkdir(parents=True)
    events, ckpt = run_dir / "events.log", Path(tempfile.mkdtemp(prefix="dcp-", dir=args.ckpt_root))
    env = clean_env(extra)
    if killed and name.startswith("resilrun"):
        env["RESILRUN_FAULTS"] = f"kill:rank=1,step={args.kill_step}"
    cmd = [*prefix, "--standalone", "--nproc-per-node", str(NPROC), str(script), "--mib", str(mib)]
    cmd += ["--steps", str(args.steps), "--events", str(events), "--ckpt-dir", str(ckpt)]
    cmd += ["--kill-step", str(args.kill_step if killed else -1), "--setup", str(args.setup)]
    cmd += ["--setup-cpu"] if args.setup_cpu else []
    try:
        cwd = args.baseline if name == "resilrun-baseline" else None
        if cwd is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(cwd), env.get("PYTHONPATH", "")]))
        ran = launch(cmd, env, events, run_dir / "stderr.log", args.timeout, args.stall, dump_on_hang=True, cwd=cwd)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    res: dict[str, Any] = {"launcher": name, "mib": mib, "killed": killed, "tag": tag, **parse_events(events)}
    res.update(status=ran.status, rc=ran.rc, wall=ran.wall, leftovers=ran.leftovers, stderr=ran.stderr)
    res["exited"] = ran.started + ran.wall
    if ran.evidence:
        (run_dir / "py-spy.txt").write_text(ran.evidence, encoding="utf-8")
        res["evidence"] = str(run_dir / "py-spy.txt")
    if ran.status == "ok" and (res["checksum"] is None or len(res["steps"]) < args.steps):
        res["status"] = "incomplete"  # exit 0 without finishing training is no recovery
    if killed:
        analyze(res, args.kill_step)
    steps = [t for _, t in res["steps"]]
    res["step_time"] = statistics.median(b - a for a, b in pairwise(steps[2:])) if len(steps) > 4 else None
    summary = f"to next step {res.get('to_next', float('nan')):.2f} s" if killed else "failure-free"
    print(f"  {tag}: {res['status']} (rc {ran.rc}) in {ran.wall:.1f} s, {summary}", file=sys.stderr, flush=True)
    for note in res.get("notes", []):
        print(f"    note: {note}", file=sys.stderr)
    if res["status"] != "ok" or ran.leftovers:
        tail = "\n    ".join(line for _, line in ran.stderr[-12:])
        print(f"    leftover processes killed: {ran.leftovers}; stderr tail:\n    {tail}", file=sys.stderr)
    return res


def cell_values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None and r["status"] == "ok"]


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(runs: list[dict[str, Any]], sizes: list[int], kill_step: int) -> str:
    """Markdown: the main table, ratios, resilrun's and torchrun's timelines, failure-free runs."""
    names = list(LAUNCHERS)
    md = [
        "| launcher | MiB/rank | recovered | kill → next step (s) | kill → progress regained "
        f"(step {kill_step} done) (s) | steps redone | final params equal | leftover procs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mib in sizes:
        clean = {r["launcher"]: r for r in runs if r["mib"] == mib and not r["killed"]}
        for name in names:
            rows = [r for r in runs if r["launcher"] == name and r["mib"] == mib and r["killed"]]
            ok = [r for r in rows if r["status"] == "ok"]
            bad = ", ".join(f"{r['status']}" for r in rows if r["status"] != "ok")
            ref = clean.get(name, {}).get("checksum") if clean.get(name, {}).get("status") == "ok" else None
            equal = sum(r["checksum"] == ref for r in ok) if ref else None
            redone = sorted({r["redone"] for r in ok if r.get("redone") is not None})
            actual = next((r["state_mib"] for r in rows + [clean.get(name, {})] if r.get("state_mib")), mib)
            md.append(
                f"| {name} | {actual:.0f} | {len(ok)}/{len(rows)}{f' ({bad})' if bad else ''} | "
                f"{fmt(cell_values(ok, 'to_next'))} | {fmt(cell_values(ok, 'to_regained'))} | "
                f"{'/'.join(map(str, redone)) or '—'} | {'—' if equal is None else f'{equal}/{len(rows)}'} | "
                f"{sum(r['leftovers'] for r in rows)} |"
            )
    md += ["", "| ratio of medians | MiB/rank | kill → next step | kill → progress regained |", "|---|---|---|---|"]
    for mib in sizes:
        ok = {n: [r for r in runs if r["launcher"] == n and r["mib"] == mib and r["killed"]] for n in names}
        for base in [n for n in names if n != "resilrun"]:
            keys = ("to_next", "to_regained")
            cells = [med(cell_values(ok["resilrun"], k)) / med(cell_values(ok[base], k)) for k in keys]
            text = [f"{c:.3f}" if c == c else "—" for c in cells]  # NaN: no recovered run to compare
            md.append(f"| resilrun / {base} | {mib} | " + " | ".join(text) + " |")
    columns = [
        (n, m)
        for m in sizes
        for n in names
        if any(r.get("timeline") for r in runs if (r["launcher"], r["mib"]) == (n, m))
    ]
    labels = [k for k in timeline_rows() if any(k in r.get("timeline", {}) for r in runs)]
    md += [
        "",
        "Timeline after the kill (s, median (min–max) over recovered runs; rank 1 is the hot spare in resilrun "
        "and a new process in torchrun; stderr markers are arrival times at the benchmark):",
        "",
        "| event | " + " | ".join(f"{n} {mib}" for n, mib in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for label in labels:
        cells = []
        for n, mib in columns:
            ok = [r for r in runs if r["launcher"] == n and r["mib"] == mib and r["status"] == "ok"]
            cells.append(fmt([r["timeline"][label] for r in ok if label in r.get("timeline", {})]))
        md.append(f"| {label} | " + " | ".join(cells) + " |")
    md += [
        "",
        "| survivors' step time (ms, median) | MiB/rank | before the kill | after the recovery (spare refilling) |",
        "|---|---|---|---|",
    ]
    for mib in sizes:
        for name in names:
            ok = [r for r in runs if r["launcher"] == name and r["mib"] == mib and r["killed"] and r["status"] == "ok"]
            before = [r["step_before"] * 1e3 for r in ok if r.get("step_before")]
            after = [r["step_after"] * 1e3 for r in ok if r.get("step_after")]
            md.append(f"| {name} | {mib} | {fmt(before)} | {fmt(after)} |")
    md += [
        "",
        "| failure-free run | MiB/rank | status | wall (s) | step time (ms, median) | last step → launcher exit (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        if not r["killed"]:
            step = f"{r['step_time'] * 1e3:.0f}" if r.get("step_time") else "—"
            tail = f"{r['exited'] - r['steps'][-1][1]:.1f}" if r["steps"] else "—"
            md.append(f"| {r['launcher']} | {r['mib']} | {r['status']} | {r['wall']:.1f} | {step} | {tail} |")
    return "\n".join(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="state per rank, MiB, comma-separated")
    parser.add_argument("--kills", type=int, default=3, help="killed runs per launcher and size")
    parser.add_argument("--steps", type=int, default=18, help="training steps per run")
    parser.add_argument("--kill-step", type=int, default=15, help="rank 1 is SIGKILLed when this step starts")
    parser.add_argument("--quick", action="store_true", help="smoke check: --sizes 64 --kills 1")
    parser.add_argument("--timeout", type=float, default=300.0, help="per run, seconds")
    parser.add_argument("--stall", type=float, default=45.0, help="seconds without a new event = hung")
    parser.add_argument("--out-dir", type=Path, default=None, help="run logs (default: a new temp dir)")
    parser.add_argument("--ckpt-root", default=None, help="where DCP checkpoints go (default: system temp)")
    parser.add_argument("--json", default="", help="also write every run's raw figures here")
    parser.add_argument(
        "--spares", type=int, default=1, help="resilrun's --spares (0: a new process replaces the killed rank)"
    )
    parser.add_argument("--baseline", type=Path, default=None, help="also run the resilrun of this checkout")
    parser.add_argument("--launchers", default="", help="comma-separated subset of the launchers (default: all)")
    parser.add_argument("--setup", type=float, default=0.0, help="seconds of set-up in every worker (a sleep)")
    parser.add_argument("--setup-cpu", action="store_true", help="the set-up computes on one core instead")
    args = parser.parse_args()
    LAUNCHERS["resilrun"][0][-1] = str(args.spares)
    for name in OPTIONAL:
        OPTIONAL[name][0][-1] = str(args.spares)
    if args.baseline is not None:
        if not (args.baseline / "resilrun" / "__init__.py").is_file():
            parser.error(f"--baseline {args.baseline}: no resilrun package there (give a checkout's root)")
        args.baseline = args.baseline.resolve()
        LAUNCHERS["resilrun-baseline"] = LAUNCHERS["resilrun"]
    if args.launchers:
        chosen = [n.strip() for n in args.launchers.split(",") if n.strip()]
        LAUNCHERS.update({name: OPTIONAL[name] for name in chosen if name in OPTIONAL})
        unknown = sorted(set(chosen) - set(LAUNCHERS))
        if unknown or "resilrun" not in chosen:
            known = ", ".join([*LAUNCHERS, *OPTIONAL])
            parser.error(f"--launchers {args.launchers}: choose from {known}, resilrun included")
        for name in list(LAUNCHERS):
            if name not in chosen and name != "resilrun-baseline":
                del LAUNCHERS[name]
    if args.quick:
        args.sizes, args.kills = "64", 1
    sizes = [int(s) for s in args.sizes.split(",") if s]
    args.out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="resilrun-recovery-"))
    names, runs, started = list(LAUNCHERS), [], time.time()
    for mib in sizes:
        plan = [(False, i) for i in range(1)] + [(True, i) for i in range(args.kills)]
        for killed, i in plan:
            for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate who goes first
                runs.append(run_one(name, mib, killed, args, len(runs)))
    print(
        f"{NPROC} ranks, --standalone, gloo, {os.cpu_count()} cores; {args.steps} steps, rank 1 SIGKILLed when "
        f"step {args.kill_step} starts; set-up {args.setup:g} s; DCP every 10 steps (torchrun); "
        f"{args.kills} kill(s) per row; "
        f"total {time.time() - started:.0f} s; logs in {args.out_dir}\n"
    )
    print(report(runs, sizes, args.kill_step))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=2, default=str), "utf-8")
    if any(r["status"] != "ok" for r in runs if r["launcher"] == "resilrun"):
        sys.exit(1)


if __name__ == "__main__":
    main()
