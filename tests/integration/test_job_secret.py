"""The job secret from outside the rendezvous store (issue 19): a private file every node reads.

With ``--job-secret-file`` the secret never enters the store, so a process that can reach the
store's port (c10d's TCPStore has no authentication) finds nothing there to read or forge replicas
with; a node given another secret than the job's stops at once, saying why; a lax file or a
required secret that is missing stops the launch at once.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from resilrun import keys
from tests.conftest import free_port
from tests.integration.conftest import EXAMPLE, assert_nothing_left, clean_checksum, run_resilrun, wait_for

pytestmark = pytest.mark.integration

TRAIN = ["--steps", "40", "--hidden", "64", "--sleep", "0.1"]


def _secret_file(tmp_path: Path, name: str, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / name
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def _flags(port: int, run_id: str) -> list[str]:
    return [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--replicas", "1", "--max-restarts", "0",
    ]  # fmt: skip


def _peer_lag(port: int, run_id: str) -> list[int | None]:
    """Every node's ``tiers.peer.lag_steps`` in ``resilrun status --json``, as a user reads it."""
    done = run_resilrun("status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--json")
    document = json.loads(done.stdout).get("data") if done.stdout.strip() else None
    return [n["tiers"]["peer"].get("lag_steps") for n in (document or {}).get("nodes", [])]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("encrypted", [False, True], ids=["mac", "peer-encryption"])
def test_with_a_secret_file_nothing_secret_is_in_the_store_and_replicas_flow(
    launcher, tmp_path: Path, encrypted: bool
) -> None:
    # Given two nodes replicating to each other, each given the same secret file (0600), with their
    # replica streams authenticated (the default) or also encrypted
    port, run_id = free_port(), "secret-file"
    secret = _secret_file(tmp_path, "job.secret", "f" * 64)
    target = tmp_path / "out.sha"
    flags = [*_flags(port, run_id), "--job-secret-file", str(secret), *(["--peer-encryption"] if encrypted else [])]
    # (their rendezvous store hosted outside the job, as a shared rendezvous service is: it outlives
    # the job, so what it holds is read after the job ended, not in a race with its end)
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    nodes = [launcher("resilrun", *flags, str(EXAMPLE), *TRAIN, "--checksum-file", str(target)) for _ in range(2)]
    # Then the job ends as a failure-free run does, with no word of an unprotected secret,
    for node in nodes:
        assert node.wait(150) == 0, node.stderr()[-3000:]
        assert_nothing_left(node)
        assert "no job secret given" not in node.stderr()
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *TRAIN)
    # the replicas were taken (both nodes' replicas kept up with training to its last step),
    lag = _peer_lag(port, run_id)
    assert len(lag) == 2 and all(v in (0, 1) for v in lag), lag
    # and a process that reaches the store's port finds no secret there
    assert not store.check([keys.job_secret(run_id)])


@pytest.mark.timeout(300)
@pytest.mark.timeout(300)
def test_a_node_given_another_secret_stops_at_once_and_the_job_goes_on_without_it(launcher, tmp_path: Path) -> None:
    # Given a job's first node, and a second node whose secret file is a stale copy
    port, run_id = free_port(), "secret-mismatch"
    good, stale = (_secret_file(tmp_path, f"job{i}.secret", str(i) * 32) for i in range(2))
    train = [str(EXAMPLE), "--steps", "20", "--hidden", "64"]
    first = launcher("resilrun", *_flags(port, run_id), "--job-secret-file", str(good), *train)
    wait_for(lambda: "resilrun agent:" in first.stderr(), 60, "the first node to host the store")
    wrong = launcher("resilrun", *_flags(port, run_id), "--job-secret-file", str(stale), *train)
    # Then the node with the other secret stops at once and says why, before writing anything
    assert wrong.wait(60) == 2, wrong.stderr()[-3000:]
    assert "resilrun: error: the job secrets differ" in wrong.stderr()
    assert "resilrun agent:" not in wrong.stderr()
    # and the job forms with a node that has the job's secret, and ends as usual
    second = launcher("resilrun", *_flags(port, run_id), "--job-secret-file", str(good), *train)
    for node in (first, second):
        assert node.wait(150) == 0, node.stderr()[-3000:]
    assert "does not carry this job's MAC" not in first.stderr() + second.stderr()


