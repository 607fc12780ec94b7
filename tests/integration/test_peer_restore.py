"""A node whose memory is gone gets its ranks' state back from a peer's replica (tier 2)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.conftest import clean_checksum, wait_for
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration


@pytest.mark.timeout(400)
def test_a_replaced_node_restores_its_ranks_from_the_peer_replica(launcher, tmp_path: Path) -> None:
    # Given 2 nodes x 2 workers replicating each step to the other node
    port = free_port()
    target = tmp_path / "faulty.sha"
    flags = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--replicas", "1",
        "--max-restarts", "1", str(EXAMPLE), "--steps", "40", "--hidden", "64", "--sleep", "0.15",
        "--checksum-file", str(target),
    ]  # fmt: skip
    nodes = [launcher("resilrun", *flags), launcher("resilrun", *flags)]
    wait_for(lambda: any("step 10 loss" in n.stdout() for n in nodes), 150, "training to pass step 10")
    # When the node that does not host the store dies with its agent (its node memory is gone)
    first, doomed = sorted(nodes, key=lambda n: "hosting store" not in n.stderr())
    os.kill(doomed.pid, signal.SIGKILL)
    # and a new node replaces it
    replacement = launcher("resilrun", *flags)
    # Then the new node's ranks resume from the replicas the first node holds, bitwise equal
    for node in (first, replacement):
        assert node.wait(180) == 0, node.stderr()[-3000:]
    err = first.stderr() + replacement.stderr()
    # (which two ranks the new node runs depends on which node rank the dead one had)
    assert err.count("(peer replica)") == 2
    assert all(f"rank {rank} resumed from step" in err for rank in range(4))
    assert target.read_text() == _clean_checksum_40(launcher, tmp_path)


def _clean_checksum_40(launcher, tmp_path: Path) -> str:  # noqa: ANN001 - the fixture
    return clean_checksum(launcher, tmp_path, 4, "--steps", "40", "--hidden", "64")
