"""With every node's memory gone, a job resumes from the persistent tier (directory or S3)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resilrun.errors import ExitCode
from resilrun.snapshot.layout import parse_header
from resilrun.storage import LocalStorage
from resilrun.tiers import _manifest as m
from resilrun.tiers import durable
from tests.helpers.forgery import forged_keeping_crc32
from tests.integration.conftest import ROOT
from tests.integration.test_tier1_restore import ARGS, EXAMPLE, _clean_checksum

pytestmark = pytest.mark.integration


def _crash_then_resume(launcher, tmp_path: Path, uri: str, *extra: str) -> tuple[str, str]:
    flags = ["--standalone", "--nproc-per-node", "2", "--checkpoint-uri", uri, "--persist-every", "5", *extra]
    # Given a job that persisted steps 4, 9, 14, 19 and then died at step 22 with no restart left
    # (rank 0 exits there, and again in the process that replaces it in-process)
    plan = "exit:rank=0,step=22,code=3; exit:rank=0,step=22,attempt=1,code=3"
    first = launcher("resilrun", *flags, str(EXAMPLE), *ARGS, env={"RESILRUN_FAULTS": plan})
    assert first.wait(150) == 1, first.stderr()[-3000:]
    # When a new job (new agents: node memory is empty) starts on the same checkpoint URI
    target = tmp_path / "resumed.sha"
    second = launcher("resilrun", *flags, str(EXAMPLE), *ARGS, "--checksum-file", str(target))
    assert second.wait(150) == 0, second.stderr()[-3000:]
    return second.stderr(), target.read_text()


def test_new_job_resumes_from_the_newest_complete_step_in_a_directory(launcher, tmp_path: Path) -> None:
    err, checksum = _crash_then_resume(launcher, tmp_path, str(tmp_path / "ckpt"))
    # Then it resumes at step 19 from storage and ends bitwise equal to a failure-free run
    assert "rank 0 resumed from step 19 (persistent storage)" in err
    assert "rank 1 resumed from step 19 (persistent storage)" in err
    assert checksum == _clean_checksum(launcher, tmp_path, 2)


@pytest.mark.s3
def test_new_job_resumes_from_s3(launcher, tmp_path: Path, s3_server, s3_bucket: str) -> None:
    uri = f"s3://{s3_bucket}/run1"
    err, checksum = _crash_then_resume(launcher, tmp_path, uri, "--s3-endpoint-url", s3_server.endpoint_url)
    assert "rank 1 resumed from step 19 (persistent storage)" in err
    assert checksum == _clean_checksum(launcher, tmp_path, 2)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert "run1/step_000000000019/COMPLETE.json" in keys


def test_uploads_still_due_when_the_job_ends_are_written_under_the_fence(launcher, tmp_path: Path) -> None:
    # Given a job whose uploads each start 3 s late (a slow storage link), longer than the write
    # fence's lease would last once heartbeats stopped (half of --heartbeat-timeout 4)
    ckpt = tmp_path / "ckpt"
    flags = ["--standalone", "--nproc-per-node", "2", "--checkpoint-uri", str(ckpt), "--persist-every", "5"]
    run = launcher(
        "resilrun", *flags, "--heartbeat-timeout", "4", str(EXAMPLE), "--steps", "10", "--hidden", "32",
        env={"RESILRUN_FAULT_PERSIST_DELAY_S": "3"},
    )  # fmt: skip
    # Then the uploads still due when training ends are written before the agent leaves: its
    # heartbeats go on until they are, so the fence never refuses its own last step
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert "not writing to the persistent tier" not in run.stderr()
    assert durable.latest_complete_step(LocalStorage(ckpt)) == 9


def test_with_a_job_secret_the_bucket_is_authenticated_and_a_forged_step_is_refused(launcher, tmp_path: Path) -> None:
    # Given a job run with a secret file, which persisted steps 4-19 with MACs and then died at 22
    secret = tmp_path / "job.secret"
    secret.write_text("s" * 40 + "\n")
    secret.chmod(0o600)
    root = tmp_path / "ckpt"
    flags = ["--standalone", "--nproc-per-node", "2", "--checkpoint-uri", str(root), "--persist-every", "5"]
    flags += ["--job-secret-file", str(secret)]
    plan = "exit:rank=0,step=22,code=3; exit:rank=0,step=22,attempt=1,code=3"
    first = launcher("resilrun", *flags, str(EXAMPLE), *ARGS, env={"RESILRUN_FAULTS": plan})
    assert first.wait(150) == 1, first.stderr()[-3000:]
    # Then inspect-checkpoint given the secret calls the newest step authentic
    inspect = [sys.executable, "-m", "resilrun", "inspect-checkpoint", str(root), "--job-secret-file", str(secret)]
    shown = subprocess.run(inspect, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert shown.returncode == 0 and "authentic: every MAC verifies" in shown.stdout, shown.stderr
    # When someone who can write the bucket, but has no secret, changes a weight of step 19's rank 1
    # and keeps every crc32 (crc32 is affine: 4 bytes chosen make any change pass)
    file = root / m.data_key(19, 1)
    data = file.read_bytes()
    layout = parse_header(memoryview(data), len(data))
    entry = max(layout.entries, key=lambda e: e.end - e.begin)
    at = layout.data_start + entry.begin
    file.write_bytes(forged_keeping_crc32(data, at, at + 8))
    assert durable.read_rank(LocalStorage(root), 19, 1, verify=True)  # every checksum still passes
    # Then a new job given the secret refuses the step: nothing forged is trained on
    resumed = launcher("resilrun", *flags, str(EXAMPLE), *ARGS)
    assert resumed.wait(150) == ExitCode.CHECKPOINT
    err = resumed.stderr()
    assert "rank 1's file is not authentic" in err and "resumed from step" not in err, err[-3000:]
    assert err.count("could not restore step 19") == 1  # refused at once: not retried, no spare tried
    assert "the job's state was refused" in err and "inspect-checkpoint --verify" in err
    shown = subprocess.run(inspect, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert shown.returncode == 4 and "not authentic" in shown.stderr


def test_under_require_auth_a_planted_unsigned_step_is_refused(launcher, tmp_path: Path) -> None:
    # Given a bucket holding complete steps without MACs, with every crc32 right: what someone who
    # can write the bucket, but has no secret, plants (here written by a job run without a secret)
    root = tmp_path / "ckpt"
    flags = ["--standalone", "--nproc-per-node", "2", "--checkpoint-uri", str(root), "--persist-every", "5"]
    planted = launcher("resilrun", *flags, str(EXAMPLE), *ARGS, env={"RESILRUN_JOB_SECRET": ""})
    assert planted.wait(150) == 0, planted.stderr()[-3000:]
    assert any(root.rglob("COMPLETE.json"))
    # When a job given the secret and --require-auth starts on that bucket
    secret = tmp_path / "job.secret"
    secret.write_text("s" * 40 + "\n")
    secret.chmod(0o600)
    resumed = launcher("resilrun", *flags, "--job-secret-file", str(secret), "--require-auth", str(EXAMPLE), *ARGS)
    # Then it refuses the step (exit 4) rather than train on it (issue 43, F1)
    assert resumed.wait(150) == ExitCode.CHECKPOINT, resumed.stderr()[-3000:]
    err = resumed.stderr()
    assert "carries no MAC" in err and "resumed from step" not in err, err[-3000:]
