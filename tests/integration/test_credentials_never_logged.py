"""AWS credentials never reach a log, an error, or any output, whatever S3 does.

A job runs with (fake) credentials in its environment against moto, through a proxy that first
fails uploads for good (5xx), then answers with an auth error whose message echoes the request's
Authorization header back (some S3-compatible servers do: it carries the access key id), then
lets the rest through. ``inspect-checkpoint`` is run against the same echoing server. Every file
the runs wrote (launcher stdout/stderr, per-rank logs, error files) is grepped for the key id, the
secret and the session token.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY, FaultProxy
from tests.integration.conftest import ROOT
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = [pytest.mark.integration, pytest.mark.s3]

SESSION_TOKEN = "resilrunFakeSessionToken"  # tests.conftest's AWS_SESSION_TOKEN
ECHO = "The request you sent: {authorization}"


def _is_upload(method: str, path: str, headers: dict[str, str]) -> bool:
    return method == "PUT"


def _leaks(texts: dict[str, str]) -> list[str]:
    return [
        f"{name}: {secret[:8]}..."
        for name, text in texts.items()
        for secret in (FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY, SESSION_TOKEN)
        if secret in text
    ]


@pytest.mark.timeout(300)
def test_credentials_never_appear_in_logs_errors_or_output(
    launcher, tmp_path: Path, s3_proxy: FaultProxy, s3_bucket: str
) -> None:
    # Given a job persisting every 2 steps to S3 through a server that fails its first uploads
    # with 500s, then refuses the next ones with an auth error echoing the Authorization header
    s3_proxy.fail(500, "InternalError", times=12, match=_is_upload, message=ECHO)
    s3_proxy.fail(403, "InvalidAccessKeyId", times=6, match=_is_upload, message=ECHO)
    logs = tmp_path / "logs"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), "--redirects", "3", "--tee", "3",
        "--checkpoint-uri", f"s3://{s3_bucket}/run", "--s3-endpoint-url", s3_proxy.endpoint_url,
        "--persist-every", "2", str(EXAMPLE), "--steps", "24", "--hidden", "32", "--sleep", "0.1",
        env={"RESILRUN_FAULTS": "exit:rank=1,step=14,code=3; exit:rank=1,step=14,attempt=1,code=3",
             "RESILRUN_DEBUG": "1"},
    )  # fmt: skip
    # When it fails (rank 1 exits, and again in the process replacing it; no restart): the error
    # path renders too, with tracebacks (debug)
    assert run.wait(200) == 1, run.stderr()[-3000:]
    err = run.stderr()
    assert "could not persist step" in err and "InternalError" in err  # the failures were seen
    assert "InvalidAccessKeyId" in err and "<redacted>" in err  # and the echo was scrubbed
    # and inspect-checkpoint meets the same echoing auth error
    s3_proxy.fail(403, "InvalidAccessKeyId", times=20, message=ECHO)
    inspect = subprocess.run(
        [sys.executable, "-m", "resilrun", "inspect-checkpoint", f"s3://{s3_bucket}/run", "--s3-endpoint-url",
         s3_proxy.endpoint_url, "--json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert inspect.returncode != 0 and "InvalidAccessKeyId" in inspect.stdout + inspect.stderr
    # Then no file and no output anywhere carries the key id, the secret or the session token
    texts = {"stdout": run.stdout(), "stderr": err, "inspect": inspect.stdout + inspect.stderr}
    files = [p for p in [*logs.rglob("*"), *tmp_path.glob("resilrun_*")] if p.is_file()]
    assert files, "the per-rank logs were not written"
    texts.update({str(p.relative_to(tmp_path)): p.read_text(errors="replace") for p in files})
    assert _leaks(texts) == []
