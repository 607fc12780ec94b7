"""A party that reaches the rendezvous store's port but lacks the job secret (issue 19).

TCPStore has no authentication: this test is such a party, a plain TCPStore client of the job's
store. While a two-node job with a secret file trains (and recovers a killed worker in-process), it
writes a rendezvous document that assigns the ranks otherwise and lets it join, a node-lost marker,
a failed status for a node, and, after the recovery, writes back a valid rendezvous document it
recorded earlier (a replay). Every attempt is refused and said in the agents' log and in
``resilrun status``; the job neither restarts nor rolls back, and ends bitwise equal to a
failure-free run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from resilrun import keys
from resilrun.rendezvous.protocol import NodeInfo, RdzvState
from resilrun.rendezvous.sealed import MAGIC, TAG_BYTES
from tests.conftest import free_port
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
    node_ids = [p["node_id"] for p in json.loads(body)["participants"]]
    # When the party writes a document that reassigns the ranks and makes it a participant,
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
    # and in status (read with the secret): the forged documents named, none of them shown
    assert doc["store"]["verified"] is True
    assert keys.node_lost(run_id, node_ids[1]) in doc["store"]["refused"]
    assert all(node["state"] != "lost" and node.get("host") != "attacker" for node in doc["nodes"])
