"""A host lost under sparser snapshots: ``--replicate-every N``, and ``--snapshot-every auto`` with
``--replicate-every auto``, on hosts in network namespaces (tests/helpers/netns_cluster.py).

A node loss resumes from the newest step every rank holds somewhere: for the lost ranks that is
their newest replica, so with replicas every N steps a node loss redoes up to N steps, and the
survivors come back to the same step (from node memory while their ring still holds it, else from
their own replicas on the other hosts).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import (
    PORT,
    assert_nothing_left,
    clean_checksum,
    drop_off,
    events,
    newest_step,
    resumed,
    wait_for,
)
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

_FLAGS = [
    "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
    "--heartbeat-timeout", "3", "--max-restarts", "1",
]  # fmt: skip


def _lose_h1(cluster_of, launcher, tmp_path: Path, train: list[str], *flags: str, after: int) -> tuple[int, list]:  # noqa: ANN001
    """2 hosts x 1 worker; h1 drops off once rank 0 printed step ``after``, h2 joins in its place.
    Returns the step every rank resumed from, and the launches that finished."""
    cluster, start = cluster_of(3)
    first, doomed = (start(name, *_FLAGS, *flags, "--node-rank", name[1:], *train) for name in ("h0", "h1"))
    wait_for(lambda: newest_step(first) >= after, 150, f"training to pass step {after}")
    drop_off(cluster, "h1", doomed)
    replacement = start("h2", *_FLAGS, *flags, *train)
    for node in (first, replacement):
        assert node.wait(180) == 0, node.stderr()[-3000:]
        assert_nothing_left(node)
    steps = resumed(first, replacement)
    assert steps[1][1] == "peer", steps  # the lost rank from its replica on h0
    (step,) = {s for s, _ in steps.values()}
    return step, [first, replacement]


@pytest.mark.timeout(400)
def test_with_replicas_every_5_steps_a_lost_host_resumes_from_the_newest_replicated_step(
    cluster_of, launcher, tmp_path: Path
) -> None:
    # Given snapshots every step but replicas of steps 4, 9, 14, ... only
    target = tmp_path / "sum"
    train = [str(EXAMPLE), "--steps", "40", "--hidden", "64", "--sleep", "0.1", "--checksum-file", str(target)]
    # When h1 is lost after step 20
    step, nodes = _lose_h1(cluster_of, launcher, tmp_path, train, "--replicate-every", "5", after=20)
    # Then every rank resumed from one replicated step, no older than the newest before the loss
    assert (step + 1) % 5 == 0 and step >= 14, step
    redone = [e["steps_redone"] for e in events(*nodes, kind="recovered") if e.get("steps_redone") is not None]
    assert redone and all(0 <= r <= 6 for r in redone), redone  # up to 5 steps and the one in flight
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *train[1:-2])


@pytest.mark.timeout(400)
def test_with_snapshot_and_replicate_every_auto_a_lost_host_resumes_bitwise_within_the_intervals(
    cluster_of, launcher, tmp_path: Path
) -> None:
    # Given snapshots spaced by auto under the default 3% budget (large state next to the step
    # time), and replicas of every k-th snapshot, k chosen with the interval
    target = tmp_path / "sum"
    train = [
        str(EXAMPLE), "--steps", "80", "--hidden", "64", "--state-mib", "4", "--sleep", "0.05",
        "--checksum-file", str(target),
    ]  # fmt: skip
    auto = ("--snapshot-every", "auto", "--replicate-every", "auto")
    # When h1 is lost once the intervals were agreed (the first window ends by step 47)
    step, nodes = _lose_h1(cluster_of, launcher, tmp_path, train, *auto, after=55)
    # Then intervals were agreed before the loss (the first decision comes at step 46, a function
    # of the schedule; rank 0 had printed step 60 when h1 dropped off), each with its replica
    # spacing, and the lost rank's replica (above) was one the schedule chose, so the resume redid
    # at most the longest replica interval in force (the path, in-process or restart, does not matter)
    decisions = events(*nodes, kind="snapshot_interval")
    decided = [e for e in decisions if e["step"] < 60]
    assert decided and decided[0]["step"] == 46 and decided[-1]["interval"] > 1, decisions
    assert all(e["replicate_every"] >= 1 and e["replica_interval"] >= e["interval"] for e in decisions), decisions
    longest = max(max(e["replica_interval"] for e in decisions), 2 * 6)  # the probe replicates every other of 6
    redone = [e["steps_redone"] for e in events(*nodes, kind="recovered") if e.get("steps_redone") is not None]
    assert redone and all(0 <= r <= longest + 1 for r in redone), (redone, decisions, step)
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *train[1:-2])
