"""Resuming at another world size: the state each new rank restores equals, bit for bit, what the
old world had at that step (digests of the whole parameters and AdamW moments), and no step is lost.

- A new job on an old ``--checkpoint-uri`` at a bigger (FSDP2: shards resharded) or smaller (DDP)
  world resumes from the persisted step.
- An elastic job of three hosts (network namespaces; one rank each, FSDP2) loses a host and has no
  spare node: it goes on with two from the newest step every rank had committed (the lost rank's
  snapshot from its replica), and when a node joins again it grows back to three, again from the
  newest step.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from tests.integration.conftest import PORT, ROOT, drop_off

pytestmark = pytest.mark.integration

SCRIPT = ROOT / "tests" / "helpers" / "train_elastic.py"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(predicate, timeout: float, what: str, *launches) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    logs = "\n".join(launch.stderr()[-25000:] for launch in launches)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


def _check_resumed(records: list[dict], world: int) -> dict:
    """The resume into ``world`` restored the newest step its old world finished, digest for digest."""
    resumed = [r for r in records if "resumed" in r and r["world"] == world]
    assert resumed, records
    entry = resumed[-1]
    before = [r for r in records[: records.index(entry)] if "step" in r]
    # no step lost: the newest step trained before the resize (rank 0 records after its commit)
    assert entry["resumed"] >= before[-1]["step"] - 1, (entry, before[-3:])
    trained = [r for r in before if r["step"] == entry["resumed"]]
    assert trained and trained[-1]["world"] != world
    assert entry["digest"] == trained[-1]["digest"]
    return entry


@pytest.mark.parametrize(("first", "then", "mode"), [(2, 3, "fsdp"), (3, 2, "ddp")], ids=["fsdp-2-to-3", "ddp-3-to-2"])
def test_a_new_job_at_another_world_size_resumes_the_persisted_step(
    launcher, tmp_path: Path, first: int, then: int, mode: str
) -> None:
    ckpt, record = tmp_path / "ckpt", tmp_path / "record.jsonl"
    flags = ["--ddp"] if mode == "ddp" else []
    # Given a job of `first` ranks that persisted step 9
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", str(first), "--checkpoint-uri", str(ckpt),
        "--persist-every", "5", str(SCRIPT), "--steps", "10", "--record", str(record), *flags,
    )  # fmt: skip
    assert run.wait(120) == 0, run.stderr()[-3000:]
    # When a job of `then` ranks starts on the same checkpoint
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", str(then), "--checkpoint-uri", str(ckpt),
        str(SCRIPT), "--steps", "12", "--record", str(record), *flags,
    )  # fmt: skip
    assert run.wait(120) == 0, run.stderr()[-3000:]
    # Then it resumed from step 9, resharded, with exactly the state the first job had there
    entry = _check_resumed(_records(record), then)
    assert entry["resumed"] == 9
    assert f"resumed from step 9 (resharded from world size {first}" in run.stderr()
    # each new rank read only what it needs of the old ranks' files, checked chunk by chunk
    assert "selected bytes from the persistent tier" in run.stderr()
    assert [r["step"] for r in _records(record) if r.get("world") == then and "step" in r] == [10, 11]


@pytest.mark.timeout(400)
def test_an_elastic_job_shrinks_on_a_lost_host_and_grows_back_without_losing_a_step(cluster_of, tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    cluster, start = cluster_of(3)
    args = [
        "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", f"h0:{PORT}",
        "--rdzv-conf", "last_call_timeout=1", "--heartbeat-interval", "0.5", "--heartbeat-timeout", "2",
        "--max-restarts", "3", "--shutdown-timeout", "2",
        str(SCRIPT), "--steps", "100000", "--sleep", "0.05", "--record", str(record),
    ]  # fmt: skip
    # Given an elastic FSDP2 job training on three hosts (h0 hosts the store), replicating to each other
    nodes = {"h0": start("h0", *args)}
    time.sleep(1)
    nodes.update({name: start(name, *args) for name in ("h1", "h2")})
    world = lambda size: [r for r in _records(record) if r.get("world") == size and "step" in r]  # noqa: E731
    _wait_for(lambda: len(world(3)) >= 5, 150, "three hosts to train", *nodes.values())
    # When h2 drops off the network and its processes die with it (no spare host)
    lost = nodes.pop("h2")
    drop_off(cluster, "h2", lost)
    # Then the other two go on as a world of two from the newest step, its state intact (the lost
    # rank's shards from its replica)
    _wait_for(lambda: len(world(2)) >= 3, 120, "the job to go on with two hosts", *nodes.values())
    _check_resumed(_records(record), 2)
    # When h2 comes back and a node joins from it, Then the job grows back to three, again from the
    # newest step
    cluster.heal("h2")
    nodes["h2"] = start("h2", *args)
    _wait_for(lambda: len(world(3)) >= 8, 150, "the job to grow back", *nodes.values())
    _check_resumed(_records(record), 3)
    for node in nodes.values():
        node.popen.send_signal(signal.SIGTERM)
    for node in nodes.values():
        node.wait(60)
