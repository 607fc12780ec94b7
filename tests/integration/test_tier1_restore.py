"""A job killed whole and restarted resumes from node memory (tier 1) and ends bitwise equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.conftest import EXAMPLE, clean_checksum, recorded, resumed_from

pytestmark = pytest.mark.integration

ARGS = ["--steps", "24", "--hidden", "64"]


def _clean_checksum(launcher, tmp_path: Path, nproc: int) -> str:  # noqa: ANN001 - the fixture
    return clean_checksum(launcher, tmp_path, nproc, *ARGS)


def test_restarted_workers_resume_from_node_memory_bitwise_equal(launcher, tmp_path: Path) -> None:
    # Given a 2-worker job whose rank 1 is SIGKILLed when step 12 starts, and again in the new
    # process that replaces it in-process: no progress between the two, so the job restarts
    target = tmp_path / "faulty.sha"
    run = launcher(
        "resilrun",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(EXAMPLE),
        *ARGS,
        "--checksum-file",
        str(target),
        env={"RESILRUN_FAULTS": "kill:rank=1,step=12; kill:rank=1,step=12,attempt=1"},
    )
    # Then the restarted workers resume from step 11 held in node memory, not from step 0
    assert run.wait(150) == 0, run.stderr()[-3000:]
    err = run.stderr()
    assert "no progress since the last in-process recovery" in err and recorded(err, "restart")
    assert resumed_from(err)[0] == (11, "memory")
    assert resumed_from(err)[1] == (11, "memory")
    # And the final parameters equal a failure-free run's, bit for bit
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 2)


def test_two_nodes_restart_keeps_node_ranks_and_resumes_from_memory(launcher, tmp_path: Path) -> None:
    # Given 2 nodes x 2 workers, rank 3 (on the second node) exits with code 5 at step 7, and again
    # in the process replacing it in-process: the job restarts
    port = free_port()
    target = tmp_path / "faulty.sha"
    nodes = [
        launcher(
            "resilrun",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--max-restarts",
            "1",
            str(EXAMPLE),
            *ARGS,
            "--checksum-file",
            str(target),
            env={"RESILRUN_FAULTS": "exit:rank=3,step=7,code=5; exit:rank=3,step=7,attempt=1,code=5"},
        )
        for _ in range(2)
    ]
    for node in nodes:
        assert node.wait(150) == 0, node.stderr()[-3000:]
    err = nodes[0].stderr() + nodes[1].stderr()
    assert recorded(err, "restart")
    for rank in range(4):
        assert resumed_from(err)[rank] == (6, "memory")
    assert target.read_text() == _clean_checksum(launcher, tmp_path, 4)
