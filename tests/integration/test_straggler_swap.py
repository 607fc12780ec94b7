"""A rank slower than the others, on a real job (issue 48): reported in the events, and under
``--stragglers swap`` replaced by a hot spare at a step boundary, with nothing redone and the result
bitwise equal to a failure-free run. The slowness belongs to the process (tests/helpers/slow_rank.py
adds a delay to each ``nn.Linear`` forward of the process started as that rank), as a throttled
device's would: the spare that takes the rank runs at full speed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.conftest import assert_nothing_left, clean_checksum, events, resumed
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

SLOW_RANK = Path(__file__).resolve().parents[1] / "helpers" / "slow_rank.py"
ARGS = ["--steps", "160", "--hidden", "64", "--sleep", "0.03"]


def _run(launcher, tmp_path: Path, name: str, *flags: str):  # noqa: ANN001, ANN202 - the fixture, a Launch
    target = tmp_path / f"{name}.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "3", "--max-restarts", "0", "--heartbeat-interval", "0.5",
        *flags, str(SLOW_RANK), str(EXAMPLE), *ARGS, "--checksum-file", str(target),
        env={"SLOW_RANK": "1", "SLOW_S": "0.02", "SLOW_ONCE": str(tmp_path / f"{name}.slow")},
    )  # fmt: skip
    assert run.wait(240) == 0, run.stderr()[-3000:]
    assert_nothing_left(run)
    return run, target.read_text()


def _agents(launcher, tmp_path: Path, name: str, count: int, *flags: str) -> tuple[list, str]:  # noqa: ANN001
    """``count`` agents of a 2-node job of 1 worker each on this machine (a third stands by as a
    spare node), rank 1 slow, ``--stragglers swap``, run to their end; the Launches and the checksum."""
    port, target = free_port(), tmp_path / f"{name}.sha"
    env = {"SLOW_RANK": "1", "SLOW_S": "0.02", "SLOW_ONCE": str(tmp_path / f"{name}.slow"), "OMP_NUM_THREADS": "1"}
    argv = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name,
        "--max-restarts", "0", "--heartbeat-interval", "0.5", "--stragglers", "swap", *flags,
        str(SLOW_RANK), str(EXAMPLE), *ARGS, "--checksum-file", str(target),
    ]  # fmt: skip
    nodes = [launcher("resilrun", *argv, env=env) for _ in range(count)]
    for node in nodes:
        assert node.wait(240) == 0, node.stderr()[-3000:]
        assert_nothing_left(node)
    return nodes, target.read_text()


def test_a_straggler_is_swapped_for_the_hot_spare_at_a_step_boundary(launcher, tmp_path: Path) -> None:
    # Given a job of three ranks whose rank 1 computes about 3x longer than the others, and a hot spare
    run, checksum = _run(launcher, tmp_path, "swap", "--spares", "1", "--stragglers", "swap")
    # Then rank 1 was named, with its evidence, by its own node
    detected = events(run, kind="straggler_detected", rank=1)
    assert len(detected) == 1 and detected[0]["ratio"] >= 1.5, detected
    assert events(run, kind="straggler_detected", rank=0) == events(run, kind="straggler_detected", rank=2) == []
    # and swapped once: stopped after a commit, its place taken by the waiting spare
    (swapped,) = events(run, kind="straggler_swapped")
    assert swapped["rank"] == 1 and swapped["pid"] != swapped["spare_pid"]
    (promoted,) = events(run, kind="spare_promoted")
    assert (promoted["rank"], promoted["spare_pid"], promoted["straggler"]) == (1, swapped["spare_pid"], True)
    # with nothing redone: every rank resumed from the step the straggler was stopped after, in node memory
    assert resumed(run) == dict.fromkeys(range(3), (swapped["step"], "memory"))
    assert events(run, kind="failure_detected") == events(run, kind="restart") == []
    # and the result is bitwise the failure-free run's
    assert checksum == clean_checksum(launcher, tmp_path, 3, *ARGS)


def test_without_a_spare_a_straggler_is_reported_and_never_swapped(launcher, tmp_path: Path) -> None:
    # Given the same straggler and --stragglers swap, but no hot spare
    run, checksum = _run(launcher, tmp_path, "nospare", "--stragglers", "swap")
    # Then it is reported and nothing is swapped: the job runs at its pace to the end
    assert [e["rank"] for e in events(run, kind="straggler_detected")] == [1]
    assert events(run, kind="straggler_swapped") == events(run, kind="spare_promoted") == []
    assert events(run, kind="generation_entered") == []
    assert checksum == clean_checksum(launcher, tmp_path, 3, *ARGS)


def test_a_straggler_on_another_node_is_judged_by_the_leader_and_swapped_by_its_own_node(
    launcher, tmp_path: Path
) -> None:
    # Given 2 agents of 1 worker each on this machine, each with a hot spare, rank 1 (node rank 1:
    # not the leader) slow
    nodes, checksum = _agents(launcher, tmp_path, "two", 2, "--spares", "1")
    # Then the node running rank 1 said so and swapped it; the leader's node only followed
    (detected,) = events(*nodes, kind="straggler_detected")
    (swapped,) = events(*nodes, kind="straggler_swapped")
    assert detected["rank"] == swapped["rank"] == 1 and detected["node_rank"] == swapped["node_rank"] == 1
    assert resumed(*nodes) == dict.fromkeys(range(2), (swapped["step"], "memory"))
    assert events(*nodes, kind="failure_detected") == events(*nodes, kind="restart") == []
    # and the result is bitwise the failure-free run's
    assert checksum == clean_checksum(launcher, tmp_path, 2, *ARGS)


def test_without_a_spare_process_a_straggler_host_is_given_to_a_spare_node_and_stands_by(
    launcher, tmp_path: Path
) -> None:
    # Given 2 active agents of 1 worker each, no spare process, a third agent standing by as a spare
    # node, and rank 1 slow
    nodes, checksum = _agents(launcher, tmp_path, "host", 3)
    # Then rank 1's node gave its place to the spare node after a commit, and stood by to the end
    (swapped,) = events(*nodes, kind="straggler_swapped")
    assert (swapped["rank"], swapped["by"], swapped["node_rank"]) == (1, "spare node", 1)
    (promoted,) = events(*nodes, kind="spare_promoted")
    assert (promoted["node_rank_taken"], promoted["straggler"]) == (1, True)
    assert events(*nodes, kind="failure_detected") == events(*nodes, kind="restart") == []
    # every rank resumed from the step the straggler host stopped after (rank 1 from its peer replica)
    assert resumed(*nodes) == {0: (swapped["step"], "memory"), 1: (swapped["step"], "peer")}
    # and the result is bitwise the failure-free run's
    assert checksum == clean_checksum(launcher, tmp_path, 2, *ARGS)
