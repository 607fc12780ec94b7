"""Jobs across "hosts" with their own addresses and hostnames (network namespaces on a bridge).

Each host's /etc/hosts maps its own name to 127.0.1.1, as Debian and Ubuntu do, and the jobs are
started the way torchrun users start them: a host name as the endpoint, no --local-addr, no
GLOO_SOCKET_IFNAME. See tests/helpers/netns_cluster.py for the fixture.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from resilrun.storage import LocalStorage
from resilrun.tiers import durable
from tests.etcd_server import EtcdCluster, Placement, etcd_binary
from tests.helpers.netns_cluster import Cluster
from tests.integration.conftest import (
    PORT,
    Launch,
    active_workers,
    alive,
    assert_nothing_left,
    clean_checksum,
    drop_off,
    events,
    needs_nft,
    newest_step,
    resumed,
    run_resilrun,
    wait_for,
)
from tests.integration.test_tier1_restore import EXAMPLE

pytestmark = pytest.mark.integration


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
    # Given two hosts x 2 workers replicating to each other, one warm spare worker each, and a
    # third host standing by as a spare node
    cluster, start = cluster_of(3)
    target = tmp_path / "multi.sha"
    train = [str(EXAMPLE), "--steps", "40", "--hidden", "64", "--sleep", "0.15", "--checksum-file", str(target)]
    flags = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
        "--spares", "1", "--heartbeat-timeout", "3", "--max-restarts", "0",
    ]  # fmt: skip
    first = [start(name, *flags, "--node-rank", name[1:], *train) for name in ("h0", "h1")]
    wait_for(lambda: any("round 0 formed" in n.stderr() for n in first), 150, "the round to form")
    spare = start("h2", *flags, *train)
    wait_for(lambda: "standing by as a spare node" in spare.stderr(), 150, "the spare host")
    wait_for(lambda: any("step 10 loss" in n.stdout() for n in first), 150, "training to pass step 10")
    survivor, doomed = first
    survivor_workers = active_workers(survivor)
    assert len(survivor_workers) == 2
    # When h1 drops off the network (its link goes down: the others see silence, not a refused
    # connection) and its processes die with it
    doomed_tree = drop_off(cluster, "h1", doomed)
    # Then the spare host takes its node rank in-process while the survivor's workers keep running,
    wait_for(lambda: "spare node takes node rank" in spare.stderr(), 60, "the spare host to take over")
    assert alive(survivor_workers) == survivor_workers
    # and the job ends bitwise equal to a clean run, without a restart
    _spare_took_over(survivor, spare, node_rank=1)
    lost = events(survivor, kind="node_lost")
    assert lost and {e["host"] for e in lost} == {"h1"}
    # every rank resumed at one step: the survivor's from their memory, the lost ones from replicas
    steps = resumed(survivor, spare)
    step = steps[0][0]
    assert steps == {0: (step, "memory"), 1: (step, "memory"), 2: (step, "peer"), 3: (step, "peer")}, steps
    assert "recovering in-process" in survivor.stderr()
    assert target.read_text() == clean_checksum(launcher, tmp_path, 4, *train[1:-2])
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
@pytest.mark.parametrize("partition", ["link down", "one way"])
def test_a_host_partitioned_past_the_heartbeat_timeout_then_healed_is_fenced_and_rejoins_as_a_spare(
    cluster_of, launcher, tmp_path: Path, partition: str
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
    first = [start("h0", *flags, "--node-rank", "0", *train)]
    first.append(start("h1", *flags, "--node-rank", "1", *train, env=slow_uploads))
    wait_for(lambda: any("round 0 formed" in n.stderr() for n in first), 150, "the round to form")
    spare = start("h2", *flags, *train)
    wait_for(lambda: "standing by as a spare node" in spare.stderr(), 150, "the spare host")
    wait_for(lambda: any("step 10 loss" in n.stdout() for n in first), 150, "training to pass step 10")
    survivor, partitioned = first
    # When h1 is cut off for longer than the heartbeat timeout, its processes alive all along
    # (its link down; or one way: what it sends goes out, nothing reaches it),
    if partition == "link down":
        cluster.cut("h1")
    else:
        needs_nft()
        for other in ("h0", "h2"):
            cluster.block(other, "h1")
    cut_at = time.time()
    wait_for(lambda: events(survivor, kind="spare_promoted"), 60, "the spare host to take h1's place")
    promoted_at = newest_step(survivor)
    wait_for(lambda: newest_step(survivor) >= promoted_at + 5, 60, "training to go on without h1")
    # and then comes back
    cluster.heal("h1") if partition == "link down" else cluster.clear()
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


@pytest.mark.timeout(300)
def test_a_job_with_packet_loss_on_every_link_finishes_bitwise_equal(cluster_of, launcher, tmp_path: Path) -> None:
    needs_nft()
    # Given two hosts with replicas on each other, and 3 % of the packets every host receives lost
    cluster, start = cluster_of(2)
    cluster.lose(3)
    target = tmp_path / "multi.sha"
    train = [str(EXAMPLE), "--steps", "20", "--hidden", "64", "--checksum-file", str(target)]
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
        "--heartbeat-timeout", "5", "--max-restarts", "0",
    ]  # fmt: skip
    nodes = [start(name, *flags, *train) for name in ("h0", "h1")]
    # Then TCP's retransmissions carry it: no node is judged lost, nothing restarts, nothing is
    # left, and it ends bitwise equal to a clean run
    for node in nodes:
        assert node.wait(250) == 0, node.stderr()[-4000:]
        assert_nothing_left(node)
    assert events(*nodes, kind="node_lost") == [] and events(*nodes, kind="restart") == []
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *train[1:-2])


@pytest.mark.timeout(300)
def test_a_node_cut_from_its_replica_peer_only_trains_on_and_replicates_again_once_healed(
    cluster_of, launcher, tmp_path: Path
) -> None:
    needs_nft()
    # Given two hosts with replicas on each other
    cluster, start = cluster_of(2)
    target = tmp_path / "multi.sha"
    # (200 paced steps: each status read below starts a Python with torch on a busy machine, seconds)
    train = [str(EXAMPLE), "--steps", "200", "--hidden", "64", "--sleep", "0.1", "--checksum-file", str(target)]
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}", "--replicas", "1",
        "--heartbeat-timeout", "3", "--max-restarts", "0",
    ]  # fmt: skip
    first, second = (start(name, *flags, "--node-rank", name[1:], *train) for name in ("h0", "h1"))
    wait_for(lambda: newest_step(first) >= 10, 150, "training to pass step 10")
    wait_for(lambda: _peer_lag(cluster, 0) in (0, 1), 60, "h0's replicas to keep up")
    # When what h0 sends to h1's replica server is dropped (the data plane to that peer; the store,
    # heartbeats and the collectives still get through)
    (started,) = events(second, kind="agent_started")
    port = int(started["replica_server"].rsplit(":", 1)[1])
    cut_wall = time.time()
    cluster.block("h0", "h1", port=port)
    cut_at = newest_step(first)
    # Then training goes on (the commit gate waits about a step for the cut peer, then no longer),
    wait_for(lambda: newest_step(first) >= cut_at + 25, 120, "training to go on with the replica peer cut")
    behind = lambda: [e for e in events(first, kind="replica_behind") if e["wall"] >= cut_wall]  # noqa: E731
    wait_for(behind, 60, "the push to the cut peer to fail")  # its deadline may end after the gate's wait
    assert [e["peer"].startswith("198.18.0.2:") for e in behind()] == [True], behind()  # said once, and shown:
    assert (_peer_lag(cluster, 0) or 0) >= 10  # its replicas lag
    # and once healed h0 replicates again (its next push of its newest step lands: it says so; the
    # job may end before another status read); no node was judged lost, nothing restarted, bitwise equal
    healed_wall = time.time()
    cluster.clear()
    caught_up = lambda: [e for e in events(first, kind="replica_caught_up") if e["wall"] >= healed_wall]  # noqa: E731
    wait_for(caught_up, 120, "h0's replicas to catch up once healed")
    assert [e["peer"] for e in caught_up()] == [behind()[0]["peer"]]
    for node in (first, second):
        assert node.wait(250) == 0, node.stderr()[-4000:]
        assert_nothing_left(node)
    assert events(first, second, kind="node_lost") == [] and events(first, second, kind="restart") == []
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *train[1:-2])


def _spare_took_over(survivor: Launch, spare: Launch, node_rank: int) -> None:
    """Both ended cleanly, leaving nothing, with no restart: the spare took ``node_rank`` in-process."""
    for node in (survivor, spare):
        assert node.wait(250) == 0, node.stderr()[-4000:]
        assert_nothing_left(node)
    assert events(survivor, spare, kind="restart") == []
    taken = events(survivor, spare, kind="spare_promoted")
    assert [t.get("node_rank_taken") for t in taken] == [node_rank], taken


def _peer_lag(cluster: Cluster, node_rank: int) -> int | None:
    """``tiers.peer.lag_steps`` of a node in ``resilrun status --json``, run as a user would on h0."""
    done = run_resilrun("status", "--rdzv-endpoint", f"h0:{PORT}", "--json", host=cluster.host("h0"))
    document = json.loads(done.stdout).get("data") if done.stdout.strip() else None
    nodes = [n for n in (document or {}).get("nodes", []) if n.get("node_rank") == node_rank]
    return nodes[0]["tiers"]["peer"].get("lag_steps") if nodes else None


@pytest.mark.timeout(400)
def test_on_etcd_the_job_survives_losing_the_host_of_an_etcd_member_and_node_rank_0(
    cluster_of, launcher, tmp_path: Path
) -> None:
    if etcd_binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("etcd is required in CI (make test-tools installs Debian's etcd-server as root)")
        pytest.skip("etcd is not installed (Debian: apt-get install etcd-server)")
    # Given a three-member etcd cluster on h0-h2, a job of 2 workers per host (and a warm spare
    # worker each) on h0 (node rank 0) and h1, replicating to each other, and a spare host h3
    cluster, start = cluster_of(4)
    placements = [Placement(h.addr, lambda argv, h=h: cluster.command(h, argv)) for h in cluster.hosts[:3]]
    etcd = EtcdCluster(tmp_path / "etcd", placements=placements).start(timeout=60)
    try:
        target = tmp_path / "multi.sha"
        train = [str(EXAMPLE), "--steps", "50", "--hidden", "64", "--sleep", "0.15", "--checksum-file", str(target)]
        flags = [
            "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
            "--rdzv-endpoint", "h0:2379,h1:2379,h2:2379", "--replicas", "1", "--spares", "1",
            "--heartbeat-timeout", "3", "--max-restarts", "0",
        ]  # fmt: skip
        doomed, survivor = (start(f"h{i}", *flags, "--node-rank", str(i), *train) for i in (0, 1))
        wait_for(lambda: "round 0 formed" in survivor.stderr(), 150, "the round to form")
        spare = start("h3", *flags, *train)
        wait_for(lambda: "standing by as a spare node" in spare.stderr(), 150, "the spare host")
        wait_for(lambda: newest_step(doomed) >= 10, 150, "training to pass step 10")
        # When h0 drops off the network, with its etcd member, the round's worker store (node rank
        # 0 hosts it) and its processes
        doomed_tree = drop_off(cluster, "h0", doomed)
        # Then the other two etcd members keep the rendezvous going, the spare host takes node rank
        # 0 in-process, and the job ends bitwise equal to a clean run, without a restart
        _spare_took_over(survivor, spare, node_rank=0)
        steps = resumed(survivor, spare)
        assert sorted(rank for rank, (_, tier) in steps.items() if tier == "peer") == [0, 1], steps
        assert target.read_text() == clean_checksum(launcher, tmp_path, 4, *train[1:-2])
        assert not alive(doomed_tree)
    finally:
        etcd.stop()
