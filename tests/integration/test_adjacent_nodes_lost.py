"""Two adjacent nodes lost at once with --replicas 1: one node's state exists only in persistent
storage (its replica died with its neighbour). With a persistent tier the job resumes from it and
says what was lost; without one it stops at once with a clear message instead of restarting."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.integration.conftest import Launch, wait_for
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

TRAIN = [str(EXAMPLE), "--steps", "30", "--hidden", "64", "--sleep", "0.15"]


def _start_and_lose_two(launcher, tmp_path: Path, *extra: str) -> tuple[Launch, list[Launch]]:  # noqa: ANN001
    """3 active nodes x 1 worker and 2 spare nodes; once step 10 is done, SIGKILL the two active
    nodes that do not host the store (in a ring of three, any two nodes are adjacent)."""
    port = free_port()
    flags = [
        "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--replicas", "1",
        "--heartbeat-timeout", "3", "--max-restarts", "1", *extra, *TRAIN, "--checksum-file", str(tmp_path / "out.sha"),
    ]  # fmt: skip
    nodes = [launcher("resilrun", *flags) for _ in range(5)]
    wait_for(lambda: sum("standing by as a spare node" in n.stderr() for n in nodes) == 2, 150, "two spare nodes")
    wait_for(lambda: any("step 10 loss" in n.stdout() for n in nodes), 150, "training to pass step 10")
    spares = [n for n in nodes if "standing by as a spare node" in n.stderr()]
    active = [n for n in nodes if n not in spares]
    host = next(n for n in active if "hosting store" in n.stderr())
    doomed = [n for n in active if n is not host]
    # Steps take >= 0.15 s: a second later at least two more are done, and fewer than nine (so with
    # --persist-every 10 the newest persisted step is still 9 and steps 10.. are lost)
    time.sleep(1.0)
    for node in doomed:
        os.kill(node.pid, signal.SIGKILL)
    return host, spares


@pytest.mark.timeout(400)
def test_two_adjacent_nodes_lost_resume_from_the_persistent_tier(launcher, tmp_path: Path) -> None:
    # Given snapshots persisted every 10 steps
    host, spares = _start_and_lose_two(
        launcher, tmp_path, "--checkpoint-uri", str(tmp_path / "ckpt"), "--persist-every", "10"
    )
    # Then both spare nodes take the places, the job resumes from the newest persisted step, says
    # which steps were lost, and ends bitwise equal to a failure-free run
    for node in (host, *spares):
        assert node.wait(240) == 0, node.stderr()[-4000:]
    err = host.stderr() + "".join(n.stderr() for n in spares)
    assert "take the lost node's place" in err
    assert "(persistent storage)" in err
    lost = next(line for line in err.splitlines() if "are lost, the newest step held by every rank" in line)
    first, last = (int(x) for x in lost.split("steps ")[1].split(" ")[0].split("-"))
    # step 9 is the newest persisted one; at most --persist-every steps (+ the one in flight) are lost
    assert first == 10 and 2 <= last - first + 1 <= 10 + 1
    clean = tmp_path / "clean.sha"
    run = launcher("resilrun", "--standalone", "--nproc-per-node", "3", *TRAIN[:-2], "--checksum-file", str(clean))
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert (tmp_path / "out.sha").read_text() == clean.read_text()


@pytest.mark.timeout(300)
def test_two_adjacent_nodes_lost_without_a_persistent_tier_stop_the_job_with_a_clear_message(
    launcher, tmp_path: Path
) -> None:
    host, spares = _start_and_lose_two(launcher, tmp_path)
    started = time.monotonic()
    # Then the job stops (exit 4, checkpoint) without spending its restart, and says why
    for node in (host, *spares):
        assert node.wait(120) == 4, node.stderr()[-4000:]
    assert time.monotonic() - started < 90
    err = host.stderr()
    assert "resilrun: error: the job's state is lost" in err
    assert "have none in node memory, peer replicas or persistent storage" in err
    assert "hint: " in err and "--replicas 2" in err
    assert "restarting the job" not in err


@pytest.mark.timeout(400)
def test_a_second_node_lost_while_the_first_ones_generation_forms_is_recovered_in_process(
    launcher, tmp_path: Path
) -> None:
    """On a ring of four, node rank 1 is lost, then node rank 2 1.5 s later. Node 3 watches node 1
    but not node 2, so a generation replacing node 1 alone opens; it includes node 2's dead rank,
    so its process groups cannot form, and node 2's verdict opens the next generation while they
    try. The survivors' and the first spare's workers, failing in that setup, must follow into the
    next generation (a failed group setup used to leave torch's group counter off by one in the
    retrying process: every rank then waited forever for keys under another prefix)."""
    port = free_port()
    flags = [
        "--nnodes", "4", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--replicas", "1",
        "--heartbeat-timeout", "3", "--max-restarts", "0", "--checkpoint-uri", str(tmp_path / "ckpt"),
        "--persist-every", "5", *TRAIN, "--checksum-file", str(tmp_path / "out.sha"),
    ]  # fmt: skip
    # The store host is node rank 0, started first: the nodes lost below never include it (losing
    # the c10d store's host ends any job; whichever agent bound the port first used to host it).
    host = launcher("resilrun", "--node-rank", "0", *flags)
    wait_for(lambda: "hosting store" in host.stderr(), 60, "the store host")
    nodes = [host, *(launcher("resilrun", *flags) for _ in range(5))]
    wait_for(lambda: sum("standing by as a spare node" in n.stderr() for n in nodes) == 2, 200, "two spare nodes")
    wait_for(lambda: any("step 10 loss" in n.stdout() for n in nodes), 200, "training to pass step 10")
    active = [n for n in nodes if "standing by as a spare node" not in n.stderr()]
    by_rank = {r: next(n for n in active if f"this node rank {r} runs" in n.stderr()) for r in range(4)}
    assert by_rank[0] is host
    os.kill(by_rank[1].pid, signal.SIGKILL)
    time.sleep(1.5)
    os.kill(by_rank[2].pid, signal.SIGKILL)
    doomed = [by_rank[1], by_rank[2]]
    # With --max-restarts 0 a restart would fail the job: every remaining node must finish cleanly
    for node in nodes:
        if node not in doomed:
            assert node.wait(240) == 0, node.stderr()[-4000:]
    err = "".join(n.stderr() for n in nodes if n not in doomed)
    assert "restarting the job" not in err
    assert "take the lost node's place: generation 2" in err  # two generations: the first was superseded
    clean = tmp_path / "clean.sha"
    run = launcher("resilrun", "--standalone", "--nproc-per-node", "4", *TRAIN[:-2], "--checksum-file", str(clean))
    assert run.wait(150) == 0, run.stderr()[-3000:]
    assert (tmp_path / "out.sha").read_text() == clean.read_text()
