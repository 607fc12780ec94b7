"""Jobs across "hosts" with their own addresses and hostnames (network namespaces on a bridge).

Each host's /etc/hosts maps its own name to 127.0.1.1, as Debian and Ubuntu do, and the jobs are
started the way torchrun users start them: a host name as the endpoint, no --local-addr, no
GLOO_SOCKET_IFNAME. See tests/helpers/netns_cluster.py for the fixture.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilrun.storage import LocalStorage
from resilrun.tiers import durable
from tests.helpers.netns_cluster import Cluster, available
from tests.integration.conftest import Launch, alive, assert_nothing_left, events, resumed, wait_for
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration

PORT = 29400  # every host has a network of its own: no port is taken there


@pytest.fixture
def cluster_of(tmp_path: Path) -> Iterator:
    """cluster_of(n) -> (Cluster, start(host, *resilrun_args, env=) -> Launch); removes everything after."""
    why = available()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the multi-host tests need network namespaces in CI: {why}")
        pytest.skip(why)
    clusters: list[Cluster] = []
    launches: list[Launch] = []

    def make(count: int) -> tuple[Cluster, object]:
        cluster = Cluster(count).__enter__()
        clusters.append(cluster)

        def start(host: str, *args: str, env: dict[str, str] | None = None) -> Launch:
            settings = [f"{name}={value}" for name, value in (env or {}).items()]
            argv = cluster.command(host, ["env", *settings, sys.executable, "-m", "resilrun", *args])
            launch = Launch(argv, tmp_path / f"{host}_{len(launches)}.log")
            launches.append(launch)
            return launch

        return cluster, start

    yield make
    for launch in launches:
        launch.close()
    for cluster in clusters:
        cluster.close()


def clean_checksum(launcher, tmp_path: Path, nproc: int, *args: str) -> str:  # noqa: ANN001 - the fixture
    target = tmp_path / "clean.sha"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", str(nproc), str(EXAMPLE), *args, "--checksum-file", str(target)
    )
    assert run.wait(150) == 0, run.stderr()[-3000:]
    return target.read_text()


@pytest.mark.timeout(300)
def test_a_job_across_hosts_whose_names_mean_loopback_starts_unassisted(cluster_of, launcher, tmp_path: Path) -> None:
    # Given three hosts whose own names resolve to 127.0.1.1, and the endpoint named by host name
    cluster, start = cluster_of(3)
    target = tmp_path / "multi.sha"
    train = [str(EXAMPLE), "--steps", "12", "--hidden", "64", "--checksum-file", str(target)]
    flags = ["--nnodes", "3", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}"]
    nodes = [start(host.name, *flags, *train) for host in cluster.hosts]
    # Then every node advertises its own network address, the job trains and ends, bitwise equal
    for node in nodes:
        assert node.wait(200) == 0, node.stderr()[-4000:]
        assert_nothing_left(node)
    for node, host in zip(nodes, cluster.hosts, strict=True):
        assert f"this node's address: {host.addr}" in node.stderr()  # what the user reads it chose
    started = events(nodes[0], kind="round_started")
    assert started and started[0]["nodes"] == 3
    assert target.read_text() == clean_checksum(launcher, tmp_path, 3, "--steps", "12", "--hidden", "64")


@pytest.mark.timeout(400)
def test_a_host_that_drops_off_the_network_is_replaced_by_a_spare_host(cluster_of, launcher, tmp_path: Path) -> None:
    # Given two hosts training with replicas on each other, and a third standing by as a spare node
    cluster, start = cluster_of(3)
    target = tmp_path / "multi.sha"
    train = [str(EXAMPLE), "--steps", "40", "--hidden", "64", "--sleep", "0.15", "--checksum-file", str(target)]
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
        "--spares", "0", "--heartbeat-timeout", "3", "--max-restarts", "0",
    ]  # fmt: skip
    first = [start(name, *flags, *train) for name in ("h0", "h1")]
    wait_for(lambda: any("round 0 formed" in n.stderr() for n in first), 150, "the round to form")
    spare = start("h2", *flags, *train)
    wait_for(lambda: "standing by as a spare node" in spare.stderr(), 150, "the spare host")
    wait_for(lambda: any("step 10 loss" in n.stdout() for n in first), 150, "training to pass step 10")
    survivor, doomed = first
    doomed_tree = doomed.remember_descendants() | {doomed.pid}
    # When h1 drops off the network (its link goes down: the others see silence, not a refused
    # connection) and its processes die with it
    cluster.cut("h1")
    os.killpg(doomed.pid, signal.SIGKILL)
    # Then the spare host takes its rank in-process, and the job ends bitwise equal to a clean run
    for node in (survivor, spare):
        assert node.wait(250) == 0, node.stderr()[-4000:]
        assert_nothing_left(node)
    assert events(survivor, spare, kind="restart") == []
    lost = events(survivor, kind="node_lost")
    assert lost and {e["host"] for e in lost} == {"h1"}
    taken = events(survivor, spare, kind="spare_promoted")
    assert [t.get("node_rank_taken") for t in taken] == [1], taken
    # every rank resumed at one step: the survivor from its memory, the lost rank from its replica
    steps = resumed(survivor, spare)
    assert steps == {0: (steps[0][0], "memory"), 1: (steps[0][0], "peer")}, steps
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *train[1:-2])
    assert not alive(doomed_tree)


@pytest.mark.timeout(300)
def test_the_store_hosts_partition_stops_both_sides_cleanly(cluster_of, tmp_path: Path) -> None:
    # Given two hosts on the c10d backend, whose store lives in h0's agent (a single point of
    # failure, as with torchrun), and no restart allowed
    cluster, start = cluster_of(2)
    train = [str(EXAMPLE), "--steps", "400", "--hidden", "64", "--sleep", "0.1"]
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--heartbeat-timeout", "3",
        "--max-restarts", "0", "--rdzv-conf", "read_timeout=10",
    ]  # fmt: skip
    store_host, other = (start(name, *flags, *train) for name in ("h0", "h1"))
    wait_for(lambda: "step 10 loss" in store_host.stdout() + other.stdout(), 150, "training to pass step 10")
    # When h0 is cut off the network (its processes go on, alone)
    cluster.cut("h0")
    cut_at = time.monotonic()
    # Then h1 stops within the store's read timeout with a clear error (exit 3), leaving nothing,
    assert other.wait(120) == 3, other.stderr()[-3000:]
    assert time.monotonic() - cut_at < 60
    assert "rendezvous store at h0:29400 failed" in other.stderr()
    assert_nothing_left(other)
    # and h0 judges h1 lost: no restart left, so the job fails there too, cleanly
    assert store_host.wait(120) == 1, store_host.stderr()[-3000:]
    assert_nothing_left(store_host)
    lost = events(store_host, kind="node_lost")
    assert lost and {e["host"] for e in lost} == {"h1"}


@pytest.mark.timeout(400)
def test_a_host_partitioned_past_the_heartbeat_timeout_then_healed_is_fenced_and_rejoins_as_a_spare(
    cluster_of, launcher, tmp_path: Path
) -> None:
    # Given two hosts training with replicas on each other and a persistent tier, a third standing
    # by as a spare node
    cluster, start = cluster_of(3)
    target = tmp_path / "multi.sha"
    train = [str(EXAMPLE), "--steps", "60", "--hidden", "64", "--sleep", "0.15", "--checksum-file", str(target)]
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
        "--spares", "0", "--heartbeat-timeout", "3", "--max-restarts", "0",
        "--checkpoint-uri", str(tmp_path / "ckpt"), "--persist-every", "5",  # a shared directory, as on NFS
    ]  # fmt: skip
    # (h1's uploads each start 4 s late, so that some are due while it is cut off)
    slow_uploads = {"RESILRUN_FAULT_PERSIST_DELAY_S": "4"}
    first = [start("h0", *flags, *train), start("h1", *flags, *train, env=slow_uploads)]
    wait_for(lambda: any("round 0 formed" in n.stderr() for n in first), 150, "the round to form")
    spare = start("h2", *flags, *train)
    wait_for(lambda: "standing by as a spare node" in spare.stderr(), 150, "the spare host")
    wait_for(lambda: any("step 10 loss" in n.stdout() for n in first), 150, "training to pass step 10")
    survivor, partitioned = first
    # When h1 is cut off for longer than the heartbeat timeout, its processes alive all along,
    cluster.cut("h1")
    cut_at = time.time()
    wait_for(lambda: events(survivor, kind="spare_promoted"), 60, "the spare host to take h1's place")
    promoted_at = _newest_step(survivor)
    wait_for(lambda: _newest_step(survivor) >= promoted_at + 5, 60, "training to go on without h1")
    # and then comes back
    cluster.heal("h1")
    healed_at = time.monotonic()
    # Then h1 learns it was replaced, stops its workers and stands by as a spare node,
    wait_for(lambda: "standing by as a spare node" in partitioned.stderr(), 120, "h1 to stand by as a spare")
    assert time.monotonic() - healed_at < 90
    # the job ends bitwise equal to a clean run without a restart, and h1 leaves when it ends
    for node in (survivor, spare, partitioned):
        assert node.wait(250) == 0, node.stderr()[-4000:]
        assert_nothing_left(node)
    assert events(survivor, spare, partitioned, kind="restart") == []
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *train[1:-2])
    # and h1 was fenced: it entered no generation after the one it was replaced in, completed no
    # persistent step once cut off, and said why it wrote none
    promoted = events(survivor, kind="spare_promoted")[0]
    entered = events(partitioned, kind="generation_entered")
    assert all(e["round"] < promoted["round"] for e in entered), entered
    assert [e["step"] for e in events(partitioned, kind="snapshot_persisted") if e["wall"] > cut_at + 1] == []
    assert "not writing to the persistent tier: this node's heartbeat has not reached" in partitioned.stderr()
    # while the job's own uploads went on: its newest persistent step is one of the last ones
    assert durable.latest_complete_step(LocalStorage(tmp_path / "ckpt")) == 59


def _newest_step(node: Launch) -> int:
    """The newest "step N loss" line a node's rank 0 printed (-1: none yet)."""
    steps = re.findall(r"^step (\d+) loss", node.stdout(), re.MULTILINE)
    return max(map(int, steps), default=-1)
