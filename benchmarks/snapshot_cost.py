"""What per-step snapshots cost training: time blocked per snapshot, and step time vs torchrun.

    python benchmarks/snapshot_cost.py [--sizes 64,256] [--reps 7] [--runs 3] [--steps 20] [--json out.json]

Not part of the test suite: with the defaults it takes about 5 minutes on a quiet 2-core machine;
when other jobs load it, part 2 starts no launch after --budget seconds (reported as fewer runs),
and every subprocess is bounded by --timeout. It uses only loopback and a temp directory on disk.
Two parts, at each state size (MiB of params + Adam moments per rank):

1. Training time blocked per snapshot (``_snapshot_inproc.py``, one process per size): resilrun's
   commit (one ``next()`` of ``job.steps()`` against a real agent channel: collect state dicts,
   memcpy into the node-memory slot, commit message) next to a plain ``copy_`` of the same bytes
   into a pre-faulted buffer (the physical floor), ``torch.save`` + fsync and DCP save; repetitions
   interleaved, median and min-max, ratios to memcpy. Target (DESIGN.md §3): <= 1.5x memcpy.
2. Steady-state step time of one DDP script (``_snapshot_worker.py``: forward, backward, AdamW)
   under torchrun (no agent, so no snapshots) and under resilrun (a snapshot every step), plus
   resilrun without ``track``/``steps`` to tell launcher from snapshot cost. Launches are
   interleaved (the order rotates each round); ratios are paired by round. Target: <= 1.05x.

``--auto`` adds ``--snapshot-every auto`` rows (under ``--max-overhead``, default 3; with
``--replicas`` also one with ``--replicate-every auto``): the interval
is measured during the run, so use enough steps that the first windows (about 30 steps at one
snapshot every 6, and the steps after the first decision) are a small part, or leave them out
with ``--warmup``. Snapshots every N steps make the per-step median hide their cost, so the ratio
columns compare *mean* step times; the interval each run ended with is reported.

Peer replication: ``--replicas K`` adds a variant that runs the resilrun job as two agents
(``--nnodes 2``) on loopback with ``--replicas K``, so each snapshot has a peer to go to; it is
the §3 "1 replica" row; ``--encrypted`` adds the same with ``--peer-encryption``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch_overhead import clean_env, fmt, kill_tree, median

HERE = Path(__file__).resolve().parent
INPROC = HERE / "_snapshot_inproc.py"
WORKER = HERE / "_snapshot_worker.py"
TORCHRUN = ["-m", "torch.distributed.run"]
RESILRUN = ["-m", "resilrun", "--replicas", "0"]  # explicit: the single-node rows never replicate
# What both launchers give 2+ workers on one node; set for every run so 2-node rows match too.
ENV = {"OMP_NUM_THREADS": "1"}
METHODS = [
    ("memcpy", "memcpy `copy_` into pre-faulted memory (floor)"),
    ("memcpy_memfd", "memcpy into a pre-faulted memfd (tier-1 kind of memory)"),
    ("resilrun", "**resilrun commit** (`next(job.steps())`)"),
    ("torch_save", "`torch.save` + fsync"),
    ("dcp_save", "DCP `save` (fsync)"),
]


@dataclass(frozen=True)
class Variant:
    """One way of running the worker: launcher, how many agents (nodes), extra worker flags."""

    name: str
    launcher: list[str]
    nodes: int = 1
    worker_args: list[str] = field(default_factory=list)


def variants(args: argparse.Namespace) -> list[Variant]:
    found = [
        Variant("torchrun", TORCHRUN),
        Variant("resilrun", RESILRUN),
        Variant("resilrun, no track/steps", RESILRUN, worker_args=["--plain-loop"]),
    ]
    auto = ["--snapshot-every", "auto", "--max-overhead", f"{args.max_overhead:g}"]
    if args.auto:
        found.append(Variant("resilrun --snapshot-every auto", [*RESILRUN, *auto]))
    if args.replicas:  # the one flag that adds the replicated row (needs a peer node: two agents)
        found.append(Variant("torchrun, 2 nodes", TORCHRUN, nodes=2))
        launcher = ["-m", "resilrun", "--replicas", str(args.replicas)]
        found.append(Variant(f"resilrun --replicas {args.replicas}, 2 nodes", launcher, nodes=2))
        if args.auto:
            found.append(Variant(f"resilrun --replicas {args.replicas} auto, 2 nodes", [*launcher, *auto], nodes=2))
            both = [*launcher, *auto, "--replicate-every", "auto"]
            found.append(Variant(f"resilrun --replicas {args.replicas} auto, replicas auto, 2 nodes", both, nodes=2))
        if args.encrypted:  # the same with the replica streams encrypted (AES-256-GCM)
            name = f"resilrun --replicas {args.replicas} --peer-encryption, 2 nodes"
            found.append(Variant(name, [*launcher, "--peer-encryption"], nodes=2))
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_TORCH_EXIT_ABORT = "terminate called without an active exception"


def parse_bench(stdout: str) -> dict[str, Any] | None:
    for line in stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return dict(json.loads(line.removeprefix("BENCH_JSON ")))
    return None


def run_procs(cmds: list[list[str]], timeout: float) -> tuple[list[int | None], str, str]:
    """Run ``cmds`` concurrently, each in its own session, bounded by ``timeout`` (then killed).

    Output goes to temp files, not pipes, so a chatty process can never block on a full pipe
    while we wait for another one.
    """
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(2 * len(cmds))]  # out, err
        procs = [
            subprocess.Popen(
                cmd,
                env=clean_env(ENV),
                stdout=files[2 * i],
                stderr=files[2 * i + 1],
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            for i, cmd in enumerate(cmds)
        ]
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                for other in procs:
                    kill_tree(other)
                codes.append(None)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for handle in files:
            handle.seek(0)
        texts = [handle.read() for handle in files]
    return codes, "".join(texts[0::2]), "".join(texts[1::2])


def run_inproc(mib: float, args: argparse.Namespace) -> dict[str, Any]:
    """Part 1 at one size: one fresh process, every method interleaved inside it."""
    cmd = [sys.executable, str(INPROC), "--state-mib", str(mib), "--reps", str(args.reps)]
    cmd += ["--threads", str(args.threads)] + (["--dir", args.dir] if args.dir else [])
    codes, out, err = run_procs([cmd], args.timeout)
    result = parse_bench(out)
    if codes[0] != 0 or result is None:
        print(f"  in-process {mib:g} MiB: FAILED ({codes[0]})\n" + err[-3000:], file=sys.stderr)
        return {"mib": mib, "error": f"exit {codes[0]}"}
    return {"mib": mib, **result}


def run_job(variant: Variant, mib: float, args: argparse.Namespace) -> dict[str, Any]:
    """Part 2: one launch of the worker; rank 0's per-step times, reduced to medians."""
    script = [str(WORKER), "--state-mib", str(mib), "--steps", str(args.steps), "--batch", str(args.batch)]
    script += ["--model", args.model]
    script += variant.worker_args
    topology = ["--standalone", "--nproc-per-node", str(args.nproc)]
    cmds = []
    if variant.nodes > 1:
        endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
        topology = ["--nnodes", str(variant.nodes), "--nproc-per-node", str(args.nproc // variant.nodes)]
        topology += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    for _ in range(variant.nodes):
        cmds.append([sys.executable, *variant.launcher, *topology, "--monitor-interval", "0.1", *script])
    began = time.monotonic()
    codes, out, err = run_procs(cmds, args.timeout)
    result = parse_bench(out)
    row: dict[str, Any] = {"variant": variant.name, "mib": mib, "nodes": variant.nodes, "rc": codes}
    row["wall"] = time.monotonic() - began
    # torch 2.13's gloo teardown sometimes aborts a worker at interpreter exit, after it finished
    # ("terminate called without an active exception"; resilrun's bootstrap skips that teardown). A
    # torchrun run that printed its results and died only of that still measured its steps.
    teardown_only = variant.launcher == TORCHRUN and result is not None and _TORCH_EXIT_ABORT in err
    if teardown_only:
        row["teardown_abort"] = True
    if (any(code != 0 for code in codes) and not teardown_only) or result is None:
        row["error"] = "timeout" if None in codes else f"exit {codes}"
        print(f"  {variant.name} {mib:g} MiB: FAILED ({row['error']})\n" + err[-3000:], file=sys.stderr)
        return row
    steady = slice(args.warmup, None)  # first steps: DDP warm-up, slot allocation + pre-faulting
    row.update(result)
    row["step_median"] = statistics.median(result["step"][steady])
    row["step_mean"] = statistics.fmean(result["step"][steady])  # what sparse snapshots cost, spread out
    row["commit_median"] = statistics.median(result["commit"][steady])
    row["slowest_median"] = statistics.median(result["commit_slowest"][steady])
    row["cpu_median"] = statistics.median(result["cpu"][steady])
    row["cpu_mean"] = statistics.fmean(result["cpu"][steady])
    messages = result["message"]  # one per snapshot: with sparse snapshots fewer than steps
    row["message_median"] = statistics.median(messages[steady] or messages) if messages else 0.0
    return row


ms = functools.partial(fmt, scale=1e3, digits=1)


def report_inproc(part1: list[dict[str, Any]], threads: int) -> list[str]:
    ok = [r for r in part1 if "times" in r]
    head = " | ".join(f"{r['state_bytes'] / 2**20:.0f} MiB (ms) | × memcpy" for r in ok)
    md = [
        f"Training time blocked per snapshot, one process, {threads} torch thread(s); ms, median (min–max) "
        f"of {len(ok[0]['times']['memcpy']) if ok else 0} interleaved repetitions; ratio of medians.",
        "",
        f"| method | {head} |",
        "|---|" + "---|---|" * len(ok),
    ]
    for key, label in METHODS:
        cells = [f"{ms(r['times'][key])} | {median(r['times'][key]) / median(r['times']['memcpy']):.2f}" for r in ok]
        md.append(f"| {label} | " + " | ".join(cells) + " |")
    parts = (("collect", "state_dict() + flatten"), ("message", "commit message (posted; answer read next commit)"))
    for key, label in parts:
        cells = [f"{ms(r['parts'][key])} | {median(r['parts'][key]) / median(r['times']['memcpy']):.2f}" for r in ok]
        md.append(f"| … of which {label} | " + " | ".join(cells) + " |")
    rest = [[t - c - m for t, c, m in zip(r["times"]["resilrun"], *r["parts"].values(), strict=True)] for r in ok]
    cells = [f"{ms(x)} | {median(x) / median(r['times']['memcpy']):.2f}" for x, r in zip(rest, ok, strict=True)]
    md.append("| … of which layout + per-tensor memcpy into the slot | " + " | ".join(cells) + " |")
    sizes = ", ".join(f"{r['commit_json_bytes'] / 1024:.1f} KiB" for r in ok)
    first = "; ".join(
        f"{r['state_bytes'] / 2**20:.0f} MiB: " + ", ".join(f"{t * 1e3:.0f}" for t in r["warmup_times"]["resilrun"])
        for r in ok
    )
    md.append(
        f"\nJSON values sent with every commit: {sizes}. First commits (allocate + pre-fault a slot, ms): {first}."
    )
    return md


def report_jobs(part2: list[dict[str, Any]], names: list[str], args: argparse.Namespace) -> list[str]:
    md = [
        f"Steady-state step time, DDP, {args.nproc} ranks, gloo, batch {args.batch}, {args.steps} steps "
        f"(first {args.warmup} left out); per run the median over steps, then median (min–max) over runs. "
        "Commit = time inside `steps()` between two loop bodies on rank 0 (and on the slowest rank, per step), "
        "of which posting the commit message to the agent (its answer is read "
        "at the next commit); CPU = CPU time of rank 0's process per step. "
        "Ratios to torchrun (same node count) are paired by round (launched one after the other), "
        "of *mean* step times (snapshots every N steps hide in a median); interval: the steps between "
        "snapshots each run ended with (auto rows).",
        "",
        "| MiB/rank | variant | ok runs | step (ms) | mean step (ms) | CPU/step (ms) | commit (ms) "
        "| … its message (ms) | slowest rank's commit (ms) | that ÷ step | interval | mean step ÷ torchrun "
        "| CPU ÷ torchrun |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mib in args.sizes:
        rows = [r for r in part2 if r["mib"] == mib]
        # each row against torchrun with as many nodes, launched in the same round
        base = {(r["round"], r["nodes"]): r for r in rows if r["variant"].startswith("torchrun") and "step_median" in r}
        for name in names:
            runs = [r for r in rows if r["variant"] == name]
            ok = [r for r in runs if "step_median" in r]
            if not ok:
                md.append(f"| {mib:g} | {name} | 0/{len(runs)} |" + " — |" * 10)
                continue
            paired = [(r, base[r["round"], r["nodes"]]) for r in ok if (r["round"], r["nodes"]) in base]
            steps = fmt([r["step_mean"] / b["step_mean"] for r, b in paired], 1, 3)
            intervals = [str(i) for i in sorted({r.get("interval") for r in ok if r.get("interval") is not None})]
            replicas = sorted({r.get("replica_interval") for r in ok if r.get("replica_interval") is not None})
            if replicas:  # --replicate-every auto: the steps between replicas too
                intervals.append(f"replicas ~{', '.join(map(str, replicas))}")
            cpus = fmt([r["cpu_mean"] / b["cpu_mean"] for r, b in paired], 1, 3)
            md.append(
                f"| {ok[0]['state_bytes'] / 2**20:.0f} | {name} | {len(ok)}/{len(runs)} | "
                f"{ms([r['step_median'] for r in ok])} | {ms([r['step_mean'] for r in ok])} | "
                f"{ms([r['cpu_median'] for r in ok])} | "
                f"{ms([r['commit_median'] for r in ok])} | {ms([r['message_median'] for r in ok])} | "
                f"{ms([r['slowest_median'] for r in ok])} | "
                f"{fmt([r['slowest_median'] / r['step_median'] for r in ok], 100, 1)} % | "
                f"{', '.join(intervals) or '—'} | {steps} | {cpus} |"
            )
    return md


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="MiB of tracked state per rank, comma-separated")
    parser.add_argument("--reps", type=int, default=7, help="part 1: repetitions per method")
    parser.add_argument("--threads", type=int, default=1, help="part 1: torch threads (launched workers get 1)")
    parser.add_argument("--dir", default="", help="part 1: where torch.save/DCP write (default: temp dir)")
    parser.add_argument("--runs", type=int, default=3, help="part 2: launches per variant and size")
    parser.add_argument("--steps", type=int, default=20, help="part 2: steps per launch")
    parser.add_argument("--warmup", type=int, default=4, help="part 2: first steps left out")
    parser.add_argument("--batch", type=int, default=64, help="part 2: samples per rank per step")
    parser.add_argument("--nproc", type=int, default=2, help="part 2: ranks (--nproc-per-node)")
    parser.add_argument("--replicas", type=int, default=0, help="part 2: add a 2-node row with --replicas K")
    parser.add_argument("--model", choices=["mlp", "gpt"], default="mlp", help="part 2: the MLP or examples' GPT")
    parser.add_argument("--auto", action="store_true", help="part 2: add --snapshot-every auto rows")
    parser.add_argument("--max-overhead", type=float, default=3.0, help="part 2: the auto rows' budget, percent")
    parser.add_argument("--encrypted", action="store_true", help="part 2: with --replicas, add a --peer-encryption row")
    parser.add_argument("--only", default="", help="part 2: run only these variants (names as reported, ';'-separated)")
    parser.add_argument("--skip", choices=["inproc", "jobs"], default=None, help="leave one part out")
    parser.add_argument("--timeout", type=float, default=240.0, help="per subprocess, seconds")
    parser.add_argument("--budget", type=float, default=480.0, help="no new launch after this many seconds")
    parser.add_argument("--json", default="", help="also write every raw result here")
    args = parser.parse_args()
    if args.replicas and args.nproc < 2:
        parser.error("--replicas runs two nodes of --nproc/2 ranks each: it needs --nproc >= 2")
    args.sizes = [float(s) for s in args.sizes.split(",")]
    started = time.monotonic()
    part1 = [] if args.skip == "inproc" else [run_inproc(mib, args) for mib in args.sizes]
    chosen = [] if args.skip == "jobs" else variants(args)
    if args.only:
        wanted = [name.strip() for name in args.only.split(";")]
        chosen = [v for v in chosen if v.name in wanted]
    part2: list[dict[str, Any]] = []
    launches = [
        (rnd, mib, variant)
        for rnd in range(args.runs if chosen else 0)
        for mib in args.sizes
        for variant in chosen[rnd % len(chosen) :] + chosen[: rnd % len(chosen)]
    ]
    for done, (rnd, mib, variant) in enumerate(launches):
        if time.monotonic() - started > args.budget:  # bounded in time: report what ran, say what did not
            print(f"time budget {args.budget:g} s spent: {done} of {len(launches)} launches ran", file=sys.stderr)
            break
        row = run_job(variant, mib, args)
        part2.append({**row, "round": rnd})
        print(
            f"round {rnd + 1}/{args.runs} {mib:g} MiB {variant.name}: "
            f"step {row.get('step_median', float('nan')) * 1e3:.1f} ms, "
            f"commit {row.get('commit_median', float('nan')) * 1e3:.1f} ms, wall {row['wall']:.1f} s",
            file=sys.stderr,
        )
    print(
        f"snapshot cost: {os.cpu_count()} cores, CPU/gloo, loopback; sizes {args.sizes} MiB/rank; "
        f"{time.monotonic() - started:.0f} s\n"
    )
    md = []
    if part1:
        md += report_inproc(part1, args.threads) + [""]
    if part2:
        md += report_jobs(part2, [v.name for v in chosen], args)
    print("\n".join(md))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "inproc": part1, "jobs": part2}, indent=1))
    if any("error" in r for r in part1 + part2):
        sys.exit(1)


if __name__ == "__main__":
    main()
