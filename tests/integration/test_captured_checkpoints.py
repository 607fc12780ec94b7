"""An unmodified torchrun script that checkpoints itself (the tutorial's pattern: every node's local
rank 0 ``torch.save``s ``snapshot.pt`` every few epochs, every worker loads it at start if
``os.path.exists``), run with ``--capture-dir``: its snapshot survives a save torn by the writer's
death, the loss of the host that wrote it (each host with its own folder, no shared file system),
and a job restarted on fresh folders from the persistent tier.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.integration.conftest import (
    PORT,
    Launch,
    assert_nothing_left,
    drop_off,
    events,
    wait_for,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "examples" / "train_snapshot_torchrun.py"
TORN = ROOT / "tests" / "helpers" / "torn_save.py"
CAPTURE = ["--capture-dir", ".", "--capture-pattern", "snapshot.pt"]


def finished(*launches: Launch) -> dict[int, tuple[int, str]]:
    """rank -> (last epoch, checksum) each worker printed as it finished."""
    found = {}
    pattern = r"\[rank (\d+)\] finished at epoch (\d+) checksum (\w+)"
    for launch in launches:
        for rank, epoch, digest in re.findall(pattern, launch.stdout()):
            found[int(rank)] = (int(epoch), digest)
    return found


def two_hosts_and_a_spare(
    cluster_of, tmp_path: Path, train: list[str], capture: list[str]
) -> tuple[Any, dict[str, Path], Launch, Launch, Launch]:  # noqa: ANN001 - the fixture's factory
    """h0 and h1 training, each from a folder of its own (no shared file system), replicating to each
    other, and h2 standing by as a spare node: (cluster, folders, h0, h1, h2) once all are running."""
    cluster, start = cluster_of(3)
    folders = {name: tmp_path / f"{name}_folder" for name in ("h0", "h1", "h2")}
    for folder in folders.values():
        folder.mkdir()
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
        "--heartbeat-timeout", "3", "--max-restarts", "2", *capture,
    ]  # fmt: skip
    first = [start(name, *flags, "--node-rank", name[1:], *train, cwd=folders[name]) for name in ("h0", "h1")]
    wait_for(lambda: any("round 0 formed" in n.stderr() for n in first), 150, "the round to form")
    spare = start("h2", *flags, *train, cwd=folders["h2"])
    wait_for(lambda: "standing by as a spare node" in spare.stderr(), 150, "the spare host")
    return cluster, folders, first[0], first[1], spare


def resumed_at(launch: Launch) -> list[int]:
    return [int(e) for e in re.findall(r"Resuming training from snapshot at Epoch (\d+)", launch.stdout())]


def local(tmp_path: Path, name: str, *argv: str, env: dict[str, str] | None = None) -> Launch:
    """One single-host job run from its own folder (the snapshot's folder)."""
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "resilrun", "--standalone", "--nproc-per-node", "2", *argv]
    return Launch(command, tmp_path / f"{name}.log", env=env, cwd=folder)


@pytest.mark.timeout(240)
def test_a_save_torn_by_the_writers_death_is_replaced_by_the_last_complete_snapshot(tmp_path: Path) -> None:
    # Given the tutorial script whose rank 0 is killed half way through its epoch-4 save: its
    # snapshot.pt is then a truncated zip, which torch.load refuses on every restart after
    train = [str(TORN), "10", "2"]
    job = local(tmp_path, "torn", "--max-restarts", "2", *CAPTURE, *train, env={"TORN_SAVE_EPOCH": "4"})
    # Then the job finishes: before the restart the folder got the epoch-2 snapshot back from memory
    assert job.wait(200) == 0, job.stderr()[-4000:]
    assert_nothing_left(job)
    assert resumed_at(job) == [2, 2]
    restored = events(job, kind="captured_restored")
    assert [(e["files"], e["sources"]) for e in restored] == [(["snapshot.pt"], {"memory": 1})]
    assert set(finished(job)) == {0, 1} and len({d for _, d in finished(job).values()}) == 1


