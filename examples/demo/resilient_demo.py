"""What resilrun is for, in well under a minute on one machine: a worker dies, training does not stop.

    python examples/demo/resilient_demo.py        (what `make demo` runs)

1. A DDP job on the three-call API (examples/train_checkpointless.py) runs on 2 workers with one hot
   spare; as step 20 starts, rank 1 is SIGKILLed (a rehearsed failure: ``RESILRUN_FAULTS``).
   The spare takes rank 1, rank 0 keeps its process, both resume from node memory at step 19.
2. The same job runs again without the failure, for the comparison.
3. The recovery's timeline (from the job's events file) and the verdict: are the final parameters
   of the run that lost a worker identical, bit for bit, to the failure-free run's?

Exits 0 when they are, 1 when not (or when a run failed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_checkpointless.py"
STEPS, KILL_AT = 40, 20
TRAIN_ARGS = ["--steps", str(STEPS), "--hidden", "64", "--sleep", "0.05"]


def _run(work: Path, name: str, faults: str, show: bool) -> tuple[int, Path, float]:
    """One job; its output is shown live when ``show``; returns (exit code, log dir, seconds)."""
    logs = work / name
    cmd = [sys.executable, "-m", "resilrun", "--standalone", "--nproc-per-node", "2", "--spares", "1"]
    cmd += ["--max-restarts", "0", "--log-dir", str(logs), str(SCRIPT), *TRAIN_ARGS]
    cmd += ["--checksum-file", str(work / f"{name}.sha"), *(["--progress"] if show else [])]
    env = {**os.environ, "RESILRUN_FAULTS": faults}
    started = time.monotonic()
    out = None if show else subprocess.DEVNULL
    code = subprocess.run(cmd, env=env, stdout=out, stderr=out, cwd=ROOT, check=False).returncode
    return code, logs, time.monotonic() - started


def _events(logs: Path) -> list[dict]:
    return [json.loads(line) for path in logs.rglob("events.jsonl") for line in path.read_text().splitlines()]


def _timeline(events: list[dict]) -> list[str]:
    """The recovery, as seconds after the worker died (wall clocks of one machine: comparable)."""
    failure = next((e for e in events if e["event"] == "failure_detected"), None)
    if failure is None:
        return ["(no failure was recorded)"]
    t0 = float(failure.get("failed_at") or failure["wall"])
    rows = [f"  {0.0:6.2f} s  rank {failure['rank']} died ({failure.get('signal') or failure.get('exit_code')})"]
    names = {
        "failure_detected": "the agent saw it",
        "spare_promoted": "a hot spare was given rank {rank}",
        "generation_entered": "generation {round}: the survivors keep their processes",
        "collectives_rebuilt": "rank {rank}: process group rebuilt",
        "state_transferred": "rank {rank}: state of step {step} restored from {tier}",
        "first_step": "rank {rank}: first step done (step {step})",
    }
    for event in events:
        label = names.get(event["event"])
        if label is None:
            continue
        at = float(event.get("at") or event["wall"])
        fields = {key: event.get(key, "?") for key in ("rank", "round", "step", "tier")}
        rows.append(f"  {at - t0:6.2f} s  {label.format(**fields)}")
    recovered = next((e for e in events if e["event"] == "recovered"), None)
    if recovered is not None:
        rows.append(f"  steps redone: {recovered['steps_redone']}; whole-job restarts: 0")
    return rows


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="resilrun-demo-"))
    print(f"resilrun demo: {STEPS} DDP steps on 2 workers + 1 hot spare; rank 1 is killed as step {KILL_AT} starts\n")
    code, logs, seconds = _run(work, "faulty", f"kill:rank=1,step={KILL_AT}", show=True)
    if code != 0:
        print(f"\nthe job failed (exit {code}); logs in {logs}", file=sys.stderr)
        return 1
    print(f"\nfinished in {seconds:.1f} s despite the failure. Running it again without the failure, to compare...")
    clean_code, clean_logs, clean_seconds = _run(work, "clean", "", show=False)
    if clean_code != 0:
        print(f"the failure-free run failed (exit {clean_code}); logs in {clean_logs}", file=sys.stderr)
        return 1
    print(f"failure-free run: {clean_seconds:.1f} s\n\nthe recovery, seconds after rank 1 died:")
    print("\n".join(_timeline(_events(logs))))
    faulty, clean = (work / "faulty.sha").read_text(), (work / "clean.sha").read_text()
    if faulty == clean:
        print(f"\nverdict: final parameters identical to a failure-free run (sha256 {faulty[:16]}...)")
        return 0
    print(f"\nverdict: final parameters DIFFER from the failure-free run ({faulty[:16]} vs {clean[:16]})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
