"""A short, fixed-seed chaos run: a handful of different faults in one job, all recovered.

The full command (``benchmarks/chaos.py``) draws hundreds of faults from seeds; this is its
smallest form, fixed so that it is a regression test: a worker SIGKILL, a node lost with the
replicas of its ranks corrupted (crc32s catch it, the restore falls back to the persistent tier),
a SIGSTOP hang and failing S3 requests, in a three-node job with a spare node standing by. Then:
every fault recovered, the final parameters equal a failure-free run's, and no process, memfd or
/dev/shm file of the run is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.s3]

PLAN = "worker_kill,corrupt_replica,hang,s3"


# (about 55 s on 2 cores under the full suite: the bounds are about five times that)
@pytest.mark.timeout(300)
def test_a_fixed_seed_chaos_run_recovers_every_fault_bitwise_and_leaves_nothing(tmp_path: Path) -> None:
    pytest.importorskip("moto")
    out = tmp_path / "chaos.json"
    # Given one job of 90 steps with the four faults above, a step every ~0.05 s plus compute
    run = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", "--seed", "11", "--faults", "4", "--plan", PLAN, "--spare-nodes", "1",
         "--steps", "90", "--sleep", "0.05", "--gap", "3:5", "--time-budget", "200", "--out-dir", str(tmp_path / "run"),
         "--json", str(out)],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )  # fmt: skip
    report = json.loads(out.read_text()) if out.exists() else None
    assert report is not None, run.stderr[-3000:]
    (job,) = report["jobs"]
    faults = job["faults"]
    # Then all four were injected and recovered without a job restart,
    assert [f["kind"] for f in faults] == PLAN.split(","), run.stderr[-3000:]
    assert all(f["recovered"] for f in faults), json.dumps(faults, indent=1)
    assert sum(f["restarts"] for f in faults) == 0
    # the corrupt replica was caught by its crc32s and the restore fell back to the persistent tier,
    corrupt = faults[1]
    caught = corrupt["corrupted"] >= 1 and corrupt["crc_detected"]
    caught = caught and corrupt["fell_back"] and corrupt["from_persistent"]
    assert caught, json.dumps(corrupt, indent=1) + "\n" + "".join(_restore_lines(tmp_path / "run"))
    # the job finished bitwise equal to the failure-free run,
    assert job["status"] == "ok", run.stderr[-3000:]
    assert job["checksum"] == report["clean"] is not None
    # and nothing is left: processes, processes holding the run's memfds, /dev/shm files
    assert (job["leftover_procs"], job["leftover_memfd_holders"], job["leftover_shm_files"]) == (0, 0, [])
    assert all(f["victims_left"] == 0 for f in faults)
    assert run.returncode == 0


def _restore_lines(run_dir: Path) -> list[str]:
    """What the agents and workers said about restores: why a copy was not used (for a failure's message)."""
    words = ("cannot give", "could not be served", "lost its shared", "could not restore", "resumed", "unreachable")
    return [
        f"{log.relative_to(run_dir)}: {line}"
        for log in sorted(run_dir.rglob("*.err"))
        for line in log.read_text(errors="replace").splitlines(keepends=True)
        if any(word in line for word in words)
    ][-60:]
