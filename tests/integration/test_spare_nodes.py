"""Node loss with a spare node: the spare's warm workers take the lost ranks, survivors keep running."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from tests.conftest import free_port
from tests.integration.conftest import alive, assert_nothing_left, wait_for
from tests.integration.test_peer_restore import _clean_checksum_40
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration


@pytest.mark.timeout(400)
def test_a_spare_node_takes_a_lost_nodes_ranks_without_restarting_the_survivors(launcher, tmp_path: Path) -> None:
    # Given 2 active nodes x 2 workers replicating to each other, one spare worker each, and a third
    # agent that finds the job full and stands by as a spare node
    port = free_port()
    target = tmp_path / "faulty.sha"
    flags = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--replicas", "1",
        "--spares", "1", "--heartbeat-timeout", "3", "--max-restarts", "0",
        str(EXAMPLE), "--steps", "40", "--hidden", "64", "--sleep", "0.15", "--checksum-file", str(target),
    ]  # fmt: skip
    nodes = [launcher("resilrun", *flags) for _ in range(3)]
    wait_for(lambda: any("standing by as a spare node" in n.stderr() for n in nodes), 150, "a spare node")
    wait_for(lambda: any("step 10 loss" in n.stdout() for n in nodes), 150, "training to pass step 10")
    spare = next(n for n in nodes if "standing by as a spare node" in n.stderr())
    active = [n for n in nodes if n is not spare]
    survivor, doomed = sorted(active, key=lambda n: "hosting store" not in n.stderr())
    children = psutil.Process(survivor.pid).children()
    survivor_workers = {p.pid for p in children if p.environ().get("RESILRUN_SPARE") == "0"}
    assert len(survivor_workers) == 2
    doomed_tree = doomed.remember_descendants() | {doomed.pid}
    # When the node that does not host the store loses its agent and workers at once (SIGKILL)
    os.kill(doomed.pid, signal.SIGKILL)
    # Then the spare node takes its place in-process while the survivor's workers keep running,
    wait_for(lambda: "spare node takes node rank" in spare.stderr(), 60, "the spare node to take over")
    assert alive(survivor_workers) == survivor_workers
    # and the job finishes, bitwise equal to a clean run
    for node in (survivor, spare):
        assert node.wait(200) == 0, node.stderr()[-4000:]
        assert_nothing_left(node)
    err = survivor.stderr() + spare.stderr()
    assert "take the lost node's place" in err
    assert "spare node takes node rank" in spare.stderr()
    assert "restarting the job" not in err
    # the lost node's two ranks came from the survivor's replicas, every rank resumed at one step
    assert err.count("(peer replica)") == 2, err[-4000:]
    resumed = {line.split(" resumed from step ")[1].split()[0] for line in err.splitlines() if "resumed from" in line}
    assert len(resumed) == 1
    assert "recovering in-process" in survivor.stderr()
    assert target.read_text() == _clean_checksum_40(launcher, tmp_path)
    # and nothing of the lost node survives it
    assert not alive(doomed_tree)
