"""The chaos run's markdown report: one row per fault kind, then the jobs' end state."""

from __future__ import annotations

import argparse
import statistics
from typing import Any


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "—"
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return f"{ordered[index]:.1f}" if q != 0.5 else f"{statistics.median(ordered):.1f}"


def report(jobs: list[dict[str, Any]], clean: str | None, args: argparse.Namespace) -> str:
    faults = [f for job in jobs for f in job["faults"]]
    kinds = [k for k in args.kinds if any(f["kind"] == k for f in faults)]
    for job in jobs:
        job.setdefault("clean", clean)
    equal_jobs = [j for j in jobs if j["checksum"] is not None and j["checksum"] == j["clean"]]
    md = [
        "| fault kind | injected | recovered | recovery s p50 | recovery s p95 | steps redone (max) | restarts | "
        "final state equal | leftover procs | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in kinds:
        rows = [f for f in faults if f["kind"] == kind]
        seconds = [f["recovery_s"] for f in rows if "recovery_s" in f]
        redone = [f["redone"] for f in rows if "redone" in f]
        in_equal = sum(1 for j in equal_jobs for f in j["faults"] if f["kind"] == kind)
        md.append(
            f"| {kind} | {len(rows)} | {sum(f['recovered'] for f in rows)} | {_pct(seconds, 0.5)} | "
            f"{_pct(seconds, 0.95)} | {sum(redone)} ({max(redone, default=0)}) | {sum(f['restarts'] for f in rows)} | "
            f"{in_equal}/{len(rows)} | {sum(f['victims_left'] for f in rows)} | {_notes(kind, rows)} |"
        )
    md.append(
        f"| **all** | {len(faults)} | {sum(f['recovered'] for f in faults)} | "
        f"{_pct([f['recovery_s'] for f in faults if 'recovery_s' in f], 0.5)} | "
        f"{_pct([f['recovery_s'] for f in faults if 'recovery_s' in f], 0.95)} | "
        f"{sum(f.get('redone', 0) for f in faults)} | {sum(f['restarts'] for f in faults)} | "
        f"{sum(len(j['faults']) for j in equal_jobs)}/{len(faults)} | {sum(f['victims_left'] for f in faults)} | |"
    )
    md += [
        "",
        "| seed | status | faults | wall s | final params equal to failure-free | leftover procs | "
        "processes holding the run's memfds | /dev/shm resilrun* files |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for job in jobs:
        md.append(
            f"| {job['seed']} | {job['status']} | {len(job['faults'])} | {job['wall_s']:.0f} | "
            f"{'yes' if job in equal_jobs else 'NO'} | {job['leftover_procs']} | "
            f"{job['leftover_memfd_holders']} | {len(job['leftover_shm_files'])} |"
        )
    return "\n".join(md)


def _notes(kind: str, rows: list[dict[str, Any]]) -> str:
    n = len(rows)
    if kind == "corrupt_replica":
        return (
            f"crc32 mismatch detected {sum(f['crc_detected'] for f in rows)}/{n}, re-planned "
            f"{sum(f['fell_back'] for f in rows)}/{n}, "
            f"resumed from persistent {sum(f['from_persistent'] for f in rows)}/{n}"
        )
    if kind == "shm_full":
        return f"'node memory is full' reported {sum(f['clear_error'] for f in rows)}/{n}"
    if kind == "adjacent_nodes":
        return f"resumed from persistent {sum(f['from_persistent'] for f in rows)}/{n}"
    if kind == "s3":
        modes: dict[str, int] = {}
        for f in rows:
            for mode in f.get("modes", []):
                modes[mode] = modes.get(mode, 0) + 1
        return "failed requests: " + ", ".join(f"{m} ×{c}" for m, c in sorted(modes.items()))
    if kind in ("worker_kill", "hang"):
        waited = [f for f in rows if (f.get("decided_s") or 0) > 1.0]
        warm = [f["recovery_s"] for f in rows if "recovery_s" in f and f not in waited and "decided_s" in f]
        if not waited:
            return ""
        return (
            f"{len(waited)}/{n} hit a node whose spare was still warming up (after an earlier fault) and waited "
            f"for it; with a warm spare p50 {_pct(warm, 0.5)} s"
        )
    return ""
