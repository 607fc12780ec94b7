"""A party that reaches every port of a job but lacks the job secret (issue 19), on hosts of their own.

On the network-namespace cluster (tests/helpers/netns_cluster.py): two hosts run a two-node job with
a secret file, a third hosts its rendezvous store (as a shared rendezvous service does: the store
outlives the job, so status is read after it ended), and the party runs on a fourth
(tests/helpers/store_party.py): a plain TCPStore client of the job's store, since TCPStore has no
authentication, and a peer-tier client with a guessed secret. While the job trains (and recovers a
killed worker in-process) it asks the replica servers it finds named in the store for snapshots and
pushes them a replica, holds both nodes' heartbeat counters still (counters carry no MAC), writes a
rendezvous document that assigns the ranks otherwise and lets it join, a node-lost marker, a failed
status for a node, and, after the recovery, writes back a valid rendezvous document and a node's
valid status document it recorded earlier (replays). Every attempt is refused and said in the
agents' log and in ``resilrun status``; the job neither restarts nor rolls back, and ends bitwise
equal to a failure-free run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from resilrun import keys
from resilrun.rendezvous.protocol import NodeInfo, RdzvState
from tests.helpers.netns_cluster import Cluster
from tests.integration.conftest import (
    EXAMPLE,
    PORT,
    ROOT,
    active_workers,
    assert_nothing_left,
    clean_checksum,
    events,
    newest_step,
    run_resilrun,
    wait_for,
)

pytestmark = pytest.mark.integration

TRAIN = ["--steps", "100", "--hidden", "64", "--sleep", "0.1"]


class _Party:
    """tests/helpers/store_party.py on a host: one command per line, one JSON answer per line."""

    def __init__(self, cluster: Cluster, host: str, *argv: str) -> None:
        command = cluster.command(host, [sys.executable, "-m", "tests.helpers.store_party", *argv])
        self.popen = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )

    def first_line(self) -> str:
        assert self.popen.stdout is not None
        return self.popen.stdout.readline().strip()

    def ask(self, *words: str) -> dict[str, Any]:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(" ".join(words) + "\n")
        self.popen.stdin.flush()
        answer = json.loads(self.popen.stdout.readline())
        assert answer["ok"], answer
        return answer

    def close(self) -> None:
        if self.popen.stdin is not None:
            self.popen.stdin.close()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)


class _Watch:
    """``resilrun status --watch --json`` with the job secret on a host: every document it printed."""

    def __init__(self, cluster: Cluster, host: str, endpoint: str, run_id: str, secret: Path) -> None:
        argv = [sys.executable, "-m", "resilrun", "status", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                "--json", "--watch", "0.3", "--timeout", "10", "--job-secret-file", str(secret)]  # fmt: skip
        self.popen = subprocess.Popen(cluster.command(host, argv), stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.docs: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.docs.append(json.loads(line)["data"])

    def stop(self) -> None:
        self.popen.terminate()
        self.popen.wait(10)
        self._thread.join(5)


def _status(cluster: Cluster, host: str, endpoint: str, run_id: str, secret: Path) -> dict:
    args = ["status", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--json", "--timeout", "10",
            "--job-secret-file", str(secret)]  # fmt: skip
    done = run_resilrun(*args, host=cluster.host(host))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["data"]


@pytest.mark.timeout(400)
def test_a_party_on_another_host_without_the_secret_cannot_join_reassign_declare_lost_fake_status_or_replay(
    cluster_of, launcher, tmp_path: Path
) -> None:
    cluster, start = cluster_of(4)
    endpoint, run_id = f"h2:{PORT}", "store-attack"
    secret = tmp_path / "job.secret"
    secret.write_text("a-job-secret-for-the-attack-test\n")
    secret.chmod(0o600)
    target = tmp_path / "attacked.sha"
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
        "--job-secret-file", str(secret), "--spares", "1", "--max-restarts", "0",
        "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2",
    ]  # fmt: skip
    train = [str(EXAMPLE), *TRAIN, "--checksum-file", str(target)]
    # Given a two-node job with a job secret on h0 and h1, training, its store served from h2,
    service = _Party(cluster, "h2", "serve", str(PORT))
    assert service.first_line() == "ready"
    nodes = [start(f"h{rank}", *flags, "--node-rank", str(rank), *train) for rank in (0, 1)]
    wait_for(lambda: max(newest_step(n) for n in nodes) >= 5, 150, "training to pass step 5")
    # and a party on h3 that reaches every port (the store, the replica servers) but lacks the secret,
    party = _Party(cluster, "h3", "attack", endpoint)
    assert json.loads(party.first_line())["ok"]
    state_key = keys.rdzv_state(run_id)
    recorded = party.ask("read", state_key)  # a valid document of generation 0, to replay later
    participants = recorded["body"]["participants"]  # no secrecy: it reads them (column by column)
    node_ids = participants["node_id"]
    status_key = keys.node_status(run_id, node_ids[0])
    old_status = party.ask("read", status_key)  # node 0's valid status of now, to replay later
    # When it asks each replica server, which it finds named there, for what it holds and for a
    # snapshot, and pushes one a replica, with the secret it guesses,
    for address in participants["peer_addr"]:
        assert address.startswith(("198.18.0.1:", "198.18.0.2:")), address
        errors = party.ask("probe", address)["errors"]
        assert all(e is not None and "refused our secret" in e for e in errors.values()), errors
    # holds both nodes' heartbeat counters still, for the rest of the job,
    party.ask("hold", ",".join(keys.node_heartbeat(run_id, node_id) for node_id in node_ids))
    # (which the watchers judge stale and refute by asking the agents, who prove the job secret:
    # waited for here, before the recovery below. After it, no watcher judged the held counters
    # stale in about half the runs: the recovery restarts both agents' heartbeat clocks together,
    # and a watcher whose reads fall just after the other node's beats sees each beat before the
    # party resets it, so the counter moves for it however long it is held)
    refuted = "yet its agent proved the job secret on its replica server: not judged lost"
    wait_for(lambda: any(refuted in n.stderr() for n in nodes), 60, "a watcher to refute the held counters")
    # writes a document that reassigns the ranks and makes it a participant,
    forged = RdzvState(
        round=9,
        complete=True,
        participants=(NodeInfo("attacker:1:x", "198.18.0.4", 1), NodeInfo(node_ids[0], "198.18.0.1", 1)),
        seq=10**6,
    )
    party.ask("write", state_key, forged.to_bytes().hex())
    # marks node 1 lost and writes a failed status for node 0
    lost = json.dumps({"round": 9, "node_rank": 1, "host": "x"}).encode()
    party.ask("write", keys.node_lost(run_id, node_ids[1]), lost.hex())
    party.ask("write", status_key, json.dumps({"state": "failed", "host": "attacker"}).encode().hex())
    # and, when rank 1's worker is killed after all that and its place taken in-process, replays
    # the generation-0 document,
    (worker,) = active_workers(nodes[1])
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: events(*nodes, kind="generation_entered"), 120, "the in-process recovery")
    party.ask("write", state_key, recorded["value"])
    # and node 0's old status over and over while an operator on h3 watches with the secret
    watch = _Watch(cluster, "h3", endpoint, run_id, secret)
    wait_for(lambda: len(watch.docs) >= 2, 60, "the watch's first documents")
    party.ask("replay", status_key, old_status["value"])
    wait_for(lambda: any(d["store"]["replayed"] for d in watch.docs), 30, "the watch to see the replay")
    watch.stop()
    party.ask("stop")
    # Then the job ends as a failure-free run does: no restart, nobody else joined, nothing rolled back
    for node in nodes:
        assert node.wait(150) == 0, node.stderr()[-3000:]
        assert_nothing_left(node)
    doc = _status(cluster, "h3", endpoint, run_id, secret)
    party.close()
    service.close()
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *TRAIN)
    assert not events(*nodes, kind="restart")
    assert not events(*nodes, kind="node_lost")
    started = events(*nodes, kind="round_started")
    assert started and all(e["nodes"] == 2 for e in started)
    # and every attempt was refused and said: in the agents' log (naming the party's host),
    err = "".join(n.stderr() for n in nodes)
    assert "does not carry this job's MAC" in err
    assert "refused a replayed rendezvous document" in err or "is gone or forged" in err
    assert "attacker" not in err
    assert refuted in err
    assert err.count("refused a replica connection from 198.18.0.4: it did not prove the job secret") == 2
    # in the watch: the replayed status refused, and the newest one read shown in its place,
    replayed = [d for d in watch.docs if d["store"]["replayed"]]
    assert all(d["store"]["replayed"] == [status_key] for d in replayed)
    seen = [n for d in replayed for n in d["nodes"] if n["node_id"] == node_ids[0]]
    assert seen and all(n["host"] == "h0" and n["state"] != "failed" for n in seen)
    # and in status (read with the secret): the forged documents named, none of them shown
    assert doc["store"]["verified"] is True
    assert keys.node_lost(run_id, node_ids[1]) in doc["store"]["refused"]
    assert all(node["state"] != "lost" and node.get("host") != "attacker" for node in doc["nodes"])
