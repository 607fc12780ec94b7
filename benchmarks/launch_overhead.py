"""Launch overhead and steady-state step time: resilrun vs torchrun, side by side in one run.

    python benchmarks/launch_overhead.py [--runs N] [--nproc 2] [--steps S] [--json out.json]

Why this shape: launch overhead is what a user pays on every start and restart, and on a small,
noisy machine it is dominated by starting Python processes, so the launchers are measured
interleaved (run i rotates the order) rather than one after the other, and reported as median
and min-max. torchrun is measured twice, plain and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
because the shared rendezvous store is torchrun's default but breaks its restarts (see
shared/anchors/measured_here.md). All launchers run the same unmodified ``_bench_worker.py``,
whose rank 0 stamps its start-up phases so the overhead can be split into "launcher" and
"worker" time. Every subprocess is bounded by --timeout; on expiry its whole process tree is
killed (torchrun puts workers in their own session, so killing the group alone is not enough).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).resolve().parent / "_bench_worker.py"
TORCHRUN = ["-m", "torch.distributed.run"]
LAUNCHERS: dict[str, tuple[list[str], dict[str, str]]] = {
    "resilrun": (["-m", "resilrun"], {}),
    "torchrun": (TORCHRUN, {}),
    "torchrun-noshare": (TORCHRUN, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}),
}
# (label, start stamp, end stamp); "t0" is just before Popen, the rest come from the worker.
PHASES = [
    ("launcher → worker process", "t0", "proc_created"),
    ("interpreter + bootstrap", "proc_created", "script_start"),
    ("import torch", "script_start", "torch_imported"),
    ("init_process_group", "torch_imported", "pg_ready"),
    ("model + DDP()", "pg_ready", "ddp_ready"),
    ("first step", "ddp_ready", "first_step"),
    ("last step → destroy_process_group done", "last_step", "pg_destroyed"),
    ("→ launcher exited", "pg_destroyed", "end"),
]
# Stderr lines stamped on arrival: any launcher's first line (torchrun: its OMP_NUM_THREADS
# warning; resilrun: "agent: run ..." once its store is open), then resilrun's agent log.
LOG_MARKS = {
    "first_stderr": "",
    "round_formed": "round 0 formed",
    "workers_done": "workers finished",
    "job_finished": "job finished",
}
LOG_ROWS = [
    ("(log: launcher's first stderr line)", "first_stderr"),
    ("(log: resilrun round 0 formed)", "round_formed"),
    ("(log: resilrun workers finished)", "workers_done"),
    ("(log: resilrun job finished)", "job_finished"),
]
IMPORTS = {
    "python (no import)": "pass",
    "resilrun.cli": "import resilrun.cli",
    "torch.distributed.run": "import torch.distributed.run",
}


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """The parent's environment minus launcher settings, so no stray PET_*/MASTER_* skews a run."""
    drop = ("PET_", "RESILRUN_", "TORCHELASTIC_", "MASTER_", "TORCH_DISABLE_SHARE_RDZV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, **extra}


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the launcher, its process group and every descendant (workers may be in another)."""
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # noqa: BLE001 - psutil missing or the launcher already gone
        children = []
    for child in children:
        with contextlib.suppress(Exception):  # already exited
            child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_timed(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run ``cmd`` in its own session; stamp every output line on arrival; bound it by timeout."""
    lines: list[tuple[float, str, str]] = []

    def pump(stream: Any, name: str) -> None:
        for line in stream:
            lines.append((time.time(), name, line.rstrip("\n")))

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    pumps = [
        threading.Thread(target=pump, args=(s, n), daemon=True) for s, n in ((proc.stdout, "out"), (proc.stderr, "err"))
    ]
    for thread in pumps:
        thread.start()
    try:
        rc: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        rc = None
    end = time.time()
    for thread in pumps:
        thread.join(timeout=5)
    # CPU of the launcher and every descendant it reaped (runs are sequential, so the delta is
    # this run's): unlike wall time, barely moved by another user's load on a shared machine.
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"t0": t0, "end": end, "rc": rc, "lines": lines, "cpu": cpu}


