"""A host lost while its replicas are slower than training (a slow link), on hosts in network
namespaces (tests/helpers/netns_cluster.py).

The fault hook RESILRUN_FAULT_REPLICATION_DELAY_S holds every push a while before its bytes,
so a node's replicas (both of its ranks) take about four of the example's steps. Before the
commit gate and the survivors' third slot, the lost ranks' replicas lagged steps behind and
matched no step the survivors still held: the job fell back to the persistent tier, or without
one stopped, state lost. Now training waits for its replicas (a replica lags at most one step),
and a node loss costs at most the step whose push was in flight and the step in flight.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.conftest import (
    PORT,
    assert_nothing_left,
    clean_checksum,
    drop_off,
    newest_step,
    resumed,
    wait_for,
)
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

# Two of the example's steps (--sleep 0.15) per push, a node's two ranks pushed in turn.
_SLOW_PUSH_S = "0.3"


@pytest.mark.timeout(400)
def test_a_host_lost_while_its_replicas_are_slower_than_training_resumes_within_two_steps(
    cluster_of, launcher, tmp_path: Path
) -> None:
    # Given two hosts x 2 workers whose replica pushes are slower than their steps, no persistent tier
    cluster, start = cluster_of(3)
    target = tmp_path / "multi.sha"
    train = [str(EXAMPLE), "--steps", "40", "--hidden", "64", "--sleep", "0.15", "--checksum-file", str(target)]
    flags = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
        "--heartbeat-timeout", "3", "--max-restarts", "1",
    ]  # fmt: skip
    slow = {"RESILRUN_FAULT_REPLICATION_DELAY_S": _SLOW_PUSH_S}
    first, doomed = (start(name, *flags, "--node-rank", name[1:], *train, env=slow) for name in ("h0", "h1"))
    wait_for(lambda: newest_step(first) >= 20, 150, "training to pass step 20")
    # When h1 drops off the network with its processes, and a new host joins in its place
    drop_off(cluster, "h1", doomed)
    replacement = start("h2", *flags, *train, env=slow)
    # Then every rank resumes from one step, the lost ranks from the survivor's replicas, bitwise equal
    for node in (first, replacement):
        assert node.wait(180) == 0, node.stderr()[-3000:]
        assert_nothing_left(node)
    steps = resumed(first, replacement)
    assert sorted(rank for rank, (_, tier) in steps.items() if tier == "peer") == [2, 3], steps
    (step,) = {s for s, _ in steps.values()}
    # The replicas lag at most a step: the resume is at most two steps behind the newest step a rank
    # committed (the one whose push was in flight, on a link this slow), never further.
    err = first.stderr() + replacement.stderr()
    for lost_from, lost_to in re.findall(r"steps (\d+)-(\d+) are lost", err):
        assert int(lost_from) == step + 1 and int(lost_to) - step <= 2, err[-3000:]
    assert step >= 18  # rank 0 printed step 20 before the loss
    assert target.read_text() == clean_checksum(launcher, tmp_path, 4, *train[1:-2])
