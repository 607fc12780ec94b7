"""examples/slurm/train.sbatch through a real SLURM: slurmctld and a slurmd per namespace host.

The job really spans several SLURM nodes: srun starts one resilrun agent per node, each on its
own host (address, hostname, Debian-style /etc/hosts), as on a cluster. See
tests/helpers/slurm_cluster.py for the daemons and tests/helpers/netns_cluster.py for the hosts.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import slurm_cluster
from tests.helpers.netns_cluster import Cluster
from tests.helpers.netns_cluster import available as netns_available
from tests.helpers.slurm_cluster import SlurmCluster
from tests.integration.conftest import ROOT, clean_checksum, wait_for
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
# What a CPU-only cluster changes on the command line (the script asks for GPUs and 32 CPUs).
CPU_NODES = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=15"]


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    why = netns_available() or slurm_cluster.available()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the SLURM tests need network namespaces and SLURM in CI: {why}")
        pytest.skip(why)
    with Cluster(4) as cluster:
        daemons = SlurmCluster(cluster, tmp_path / "slurm").start()
        try:
            yield daemons
        finally:
            daemons.close()


def _submit(slurm: SlurmCluster, tmp_path: Path, train: list[str], **env: str) -> tuple[int, Path]:
    out = tmp_path / "job.out"
    settings = {
        "TRAIN": str(EXAMPLE), "NPROC_PER_NODE": "1", "CHECKPOINT_URI": str(tmp_path / "ckpt"),
        "SECRET_FILE": str(tmp_path / "job.secret"),
        "LOG_DIR": str(tmp_path / "logs"), "PERSIST_EVERY": "5",
        # resilrun on PATH, as in a user's activated environment (sbatch passes it on to srun's tasks)
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **env,
    }  # fmt: skip
    # --open-mode=append: a requeued run adds to the output instead of replacing it
    options = ["--nodes", "3", *CPU_NODES, f"--output={out}", "--open-mode=append"]
    job = slurm.sbatch([*options, str(SBATCH), *train], env=settings, cwd=ROOT)
    return job, out


def _state(slurm: SlurmCluster, job: int) -> str:
    return slurm.job(job).get("JobState", "")


@pytest.mark.timeout(300)
def test_the_example_sbatch_runs_one_agent_per_slurm_node_and_ends_bitwise_equal(
    slurm: SlurmCluster, launcher, tmp_path: Path
) -> None:
    target = tmp_path / "slurm.sha"
    train = ["--steps", "20", "--hidden", "64", "--checksum-file", str(target)]
    # Given the example batch script, submitted as a user submits it (CPU nodes, one worker each)
    job, out = _submit(slurm, tmp_path, train)
    # Then it runs on three SLURM nodes, each agent on its own host, and completes
    wait_for(lambda: _state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 200, "the job to end")
    text = out.read_text() if out.exists() else ""
    assert _state(slurm, job) == "COMPLETED", text[-4000:] + slurm.logs()
    addresses = set(re.findall(r"this node's address: (198\.18\.0\.\d+)", text))
    assert len(addresses) == 3, text[-4000:]
    assert "rendezvous at h0:29400" in text  # the allocation's first host
    assert "no job secret given" not in text  # the script's own secret file, required and given
    # persisted complete steps and kept the documented log layout, under the SLURM job id
    assert (tmp_path / "ckpt" / "step_000000000019" / "COMPLETE.json").is_file()
    assert (tmp_path / "logs" / str(job) / "round_0" / "rank_2").is_dir()
    assert target.read_text() == clean_checksum(launcher, tmp_path, 3, *train[:-2])


# (about 60 s on 2 cores under the full suite: the bounds are about five times that)
@pytest.mark.timeout(300)
def test_a_node_lost_mid_job_is_requeued_by_slurm_and_the_job_resumes_from_the_persistent_tier(
    slurm: SlurmCluster, launcher, tmp_path: Path
) -> None:
    target = tmp_path / "slurm.sha"
    train = ["--steps", "60", "--hidden", "64", "--sleep", "0.15", "--checksum-file", str(target)]
    # Given the example batch script on three of four nodes (--requeue is in the script)
    job, out = _submit(slurm, tmp_path, train, MAX_RESTARTS="0")
    wait_for(lambda: out.exists() and "step 20 loss" in out.read_text(), 120, "training to pass step 20")
    nodes = slurm.run(["scontrol", "show", "hostnames", slurm.job(job)["NodeList"]]).stdout.split()
    doomed = nodes[-1]  # not the head node, whose agent hosts the rendezvous store
    # When one of its nodes drops off the network and everything on it dies, slurmd included
    slurm.cluster.cut(doomed)
    slurm.kill_slurmd(doomed)
    slurm.cluster.kill_host(doomed)
    # Then SLURM sees the node down and requeues the job; the new run, on the nodes left, resumes
    # from the persistent tier (node memory started empty) and ends bitwise equal to a clean run
    requeued = lambda: slurm.job(job).get("Restarts", "0") != "0" and _state(slurm, job) == "PENDING"  # noqa: E731
    wait_for(requeued, 120, "SLURM to requeue the job")
    # (a requeued job is eligible again only a couple of minutes later; made eligible at once here,
    # as an administrator would)
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    wait_for(lambda: _state(slurm, job) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 150, "the job to end")
    text = out.read_text()
    assert _state(slurm, job) == "COMPLETED", text[-4000:] + slurm.logs()
    assert doomed not in slurm.job(job)["NodeList"]
    resumed = re.findall(r"rank \d+ resumed from step (\d+) \(persistent storage\)", text)
    assert len(resumed) == 3 and len(set(resumed)) == 1 and int(resumed[0]) >= 19, text[-4000:]
    assert target.read_text() == clean_checksum(launcher, tmp_path, 3, *train[:-2])
