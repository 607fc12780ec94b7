"""A party that reaches the rendezvous store's port but lacks the job secret (issue 19).

TCPStore has no authentication: this test is such a party, a plain TCPStore client of the job's
store. While a two-node job with a secret file trains (and recovers a killed worker in-process), it
asks the replica servers it finds named there for snapshots and pushes them a replica, holds both
nodes' heartbeat counters still (counters carry no MAC: it sets them back in a tight
loop), writes a rendezvous document that assigns the ranks otherwise and lets it join, a node-lost
marker, a failed status for a node, and, after the recovery, writes back a valid rendezvous document
it recorded earlier (a replay). Every attempt is refused and said in the agents' log and in
``resilrun status``; the job neither restarts nor rolls back, and ends bitwise equal to a
failure-free run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from resilrun import keys
from resilrun.rendezvous.protocol import NodeInfo, RdzvState
from resilrun.rendezvous.sealed import MAGIC, TAG_BYTES
from resilrun.tiers.peer import ReplicationError, fetch, inventory, push
from tests.conftest import free_port, make_snapshot
from tests.integration.conftest import (
    EXAMPLE,
    ROOT,
    assert_nothing_left,
    clean_checksum,
    events,
    newest_step,
    wait_for,
)

pytestmark = pytest.mark.integration

TRAIN = ["--steps", "50", "--hidden", "64", "--sleep", "0.1"]


# resilrun's c10d backend frames every value with one byte (rendezvous/c10d.py); the party knows.
def _write(store: TCPStore, key: str, value: bytes) -> None:
    store.set(key, b"v" + value)


def _read(store: TCPStore, key: str) -> bytes:
    return store.get(key)[1:]


class _HeldCounters:
    """Sets each counter back to one value in a tight loop, from a store connection of its own: a
    watcher reading one every heartbeat interval nearly always finds it standing still."""

    def __init__(self, port: int, counters: list[str]) -> None:
        self._store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        self._counters = counters
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key in self._counters:
                self._store.set(key, b"5")
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _status(port: int, run_id: str, secret: Path) -> dict:
    argv = [sys.executable, "-m", "resilrun", "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    done = subprocess.run(
        [*argv, "--json", "--timeout", "10", "--job-secret-file", str(secret)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["data"]


@pytest.mark.timeout(300)
def test_a_party_with_store_access_but_no_secret_cannot_join_reassign_declare_lost_fake_status_or_replay(
    launcher, tmp_path: Path
) -> None:
    port, run_id = free_port(), "store-attack"
    secret = tmp_path / "job.secret"
    secret.write_text("a-job-secret-for-the-attack-test\n")
    secret.chmod(0o600)
    target = tmp_path / "attacked.sha"
    flags = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--job-secret-file", str(secret), "--spares", "1", "--max-restarts", "0",
        "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2",
    ]  # fmt: skip
    train = [str(EXAMPLE), *TRAIN, "--checksum-file", str(target)]
    env = {"RESILRUN_FAULTS": "kill:rank=1,step=25"}
    # Given a two-node job with a job secret, training, its rendezvous store hosted outside the job
    # (as a shared rendezvous service is; the agents find the port taken and connect as clients):
    # the store outlives the job, so status is read after it ended, not in a race with its end.
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    nodes = [launcher("resilrun", *flags, "--node-rank", str(rank), *train, env=env) for rank in (0, 1)]
    wait_for(lambda: max(newest_step(n) for n in nodes) >= 5, 150, "training to pass step 5")
    state_key = keys.rdzv_state(run_id)
    recorded = _read(store, state_key)  # a valid document of generation 0, to replay later
    body = recorded[len(MAGIC) + TAG_BYTES :] if recorded.startswith(MAGIC) else recorded  # no secrecy: it reads it
    participants = json.loads(body)["participants"]
    node_ids = [p["node_id"] for p in participants]
    # When the party, which reads the replica servers' addresses there, asks one for what it holds
    # and for a snapshot, and pushes a replica to it, with the secret it guesses,
    guess = b"a-guessed-secret-of-thirty-two-b"
    replica = make_snapshot({"weight": torch.zeros(8)})
    wait = timedelta(seconds=5)
    for address in (p["peer_addr"] for p in participants):
        with pytest.raises(ReplicationError, match="refused our secret"):
            inventory(address, guess, wait)
        with pytest.raises(ReplicationError, match="refused our secret"):
            fetch(address, guess, 0, 3, wait)
        with pytest.raises(ReplicationError, match="refused our secret"):
            push(address, guess, 0, 10**6, 2, replica, {}, wait)
    # When the party holds both nodes' heartbeat counters still, for the rest of the job,
    held = _HeldCounters(port, [keys.node_heartbeat(run_id, node_id) for node_id in node_ids])
    # writes a document that reassigns the ranks and makes it a participant,
    forged = RdzvState(
        round=9,
        complete=True,
        participants=(NodeInfo("attacker:1:x", "127.0.0.1", 1), NodeInfo(node_ids[0], "127.0.0.1", 1)),
        seq=10**6,
    )
    _write(store, state_key, forged.to_bytes())
    # marks node 1 lost and writes a failed status for node 0
    _write(store, keys.node_lost(run_id, node_ids[1]), json.dumps({"round": 9, "node_rank": 1, "host": "x"}).encode())
    _write(store, keys.node_status(run_id, node_ids[0]), json.dumps({"state": "failed", "host": "attacker"}).encode())
    # and, once the killed worker's place was taken in-process, replays the generation-0 document
    wait_for(lambda: events(*nodes, kind="generation_entered"), 120, "the in-process recovery")
    _write(store, state_key, recorded)
    # Then the job ends as a failure-free run does: no restart, nobody else joined, nothing rolled back
    for node in nodes:
        assert node.wait(150) == 0, node.stderr()[-3000:]
        assert_nothing_left(node)
    held.stop()
    doc = _status(port, run_id, secret)
    assert target.read_text() == clean_checksum(launcher, tmp_path, 2, *TRAIN)
    assert not events(*nodes, kind="restart")
    assert not events(*nodes, kind="node_lost")
    started = events(*nodes, kind="round_started")
    assert started and all(e["nodes"] == 2 for e in started)
    # and every attempt was refused and said: in the agents' log,
    err = "".join(n.stderr() for n in nodes)
    assert "does not carry this job's MAC" in err
    assert "refused a replayed rendezvous document" in err or "is gone or forged" in err
    assert "attacker" not in err
    assert "yet its agent proved the job secret on its replica server: not judged lost" in err
    assert err.count("refused a replica connection from 127.0.0.1: it did not prove the job secret") == 2
    # and in status (read with the secret): the forged documents named, none of them shown
    assert doc["store"]["verified"] is True
    assert keys.node_lost(run_id, node_ids[1]) in doc["store"]["refused"]
    assert all(node["state"] != "lost" and node.get("host") != "attacker" for node in doc["nodes"])