@pytest.mark.timeout(240)
def test_a_job_restarted_on_fresh_folders_resumes_from_the_signed_persistent_copy(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    secret = tmp_path / "job.secret"
    secret.write_text("s" * 40)
    secret.chmod(0o600)
    flags = [*CAPTURE, "--checkpoint-uri", str(bucket), "--job-secret-file", str(secret)]
    # Given a first job that ran 6 epochs, its snapshot persisted
    first = local(tmp_path, "first", *flags, str(TUTORIAL), "6", "2")
    assert first.wait(200) == 0, first.stderr()[-4000:]
    # When the job is started again elsewhere (an empty folder) for 10 epochs
    second = local(tmp_path, "second", *flags, str(TUTORIAL), "10", "2")
    assert second.wait(200) == 0, second.stderr()[-4000:]
    # Then it resumed at the last epoch the first one saved, from the persistent tier
    assert resumed_at(second) == [4, 4]
    restored = events(second, kind="captured_restored")
    assert restored and restored[0]["sources"] == {"persistent": 1}
    # And without the job's secret nothing from the bucket reaches the script's torch.load
    third = local(tmp_path, "third", *CAPTURE, "--checkpoint-uri", str(bucket), str(TUTORIAL), "8", "2")
    assert third.wait(200) == 0, third.stderr()[-4000:]
    assert resumed_at(third) == [] and "not restored" in third.stderr()


@pytest.mark.timeout(400)
def test_a_replacement_host_without_a_shared_file_system_gets_the_snapshot_from_a_peer(
    cluster_of, tmp_path: Path
) -> None:
    # Given two hosts, each running the tutorial script from its own folder, and a third standing by
    train = [str(TUTORIAL), "24", "2", "--sleep", "0.08"]
    cluster, folders, survivor, doomed, spare = two_hosts_and_a_spare(cluster_of, tmp_path, train, CAPTURE)
    wait_for(lambda: "Epoch 6 | Training snapshot saved" in survivor.stdout(), 150, "the epoch-6 snapshot")
    assert not (folders["h2"] / "snapshot.pt").exists()
    # When h1 drops off the network
    drop_off(cluster, "h1", doomed)
    # Then the job finishes on h0 and h2 with every rank at the same epoch and the same parameters
    for node in (survivor, spare):
        assert node.wait(300) == 0, node.stderr()[-4000:]
    ends = finished(survivor, spare)
    assert set(ends) == {0, 1} and len(set(ends.values())) == 1, ends
    # because h2 found the snapshot in its own folder, put there from a peer before its worker started:
    # fetched from h0 at the take-over ("peer") or already pushed to the spare host as h0's replica
    # ("memory"); which of the two depends on whether a push reached h2 before h1 was lost
    assert resumed_at(spare) and min(resumed_at(spare)) >= 6, spare.stdout()[-3000:]
    assert resumed_at(spare) == resumed_at(survivor)[-len(resumed_at(spare)) :]
    restored = events(spare, kind="captured_restored")
    assert restored and restored[0]["files"] == ["snapshot.pt"], restored
    sources = restored[0]["sources"]
    assert sum(sources.values()) == 1 and set(sources) <= {"peer", "memory"}, sources
    assert (folders["h2"] / "snapshot.pt").exists()
    assert os.path.getsize(folders["h2"] / "snapshot.pt") > 0


DCP_LOOP = ROOT / "examples" / "train_dcp.py"


def dcp_resumes(launch: Launch) -> list[tuple[int, str, int, str]]:
    """(rank, folder, step, checksum) of each "resumed from" line of examples/train_dcp.py."""
    found = re.findall(r"\[rank (\d+)\] resumed from (\S+) at step (\d+) checksum (\w+)", launch.stdout())
    return [(int(r), folder, int(step), digest) for r, folder, step, digest in found]


def dcp_saved(launch: Launch) -> dict[str, str]:
    """folder -> checksum of the parameters rank 0 saved there."""
    return dict(re.findall(r"saved (step-\d+) in \S+ s checksum (\w+)", launch.stdout()))


@pytest.mark.timeout(240)
def test_a_dcp_loop_on_resilrun_tiers_resumes_resharded_in_a_fresh_folder_from_signed_storage(
    tmp_path: Path,
) -> None:
    bucket, secret = tmp_path / "bucket", tmp_path / "job.secret"
    secret.write_text("d" * 40)
    secret.chmod(0o600)
    tiers = ["--checkpoint-uri", str(bucket), "--job-secret-file", str(secret)]
    train = [str(DCP_LOOP), "--resilrun-tiers", "--save-every", "5"]
    # Given a 2-rank FSDP2 job saving with dcp.async_save through resilrun.checkpoint.StorageWriter
    first = Launch(
        [sys.executable, "-m", "resilrun", "--standalone", "--nproc-per-node", "2", "--capture-dir", "a", *tiers,
         *train, "--async", "--steps", "12"],
        tmp_path / "first.log", cwd=tmp_path,
    )  # fmt: skip
    assert first.wait(200) == 0, first.stderr()[-4000:]
    saved = dcp_saved(first)
    assert set(saved) == {"step-4", "step-9"}
    # When the job goes on as 1 rank on a node whose captured folder is empty
    second = Launch(
        [sys.executable, "-m", "resilrun", "--standalone", "--nproc-per-node", "1", "--capture-dir", "b", *tiers,
         *train, "--steps", "14"],
        tmp_path / "second.log", cwd=tmp_path,
    )  # fmt: skip
    assert second.wait(200) == 0, second.stderr()[-4000:]
    # Then it loaded the newest step from the persistent tier, resharded from 2 shards to 1, exactly
    assert dcp_resumes(second) == [(0, "step-9", 10, saved["step-9"])]
    restored = events(second, kind="captured_restored")
    assert restored and restored[0]["sources"] == {"persistent": 6}  # 2 folders x (2 shards + .metadata)


@pytest.mark.timeout(400)
def test_a_dcp_checkpoint_written_across_hosts_without_a_shared_file_system_is_whole_on_every_host(
    cluster_of, tmp_path: Path
) -> None:
    # Given unmodified DCP saves on two hosts, each into its own folder: each host holds only its
    # rank's shard, and only h0 the .metadata (which torch.distributed.checkpoint cannot load from)
    train = [str(DCP_LOOP), "--ddp", "--steps", "60", "--save-every", "5", "--sleep", "0.1"]
    capture = ["--capture-dir", "ckpt"]
    cluster, folders, survivor, doomed, spare = two_hosts_and_a_spare(cluster_of, tmp_path, train, capture)
    wait_for(lambda: "saved step-19" in survivor.stdout(), 150, "the step-19 checkpoint")
    # When h1 drops off the network
    drop_off(cluster, "h1", doomed)
    # Then both hosts of the next round load the same complete checkpoint, the parameters it saved
    # (the newest one if h1's shard of it reached h0 before h1 was lost, else the one before)
    for node in (survivor, spare):
        assert node.wait(300) == 0, node.stderr()[-4000:]
    saved = dcp_saved(survivor)
    resumes = dcp_resumes(survivor) + dcp_resumes(spare)
    assert {r for r, *_ in resumes} == {0, 1}, resumes
    folder, step = resumes[-1][1], resumes[-1][2]
    assert step >= 10 and all((f, s, d) == (folder, step, saved[Path(folder).name]) for _, f, s, d in resumes)
    # with every shard and the .metadata put in h2's folder before its worker started
    assert {p.name for p in (folders["h2"] / folder).iterdir()} >= {".metadata", "__0_0.distcp", "__1_0.distcp"}
    ends = finished_dcp(survivor, spare)
    assert set(ends) == {0, 1} and len(set(ends.values())) == 1, ends


def finished_dcp(*launches: Launch) -> dict[int, str]:
    found = {}
    for launch in launches:
        for rank, digest in re.findall(r"\[rank (\d+)\] finished \d+ steps checksum (\w+)", launch.stdout()):
            found[int(rank)] = digest
    return found


def workers_by_environ(launch: Launch) -> dict[str, set[int]]:
    """The launcher's worker processes by the RANK they were started with ("spare": a hot spare,
    started with no rank; /proc keeps the environment a process started with, not what it adopted)."""
    found: dict[str, set[int]] = {}
    for proc in psutil.Process(launch.pid).children():
        with contextlib.suppress(psutil.Error):
            environ = proc.environ()
            key = "spare" if environ.get("RESILRUN_SPARE") == "1" else environ.get("RANK", "?")
            found.setdefault(key, set()).add(proc.pid)
    return found


@pytest.mark.timeout(240)
def test_an_unmodified_script_reruns_in_the_survivors_process_and_a_spare_takes_the_killed_rank(
    tmp_path: Path,
) -> None:
    # Given the tutorial script, unmodified, with a hot spare and the in-process re-run opted in
    train = [str(TUTORIAL), "10", "1", "--sleep", "0.1"]
    flags = ["--spares", "1", "--rerun-in-process", *CAPTURE, "--max-restarts", "0"]
    job = local(tmp_path, "rerun", *flags, *train)
    wait_for(lambda: "[rank 1] Epoch 3 done" in job.stdout(), 150, "rank 1's epoch 3")
    before = workers_by_environ(job)
    assert len(before.get("0", ())) == len(before.get("1", ())) == 1, before
    # When rank 1's process is killed
    (doomed,) = before["1"]
    os.kill(doomed, signal.SIGKILL)
    # Then the job finishes without a restart
    assert job.wait(200) == 0, job.stderr()[-4000:]
    assert "restarting the job" not in job.stderr(), job.stderr()[-4000:]
    # rank 0 kept its process (it re-ran the script in it) and the spare took rank 1
    entered = events(job, kind="generation_entered")
    assert entered and entered[-1]["ranks"] == [0, 1], entered
    assert entered[-1]["pids"][0] in before["0"], (entered, before)
    assert entered[-1]["pids"][1] in before.get("spare", set()), (entered, before)
    assert "recovering in-process into generation 1" in job.stderr()
    assert [e["rerun"] for e in events(job, kind="spare_promoted")] == [True]  # the survivors re-ran the script
    # and both ranks resumed from the same snapshot, the one saved before the kill
    resumes = re.findall(r"\[rank (\d)\] Resuming training from snapshot at Epoch (\d+)", job.stdout())
    assert sorted(r for r, _ in resumes) == ["0", "1"], job.stdout()[-3000:]
    assert len({e for _, e in resumes}) == 1 and int(resumes[0][1]) >= 2, resumes
    ends = finished(job)
    assert set(ends) == {0, 1} and len(set(ends.values())) == 1, ends
    assert_nothing_left(job)


@pytest.mark.timeout(240)
def test_a_save_torn_by_the_writers_death_is_put_back_before_the_survivor_reruns_the_script(tmp_path: Path) -> None:
    # Given the tutorial script whose rank 0 is killed half way through its epoch-4 save, re-run
    # in-process: the survivor (rank 1) loads snapshot.pt as soon as it re-runs the script
    train = [str(TORN), "10", "2"]
    flags = ["--spares", "1", "--rerun-in-process", *CAPTURE, "--max-restarts", "0"]
    job = local(tmp_path, "torn_rerun", *flags, *train, env={"TORN_SAVE_EPOCH": "4"})
    # Then the job finishes without a restart, both ranks from the epoch-2 snapshot put back
    assert job.wait(200) == 0, job.stderr()[-4000:]
    assert "restarting the job" not in job.stderr(), job.stderr()[-4000:]
    assert "the survivors re-run the script in their processes" in job.stderr()
    assert [e["rerun"] for e in events(job, kind="spare_promoted")] == [True]
    assert resumed_at(job) == [2, 2], job.stdout()[-3000:]
    assert set(finished(job)) == {0, 1} and len({d for _, d in finished(job).values()}) == 1
    assert_nothing_left(job)


@pytest.mark.timeout(240)
def test_a_script_with_a_thread_of_its_own_restarts_instead_and_says_why(tmp_path: Path) -> None:
    # Given the tutorial script beside a non-daemon thread of its own, re-run in-process opted in
    train = [str(ROOT / "tests" / "helpers" / "own_thread.py"), "10", "1", "--sleep", "0.1"]
    flags = ["--spares", "1", "--rerun-in-process", *CAPTURE, "--max-restarts", "1"]
    job = local(tmp_path, "own_thread", *flags, *train)
    wait_for(lambda: "[rank 1] Epoch 3 done" in job.stdout(), 150, "rank 1's epoch 3")
    # When rank 1's process is killed
    (doomed,) = workers_by_environ(job)["1"]
    os.kill(doomed, signal.SIGKILL)
    # Then the job restarts the torchrun way, and says why it could not re-run in-process
    assert job.wait(200) == 0, job.stderr()[-4000:]
    assert "cannot re-run its script in-process" in job.stderr() and "prefetcher" in job.stderr()
    assert "restarting the job" in job.stderr()
    assert set(finished(job)) == {0, 1} and len({d for _, d in finished(job).values()}) == 1
    assert_nothing_left(job)