def run_launcher(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One launch of the benchmark worker; returns the stamps, derived times and errors."""
    prefix, extra = LAUNCHERS[name]
    cmd = [
        sys.executable,
        *prefix,
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        "--monitor-interval",
        str(args.monitor_interval),
        str(WORKER),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--hidden",
        str(args.hidden),
    ]
    res = run_timed(cmd, clean_env(extra), args.timeout)
    stamps: dict[str, float] = {"t0": res["t0"], "end": res["end"]}
    for arrived, stream, line in res["lines"]:
        words = line.split()
        if stream == "out" and "BENCH" in words and len(words) > words.index("BENCH") + 2:
            at = words.index("BENCH")
            stamps[words[at + 1]] = float(words[at + 2])
        for key, mark in LOG_MARKS.items():
            if stream == "err" and mark in line and key not in stamps:
                stamps[key] = arrived
    out: dict[str, Any] = {
        "launcher": name,
        "rc": res["rc"],
        "stamps": stamps,
        "total": res["end"] - res["t0"],
        "cpu": res["cpu"],
    }
    ok = res["rc"] == 0 and "first_step" in stamps and "step_time" in stamps
    if ok:
        out["launch"] = stamps["first_step"] - stamps["t0"]
        out["step_time"] = stamps["step_time"]
        out["rank0_cpu"] = stamps.get("cpu_first_step", float("nan"))
        for label, a, b in PHASES:
            out.setdefault("phases", {})[label] = stamps.get(b, float("nan")) - stamps[a]
        for label, key in LOG_ROWS:
            out["phases"][label] = stamps.get(key, float("nan")) - stamps["t0"]
    else:
        tail = [line for _, _, line in res["lines"]][-15:]
        out["error"] = "timeout" if res["rc"] is None else f"exit {res['rc']}"
        print(f"  {name}: FAILED ({out['error']})\n    " + "\n    ".join(tail), file=sys.stderr)
    return out


def import_time(stmt: str, timeout: float) -> tuple[float, float]:
    """(wall, CPU) of a fresh ``python -c stmt``: what a launcher pays before it can do anything."""
    res = run_timed([sys.executable, "-c", stmt], clean_env({}), timeout)
    return (res["end"] - res["t0"], res["cpu"]) if res["rc"] == 0 else (float("nan"),) * 2


def fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """``median (min–max)`` of the finite values, or an em dash when there are none."""
    vals = [v * scale for v in values if v == v]
    if not vals:
        return "—"
    med = statistics.median(vals)
    return f"{med:.{digits}f} ({min(vals):.{digits}f}–{max(vals):.{digits}f})"


def median(values: list[float]) -> float:
    vals = [v for v in values if v == v]
    return statistics.median(vals) if vals else float("nan")


def report(results: list[dict[str, Any]], imports: dict[str, list[tuple[float, float]]]) -> str:
    """The Markdown tables: headline figures, ratios, the start-up breakdown, import times."""
    names = list(LAUNCHERS)
    ok = {n: [r for r in results if r["launcher"] == n and "launch" in r] for n in names}
    runs = {n: sum(r["launcher"] == n for r in results) for n in names}
    md = [
        "| launcher | ok runs | launch → first step (s) | total wall (s) | step time (ms) "
        "| job CPU (s) | rank-0 CPU to first step (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in names:
        rs = ok[n]
        md.append(
            f"| {n} | {len(rs)}/{runs[n]} | {fmt([r['launch'] for r in rs])} | "
            f"{fmt([r['total'] for r in rs])} | {fmt([r['step_time'] for r in rs], 1e3)} | "
            f"{fmt([r['cpu'] for r in rs])} | {fmt([r['rank0_cpu'] for r in rs])} |"
        )
    keys = ("launch", "total", "step_time", "cpu", "rank0_cpu")
    md += [
        "",
        "| ratio (medians) | launch → first step | total wall | step time | job CPU | rank-0 CPU to first step |",
        "|---|---|---|---|---|---|",
    ]
    for base in names[1:]:
        cells = [
            median([r[k] for r in ok["resilrun"]]) / median([r[k] for r in ok[base]])
            if ok["resilrun"] and ok[base]
            else float("nan")
            for k in keys
        ]
        md.append(f"| resilrun / {base} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    labels = [p[0] for p in PHASES] + [row[0] for row in LOG_ROWS]
    md += [
        "",
        "Start-up breakdown, rank 0 (s, median (min–max)); init_process_group and DDP() "
        "end in collectives, so they include waiting for the slowest rank; the log rows are "
        "arrival times from the launch.",
        "",
        "| phase | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label in labels:
        cells = [fmt([r["phases"].get(label, float("nan")) for r in ok[n]]) for n in names]
        md.append(f"| {label} | " + " | ".join(cells) + " |")
    md += ["", "| fresh `python -c` | wall (s) | CPU (s) |", "|---|---|---|"]
    md += [
        f"| {label} | {fmt([v[0] for v in vals])} | {fmt([v[1] for v in vals])} |" for label, vals in imports.items()
    ]
    return "\n".join(md)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="repetitions per launcher")
    parser.add_argument("--nproc", type=int, default=2, help="workers (--nproc-per-node)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the step time")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP hidden size")
    parser.add_argument(
        "--monitor-interval", type=float, default=0.1, help="passed to both launchers (0.1 is both defaults)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per subprocess, seconds")
    parser.add_argument("--json", default="", help="also write raw runs and stamps here")
    args = parser.parse_args()
    names = list(LAUNCHERS)
    results: list[dict[str, Any]] = []
    imports: dict[str, list[tuple[float, float]]] = {label: [] for label in IMPORTS}
    for i in range(args.runs):
        order = names[i % len(names) :] + names[: i % len(names)]  # rotate who goes first
        for name in order:
            res = run_launcher(name, args)
            results.append(res)
            print(
                f"run {i + 1}/{args.runs} {name}: launch {res.get('launch', float('nan')):.2f} s,"
                f" total {res['total']:.2f} s, rc {res['rc']}",
                file=sys.stderr,
            )
        for label, stmt in IMPORTS.items():
            imports[label].append(import_time(stmt, args.timeout))
    print(
        f"nproc {args.nproc}, steps {args.steps} (warm-up {args.warmup}), hidden {args.hidden}, "
        f"runs {args.runs}, monitor-interval {args.monitor_interval}, --standalone, "
        f"CPU/gloo, {os.cpu_count()} cores\n"
    )
    print(report(results, imports))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "runs": results, "imports": imports}, indent=2), encoding="utf-8"
        )
    if any("launch" not in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
