"""Node loss while the lost node's replicas are slower than training (a slow link).

The fault hook RESILRUN_FAULT_REPLICATION_DELAY_S holds every push a while before its bytes, so a
node's replicas (both of its ranks) take about four of the example's steps. Before the commit gate
and the survivors' third slot, the lost ranks' replicas lagged steps behind and matched no step the
survivors still held: the job fell back to the persistent tier, or without one stopped, state lost.
Now training waits for its replicas (a replica lags at most one step), and a node loss costs at most
the step whose push was in flight and the step in flight.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.conftest import wait_for
from tests.integration.test_peer_restore import _clean_checksum_40
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

# Two of the example's steps (--sleep 0.15) per push, a node's two ranks pushed in turn.
_DELAY_S = "0.3"


@pytest.mark.timeout(400)
def test_a_node_lost_while_its_replicas_are_slower_than_training_resumes_within_two_steps(
    launcher, tmp_path: Path
) -> None:
    # Given 2 nodes x 2 workers whose replica pushes are slower than their steps, no persistent tier
    port = free_port()
    target = tmp_path / "faulty.sha"
    flags = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--replicas", "1",
        "--max-restarts", "1", str(EXAMPLE), "--steps", "40", "--hidden", "64", "--sleep", "0.15",
        "--checksum-file", str(target),
    ]  # fmt: skip
    env = {"RESILRUN_FAULT_REPLICATION_DELAY_S": _DELAY_S}
    nodes = [launcher("resilrun", *flags, env=env), launcher("resilrun", *flags, env=env)]
    wait_for(lambda: any("step 20 loss" in n.stdout() for n in nodes), 150, "training to pass step 20")
    # When the node that does not host the store dies with its agent, and a new node replaces it
    first, doomed = sorted(nodes, key=lambda n: "hosting store" not in n.stderr())
    os.kill(doomed.pid, signal.SIGKILL)
    replacement = launcher("resilrun", *flags, env=env)
    # Then every rank resumes from one step, the lost ranks from the survivor's replicas, bitwise equal
    for node in (first, replacement):
        assert node.wait(180) == 0, node.stderr()[-3000:]
    err = first.stderr() + replacement.stderr()
    assert len(re.findall(r"rank \d+ resumed from step \d+ \(peer replica\)", err)) == 2, err[-3000:]
    resumed = {int(s) for s in re.findall(r"rank \d+ resumed from step (\d+)", err)}
    assert len(resumed) == 1, resumed
    # The replicas lag at most a step: the resume is at most two steps behind the newest step a rank
    # committed (the one whose push was in flight, on a link this slow), never further.
    step = resumed.pop()
    for lost_from, lost_to in re.findall(r"steps (\d+)-(\d+) are lost", err):
        assert int(lost_from) == step + 1 and int(lost_to) - step <= 2, err[-3000:]
    assert step >= 18  # rank 0 printed step 20 before the kill
    assert target.read_text() == _clean_checksum_40(launcher, tmp_path)
