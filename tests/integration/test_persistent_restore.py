"""With every node's memory gone, a job resumes from the persistent tier (directory or S3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from resilrun.storage import LocalStorage
from resilrun.tiers import durable
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
