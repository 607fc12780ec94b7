"""Straggler detection on a running job (issue 48): false reports without one, time to name one.

    python benchmarks/stragglers.py [--quiet-s 120] [--slow-ms 10] [--json out.json]   # about 3 minutes

One resilrun job, ``--nproc-per-node 4`` workers of examples/train_checkpointless.py (DDP over
gloo, ``--sleep`` after each step as data loading would), on this machine. Rank ``--slow-rank``
runs under tests/helpers/slow_rank.py: for the first ``--quiet-s`` seconds it is like the others,
then each of its ``nn.Linear`` forwards takes ``--slow-ms`` longer (a throttled device). Meanwhile
``resilrun status --json`` is read as a user reads it, every ``--every`` seconds. Reported:

- false reports: status documents that named any rank before the slow-down (target 0), out of how
  many were read, and the compute times they showed (median and worst per rank);
- time from the slow-down's first slowed forward to the first document naming the slowed rank,
  and whether any other rank was named after it;
- the job's step time before and after (every rank waits for the straggler: torchrun, which cannot
  tell, shows the same slow-down with nothing to say which rank causes it).

The status command itself costs a couple of CPU seconds per read on this 2-core machine (it is a
Python process importing the package): it competes with training, as a monitoring loop would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_checkpointless.py"
SLOW = ROOT / "tests" / "helpers" / "slow_rank.py"


def _status(port: int) -> dict[str, Any] | None:
    argv = [sys.executable, "-m", "resilrun", "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    try:
        return (json.loads(out.stdout) if out.stdout.strip() else {}).get("data")
    except json.JSONDecodeError:
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet-s", type=float, default=120.0, help="seconds before the slow-down")
    parser.add_argument("--after-s", type=float, default=40.0, help="seconds watched after it")
    parser.add_argument("--slow-ms", type=float, default=10.0, help="added to each nn.Linear forward of the rank")
    parser.add_argument("--slow-rank", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--every", type=float, default=3.0, help="seconds between status reads")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stragglers-"))
    mark = work / "slowed"
    port = _free_port()
    env = {
        **os.environ,
        "SLOW_RANK": str(args.slow_rank),
        "SLOW_S": str(args.slow_ms / 1000),
        "SLOW_AFTER_S": str(args.quiet_s),
        "SLOW_MARK": str(mark),
    }
    argv = [
        sys.executable, "-m", "resilrun", "--nnodes", "1", "--nproc-per-node", str(args.nproc),
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "stragglers",
        str(SLOW), str(EXAMPLE), "--steps", "1000000", "--hidden", "256", "--sleep", "0.05",
    ]  # fmt: skip
    log = open(work / "job.log", "wb")  # noqa: SIM115 - closed below
    job = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    reads: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + args.quiet_s + args.after_s + 120
        while time.monotonic() < deadline and job.poll() is None:
            doc = _status(port)
            at = time.time()
            if doc and doc.get("ranks") and all(r.get("compute_s") for r in doc["ranks"]):
                reads.append(
                    {
                        "at": at,
                        "named": [s["rank"] for s in doc.get("stragglers", [])],
                        "compute_s": {r["rank"]: r["compute_s"] for r in doc["ranks"]},
                        "step_time_s": statistics.median(r["step_time_s"] for r in doc["ranks"] if r["step_time_s"]),
                    }
                )
                slowed = float(mark.read_text()) if mark.exists() else None
                if slowed is not None and at - slowed > args.after_s:
                    break
            time.sleep(args.every)
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()
    if not mark.exists():
        print(f"the slow-down never started: see {work / 'job.log'}", file=sys.stderr)
        return 1
    slowed = float(mark.read_text())
    before = [r for r in reads if r["at"] < slowed]
    after = [r for r in reads if r["at"] >= slowed]
    false = [r for r in before if r["named"]]
    first = next((r for r in after if args.slow_rank in r["named"]), None)
    wrong_after = [r for r in after if set(r["named"]) - {args.slow_rank}]
    per_rank = {
        rank: (statistics.median(r["compute_s"][rank] for r in before), max(r["compute_s"][rank] for r in before))
        for rank in (before[0]["compute_s"] if before else {})
    }
    result = {
        "reads_before": len(before),
        "false_reports": len(false),
        "compute_before_s": per_rank,
        "report_after_s": None if first is None else round(first["at"] - slowed, 2),
        "other_ranks_named_after": len(wrong_after),
        "step_time_before_s": statistics.median(r["step_time_s"] for r in before) if before else None,
        "step_time_after_s": statistics.median(r["step_time_s"] for r in after[len(after) // 2 :]) if after else None,
        "compute_after_s": after[-1]["compute_s"] if after else None,
    }
    print(
        f"{args.nproc} ranks, rank {args.slow_rank} slowed by {args.slow_ms:g} ms per nn.Linear forward after "
        f"{args.quiet_s:g} s; status read every {args.every:g} s"
    )
    print(f"before: {len(before)} reads, {len(false)} named a straggler (false reports)")
    for rank, (median, worst) in sorted(per_rank.items()):
        print(f"  rank {rank}: compute {median * 1000:.1f} ms median, {worst * 1000:.1f} ms worst read")
    print(
        f"after: rank {args.slow_rank} named {result['report_after_s']} s after its first slowed forward; "
        f"other ranks named in {len(wrong_after)} of {len(after)} reads"
    )
    if result["step_time_before_s"] and result["step_time_after_s"]:
        print(
            f"step time (every rank waits for the straggler): {result['step_time_before_s'] * 1000:.1f} ms before, "
            f"{result['step_time_after_s'] * 1000:.1f} ms after"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if not false and first is not None and not wrong_after else 1


if __name__ == "__main__":
    raise SystemExit(main())