def test_a_secret_file_others_can_read_stops_the_launch_at_once(launcher, tmp_path: Path) -> None:
    lax = _secret_file(tmp_path, "job.secret", "a" * 32, mode=0o644)
    run = launcher("resilrun", *_flags(free_port(), "lax"), "--job-secret-file", str(lax), str(EXAMPLE))
    assert run.wait(60) == 2
    err = run.stderr()
    assert f"resilrun: error: --job-secret-file {lax} can be read by others (mode 0644)" in err
    assert f"hint: chmod 600 {lax}" in err
    assert "resilrun agent:" not in err  # nothing started: no store, no worker


def test_require_auth_refuses_a_multi_node_job_without_a_secret(launcher, tmp_path: Path) -> None:
    run = launcher(
        "resilrun", *_flags(free_port(), "auth"), "--require-auth", str(EXAMPLE), env={"RESILRUN_JOB_SECRET": ""}
    )
    assert run.wait(60) == 2
    assert "resilrun: error: --require-auth: no job secret given" in run.stderr()


def test_require_auth_refuses_a_single_node_job_with_a_persistent_tier_and_no_secret(launcher, tmp_path: Path) -> None:
    # A job of one node makes a random secret of its own, which can sign nothing a later job checks:
    # under --require-auth its persisted steps would be written and restored unsigned (issue 43, F1)
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "1", "--require-auth",
        "--checkpoint-uri", str(tmp_path / "ckpt"), str(EXAMPLE), "--steps", "3",
        env={"RESILRUN_JOB_SECRET": "", "RESILRUN_JOB_SECRET_FILE": ""},
    )  # fmt: skip
    assert run.wait(60) == 2, run.stderr()[-3000:]
    err = run.stderr()
    assert "resilrun: error: --require-auth with --checkpoint-uri: no job secret given" in err
    assert "hint: give the job a --job-secret-file" in err
    assert "resilrun agent:" not in err  # nothing started
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").rglob("*.json"))


@pytest.mark.timeout(300)
def test_a_rendezvous_document_replayed_from_an_earlier_job_is_refused_and_training_goes_on(
    launcher, tmp_path: Path
) -> None:
    # Given an earlier job that ran to its end under the same --rdzv-id and secret (a fixed
    # Kubernetes Secret and job name, a rerun), its last sealed document ("closed, succeeded") read
    # off its store by someone who could reach it (issue 43, F3)
    run_id, secret = "rerun", _secret_file(tmp_path, "job.secret", "r" * 64)
    flags = ["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-id", run_id, "--job-secret-file", str(secret)]
    stores = []
    for _ in range(2):  # each job's store hosted outside it, so it outlives the job (read afterwards)
        port = free_port()
        stores.append((port, TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)))
    (old_port, old_store), (port, store) = stores
    earlier = launcher("resilrun", *flags, "--rdzv-endpoint", f"127.0.0.1:{old_port}", str(EXAMPLE), "--steps", "2")
    assert earlier.wait(120) == 0, earlier.stderr()[-3000:]
    closed = old_store.get(keys.rdzv_state(run_id))
    # When the rerun is training and that document is written back into its store, with the
    # change hint its agents follow bumped
    target = tmp_path / "out.sha"
    rerun = launcher(
        "resilrun", *flags, "--rdzv-endpoint", f"127.0.0.1:{port}", str(EXAMPLE),
        "--steps", "40", "--hidden", "64", "--sleep", "0.1", "--progress", "--checksum-file", str(target),
    )  # fmt: skip
    wait_for(lambda: "step 3 " in rerun.stdout(), 120, "the rerun to train")
    store.set(keys.rdzv_state(run_id), closed)
    store.add(keys.rdzv_version(run_id), 1)
    store.add(keys.rdzv_phase(run_id), 1)
    # Then the rerun is not reported as succeeded early: it trains to its last step and ends as usual
    assert rerun.wait(150) == 0, rerun.stderr()[-3000:]
    assert "done: 40 steps" in rerun.stdout(), rerun.stdout()[-2000:]
    assert target.exists()
    assert "refused a rendezvous document of another job under this --rdzv-id" in rerun.stderr()
