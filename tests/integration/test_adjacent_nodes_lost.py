"""Two adjacent hosts lost at once with --replicas 1, on hosts in network namespaces
(tests/helpers/netns_cluster.py): one node's state exists only in persistent storage (its replica
died with its neighbour). With a persistent tier the job resumes from it and says what was lost;
without one it stops at once with a clear message instead of restarting."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.integration.conftest import (
    PORT,
    Launch,
    active_workers,
    clean_checksum,
    drop_off,
    newest_step,
    recorded,
    wait_for,
    worker_stacks,
)
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

TRAIN = [str(EXAMPLE), "--steps", "30", "--hidden", "64", "--sleep", "0.15"]


GATED = Path(__file__).resolve().parents[1] / "helpers" / "gated.py"


def _gated(tmp_path: Path, *train: str) -> tuple[list[str], Path]:
    """``train`` run once the returned gate file exists: training starts when the test opens it,
    after the spare hosts stand by (they took longer than a 30-step job under load in CI)."""
    gate = tmp_path / "gate"
    return [str(GATED), str(gate), *train], gate


def _persisted(nodes: list[Launch]) -> int:
    """The newest step logged as persisted for every rank (-1: none yet): by the agent whose upload
    completed the step, any of them."""
    steps = re.findall(r"step (\d+) persisted for all", "".join(n.stderr() for n in nodes))
    return max(map(int, steps), default=-1)


def _start_and_lose_two(cluster_of, tmp_path: Path, *extra: str, persisted: bool) -> tuple[Launch, list[Launch], int]:  # noqa: ANN001
    """Hosts h0-h2 run 3 nodes x 1 worker (h0, node rank 0, hosts the store), h3 and h4 stand by as
    spare nodes; training starts once they do; then h1 and h2 drop off the network with their
    processes (in a ring of three, any two nodes are adjacent). With ``persisted``, the drop comes 2
    to 8 steps after the newest step persisted for every rank (--persist-every 10), which is
    returned; otherwise once step 11 is done.

    The surviving worker is frozen while both hosts are cut off: every step needs its all-reduce, so
    no rank gets further than the step in flight however long the drop takes under load (timing the
    drop against the steps' pace, and the spare hosts' start against training, both lost in CI). The
    freeze lasts two `ip` calls, far inside the 3 s heartbeat timeout."""
    cluster, start = cluster_of(5)
    flags = [
        "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
        "--heartbeat-timeout", "3", "--max-restarts", "1", *extra,
    ]  # fmt: skip
    train, gate = _gated(tmp_path, *TRAIN, "--progress", "--checksum-file", str(tmp_path / "out.sha"))
    active = [start(f"h{i}", *flags, "--node-rank", str(i), *train) for i in range(3)]
    wait_for(lambda: any("round 0 formed" in n.stderr() for n in active), 150, "the round to form")
    spares = [start(f"h{i}", *flags, *train) for i in (3, 4)]
    wait_for(lambda: all("standing by as a spare node" in n.stderr() for n in spares), 150, "two spare hosts")
    gate.touch()
    newest = -1

    def in_window() -> bool:
        nonlocal newest
        if not persisted:
            return newest_step(active[0]) >= 11
        newest = _persisted(active)
        return newest >= 0 and newest + 2 <= newest_step(active[0]) <= newest + 8

    wait_for(in_window, 150, "training 2 steps past a persisted step")
    frozen = active_workers(active[0])
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        cluster.cut("h1")
        cluster.cut("h2")
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    for name, node in (("h1", active[1]), ("h2", active[2])):
        drop_off(cluster, name, node)
    return active[0], spares, newest


@pytest.mark.timeout(400)
def test_two_adjacent_hosts_lost_resume_from_the_persistent_tier(cluster_of, launcher, tmp_path: Path) -> None:
    # Given snapshots persisted every 10 steps
    host, spares, persisted = _start_and_lose_two(
        cluster_of, tmp_path, "--checkpoint-uri", str(tmp_path / "ckpt"), "--persist-every", "10", persisted=True
    )
    # Then both spare hosts take the places, the job resumes from the newest persisted step, says
    # which steps were lost, and ends bitwise equal to a failure-free run
    for node in (host, *spares):
        assert node.wait(240) == 0, node.stderr()[-4000:]
    err = host.stderr() + "".join(n.stderr() for n in spares)
    assert "take the lost node's place" in err
    assert "(persistent storage)" in err
    lost = next(line for line in err.splitlines() if "are lost, the newest step held by every rank" in line)
    first, last = (int(x) for x in lost.split("steps ")[1].split(" ")[0].split("-"))
    # the restore starts after the newest persisted step; at most --persist-every steps (+ the one
    # in flight) are lost
    assert first == persisted + 1 and 2 <= last - first + 1 <= 10 + 1
    assert (tmp_path / "out.sha").read_text() == clean_checksum(launcher, tmp_path, 3, *TRAIN[1:-2])


@pytest.mark.timeout(300)
def test_two_adjacent_hosts_lost_without_a_persistent_tier_stop_the_job_with_a_clear_message(
    cluster_of, tmp_path: Path
) -> None:
    host, spares, _ = _start_and_lose_two(cluster_of, tmp_path, persisted=False)
    started = time.monotonic()
    # Then the job stops (exit 4, checkpoint) without spending its restart, and says why
    for node in (host, *spares):
        assert node.wait(120) == 4, node.stderr()[-4000:]
    assert time.monotonic() - started < 90
    err = host.stderr()
    assert "resilrun: error: the job's state is lost" in err
    assert "have none in node memory, peer replicas or persistent storage" in err
    assert "hint: " in err and "--replicas 2" in err
    assert recorded(err, "restart") == []


@pytest.mark.timeout(400)
def test_a_second_host_lost_while_the_first_ones_generation_forms_is_recovered_in_process(
    cluster_of, launcher, tmp_path: Path
) -> None:
    """On a ring of four, node rank 1 is lost, then node rank 2 1.5 s later. Node 3 watches node 1
    but not node 2, so a generation replacing node 1 alone opens; it includes node 2's dead rank,
    so its process groups cannot form, and node 2's verdict opens the next generation while they
    try. The survivors' and the first spare's workers, failing in that setup, must follow into the
    next generation (a failed group setup used to leave torch's group counter off by one in the
    retrying process: every rank then waited forever for keys under another prefix)."""
    cluster, start = cluster_of(6)
    flags = [
        "--nnodes", "4", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
        "--heartbeat-timeout", "3", "--max-restarts", "0", "--checkpoint-uri", str(tmp_path / "ckpt"),
        "--persist-every", "5",
    ]  # fmt: skip
    train, gate = _gated(tmp_path, *TRAIN, "--progress", "--checksum-file", str(tmp_path / "out.sha"))
    # h0 is node rank 0 and hosts the store: the hosts lost below never include it (losing the
    # c10d store's host ends any job)
    active = [start(f"h{i}", *flags, "--node-rank", str(i), *train) for i in range(4)]
    wait_for(lambda: any("round 0 formed" in n.stderr() for n in active), 200, "the round to form")
    spares = [start(f"h{i}", *flags, *train) for i in (4, 5)]
    wait_for(lambda: all("standing by as a spare node" in n.stderr() for n in spares), 200, "two spare hosts")
    gate.touch()
    wait_for(lambda: newest_step(active[0]) >= 10, 200, "training to pass step 10")
    drop_off(cluster, "h1", active[1])
    time.sleep(1.5)
    drop_off(cluster, "h2", active[2])
    # With --max-restarts 0 a restart would fail the job: every remaining node must finish cleanly
    remaining = [active[0], active[3], *spares]
    for node in remaining:
        # (on a hang, every node's resilrun lines and the workers' stacks: this test has hung under
        # load three times, never alone)
        try:
            code = node.wait(240)
        except TimeoutError:
            everyone = [*active, *spares]
            agents = "\n---\n".join(_agent_lines(n.stderr())[-2500:] for n in everyone)
            pytest.fail(f"{agents}\n=== stacks\n{worker_stacks(*everyone)}")
        assert code == 0, "\n---\n".join(_agent_lines(n.stderr())[-2500:] for n in [*active, *spares])
    err = "".join(n.stderr() for n in remaining)
    assert recorded(err, "restart") == []
    assert "take the lost node's place: generation 2" in err  # two generations: the first was superseded
    assert (tmp_path / "out.sha").read_text() == clean_checksum(launcher, tmp_path, 4, *TRAIN[1:-2])


def _agent_lines(stderr: str) -> str:
    """The agent's own lines and the workers' recovery lines, without tracebacks."""
    return "\n".join(line for line in stderr.splitlines() if line.startswith(("[resilrun", "resilrun:")))
