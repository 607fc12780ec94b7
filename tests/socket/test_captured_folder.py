"""A script's own checkpoint folder (``--capture-dir``) across real replica servers, a real inotify
watch and a directory as the persistent tier: captured once complete, replicated, persisted, and put
back into a replacement node's empty folder from the fastest tier that has an intact copy.

The files are written the way scripts write them: ``torch.save`` to a fixed name, a rewrite in
place that the writer's death tears, a plain ``open()``, a removal.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from resilrun.agent.state.captured import CapturedFolder
from resilrun.storage import LocalStorage
from resilrun.tiers.authentic import durable_key
from resilrun.tiers.captured import durable
from resilrun.tiers.captured.catalog import Catalog, FileVersion, MemoryBudget, digest
from resilrun.tiers.memory import NodeMemoryTier
from resilrun.tiers.peer import ReplicaServer, ReplicaStore
from resilrun.tiers.peer.files import fetch_file, list_files
from resilrun.tiers.peer.wire import PeerKey
from tests.conftest import wait_until

SECRET = b"job-secret-" + b"c" * 21
SETTLE_S = 0.1


@dataclass
class FakeNode:
    """One node's captured folder, catalog and replica server."""

    name: str
    root: Path
    catalog: Catalog
    server: ReplicaServer
    folder: CapturedFolder


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator:
    made: list[tuple[FakeNode, NodeMemoryTier, ReplicaStore]] = []

    def make(
        name: str,
        *,
        targets: list[FakeNode] = (),  # type: ignore[assignment]
        peers: list[FakeNode] = (),  # type: ignore[assignment]
        storage: LocalStorage | None = None,
        mac_key: bytes | None = None,
        secret: bytes | PeerKey = SECRET,
        start: bool = True,
        budget: MemoryBudget | None = None,
    ) -> FakeNode:
        root = tmp_path / name
        catalog = Catalog(budget)
        memory = NodeMemoryTier(f"t{uuid.uuid4().hex[:8]}")
        store = ReplicaStore("test")
        server = ReplicaServer(secret, store, memory, node_id=name, captured=catalog)
        folder = CapturedFolder(
            root,
            catalog,
            name,
            secret=secret,
            targets=lambda: [n.server.address for n in targets],
            peers=lambda: [n.server.address for n in peers],
            storage=storage,
            mac_key=mac_key,
            settle_s=SETTLE_S,
        )
        if start:
            folder.start()
        node = FakeNode(name, root, catalog, server, folder)
        made.append((node, memory, store))
        return node

    yield make
    for node, memory, store in made:
        node.folder.close(timeout_s=5)
        node.server.close()
        store.close()
        memory.close()


def save(path: Path, epoch: int) -> bytes:
    """What the tutorial's rank 0 does every few epochs; returns the bytes it wrote."""
    snapshot = {"MODEL_STATE": {"weight": torch.full((64, 64), float(epoch))}, "EPOCHS_RUN": epoch}
    torch.save(snapshot, path)
    return path.read_bytes()


def torch_bytes(epoch: int) -> bytes:
    buffer = io.BytesIO()
    torch.save({"MODEL_STATE": {"weight": torch.full((64, 64), float(epoch))}, "EPOCHS_RUN": epoch}, buffer)
    return buffer.getvalue()


def held(node: FakeNode, path: str) -> bytes | None:
    found = node.catalog.read(path)
    return None if found is None else found[1]


def test_a_saved_snapshot_is_captured_and_replicated_and_a_replacement_nodes_empty_folder_gets_it(nodes) -> None:
    # Given node a capturing its folder and replicating to node b
    b = nodes("b")
    a = nodes("a", targets=[b])
    # When the script saves its snapshot there
    written = save(a.root / "snapshot.pt", 4)
    # Then b holds the same bytes
    wait_until(lambda: held(b, "snapshot.pt") == written, 10, "the replica on b")
    # And when a is lost, its replacement c (an empty folder) gets it from b before its workers start
    c = nodes("c", peers=[b])
    report = c.folder.restore(30)
    assert report.files == ["snapshot.pt"] and report.sources == {"peer": 1}
    assert (c.root / "snapshot.pt").read_bytes() == written
    assert torch.load(c.root / "snapshot.pt")["EPOCHS_RUN"] == 4
    # with the writer's mtime, so a second restore finds it in place and writes nothing
    assert (c.root / "snapshot.pt").stat().st_mtime_ns == (a.root / "snapshot.pt").stat().st_mtime_ns
    assert c.folder.restore(30).files == []
    # and the restore's own rename is not captured as a new version of c's
    version = c.catalog.newest("snapshot.pt")
    assert version is not None and version.node == "a"


def test_a_save_torn_by_the_writers_death_is_never_captured_and_is_replaced_by_the_newest_complete_one(
    nodes,
) -> None:
    # Given a complete snapshot of epoch 2, captured
    a = nodes("a")
    complete = save(a.root / "snapshot.pt", 2)
    wait_until(lambda: held(a, "snapshot.pt") == complete, 10, "the capture")
    # When the next save is cut off half way (its writer killed: the kernel closes the file)
    torn = torch_bytes(4)[: len(complete) // 2]
    with open(a.root / "snapshot.pt", "wb") as out:
        out.write(torn)
    a.folder.worker_failed()
    # Then the torn bytes are not captured
    assert held(a, "snapshot.pt") == complete
    # and before the workers restart the folder holds epoch 2 again: the script's torch.load works
    report = a.folder.restore(30)
    assert report.files == ["snapshot.pt"] and report.sources == {"memory": 1}
    assert torch.load(a.root / "snapshot.pt")["EPOCHS_RUN"] == 2


def test_a_plain_file_closed_as_a_worker_fails_is_not_captured_but_a_checkable_one_is(nodes) -> None:
    a = nodes("a")
    (a.root / "progress.txt").write_text("epoch 3\n")
    wait_until(lambda: held(a, "progress.txt") is not None, 10, "the first capture")
    # When a worker dies just as both were closed: nothing tells a plain file's end, a zip's does
    (a.root / "progress.txt").write_text("epoch 4 and half a li")
    complete = save(a.root / "snapshot.pt", 4)
    a.folder.worker_failed()
    assert held(a, "progress.txt") == b"epoch 3\n"
    assert held(a, "snapshot.pt") == complete


def test_a_corrupt_replica_falls_back_to_the_persistent_tier_and_is_dropped(nodes, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "bucket")
    key = durable_key(SECRET, str(storage.root))
    b = nodes("b")
    a = nodes("a", targets=[b], storage=storage, mac_key=key)
    written = save(a.root / "snapshot.pt", 6)
    wait_until(lambda: held(b, "snapshot.pt") == written, 10, "the replica on b")
    wait_until(lambda: [s.version.path for s in durable.listed(storage, key)] == ["snapshot.pt"], 10, "the upload")
    # When b's copy rots in its memory
    version = b.catalog.newest("snapshot.pt")
    assert version is not None
    b.catalog.remove("snapshot.pt")
    b.catalog.put(version, written[:-1] + bytes([written[-1] ^ 1]), own=False)
    # Then a replacement reads it from storage instead, and b no longer lists the rotten copy
    c = nodes("c", peers=[b], storage=storage, mac_key=key)
    report = c.folder.restore(30)
    assert report.sources == {"persistent": 1}
    assert (c.root / "snapshot.pt").read_bytes() == written
    assert b.catalog.newest("snapshot.pt") is None


def test_only_files_signed_with_the_job_secret_are_restored_from_storage(nodes, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "bucket")
    key = durable_key(SECRET, str(storage.root))
    a = nodes("a", storage=storage, mac_key=key)
    written = save(a.root / "snapshot.pt", 8)
    wait_until(lambda: len(durable.listed(storage, key)) == 1, 10, "the upload")
    # Given someone with write access to the bucket plants a pickle with a well-formed index, no MAC
    planted = b"not what the script saved"
    forged = FileVersion("latest.pt", len(planted), digest(planted), 1, 2**62, "attacker")
    durable.write(storage, forged, planted, None)
    # and rewrites the real index to name his bytes, keeping the old MAC
    index = json.loads(storage.get(durable.index_key("snapshot.pt")))
    storage.put(durable.data_key(digest(planted)), planted)
    swapped = {**index, "sha256": digest(planted), "size": len(planted)}
    storage.put(durable.index_key("snapshot.pt"), json.dumps(swapped).encode())
    # Then a fresh node restores neither
    c = nodes("c", storage=storage, mac_key=key)
    report = c.folder.restore(30)
    assert report.files == [] and not (c.root / "latest.pt").exists() and not (c.root / "snapshot.pt").exists()
    # And the genuine one, signed, is restored; a node without the secret from outside restores nothing
    storage.put(durable.index_key("snapshot.pt"), json.dumps(index).encode())
    assert nodes("d", storage=storage, mac_key=key).folder.restore(30).files == ["snapshot.pt"]
    assert (tmp_path / "d" / "snapshot.pt").read_bytes() == written
    assert nodes("e", storage=storage, mac_key=None).folder.restore(30).files == []


def test_a_removed_file_leaves_its_replica_and_the_persistent_tier(nodes, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "bucket")
    key = durable_key(SECRET, str(storage.root))
    b = nodes("b")
    a = nodes("a", targets=[b], storage=storage, mac_key=key)
    save(a.root / "epoch_2.pt", 2)
    save(a.root / "epoch_4.pt", 4)
    wait_until(lambda: len(durable.listed(storage, key)) == 2 and held(b, "epoch_2.pt"), 10, "both shipped")
    # When the script keeps only its newest checkpoint
    os.remove(a.root / "epoch_2.pt")
    # Then the replica and the persistent tier forget it too
    wait_until(lambda: b.catalog.newest("epoch_2.pt") is None, 10, "the replica's removal")
    wait_until(lambda: [s.version.path for s in durable.listed(storage, key)] == ["epoch_4.pt"], 10, "removal")
    assert held(b, "epoch_4.pt") is not None


def test_files_written_atomically_into_a_new_directory_are_captured_under_their_final_names(nodes) -> None:
    b = nodes("b")
    a = nodes("a", targets=[b])
    # A DCP-like directory: shards first, the metadata renamed into place last
    step = a.root / "checkpoints" / "step_10"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"shard zero")
    (step / ".metadata.tmp").write_bytes(b"metadata")
    os.replace(step / ".metadata.tmp", step / ".metadata")
    paths = {"checkpoints/step_10/__0_0.distcp", "checkpoints/step_10/.metadata"}
    wait_until(lambda: {v.path for v in b.catalog.versions()} == paths, 10, "the replicas")
    c = nodes("c", peers=[b])
    assert sorted(c.folder.restore(30).files) == sorted(paths)
    assert (c.root / "checkpoints" / "step_10" / ".metadata").read_bytes() == b"metadata"


def test_an_encrypted_job_moves_captured_files_under_its_key_and_a_wrong_secret_gets_nothing(nodes) -> None:
    key = PeerKey(SECRET, encrypt=True)
    b = nodes("b", secret=key)
    a = nodes("a", targets=[b], secret=key)
    written = save(a.root / "snapshot.pt", 1)
    wait_until(lambda: held(b, "snapshot.pt") == written, 10, "the encrypted replica")
    version = b.catalog.newest("snapshot.pt")
    assert version is not None
    assert fetch_file(b.server.address, key, version, timedelta(seconds=5)) == written
    from resilrun.tiers.peer.wire import ReplicationError

    with pytest.raises(ReplicationError):
        list_files(b.server.address, PeerKey(b"another-secret-" + b"z" * 17, encrypt=True), timedelta(seconds=5))


def test_a_dcp_checkpoint_whose_shard_was_lost_with_its_host_is_hidden_and_the_one_before_is_whole(nodes) -> None:
    # Given DCP folders written across two hosts: a (rank 0, and the .metadata) and a lost host
    # whose rank-1 shard of step-10 never reached a replica (its step-5 shard did)
    b = nodes("b")
    a = nodes("a", targets=[b], peers=[b])
    metadata = b"\x80\x04 pickled DCP metadata naming __0_0.distcp and __1_0.distcp \x2e"
    for step in ("step-5", "step-10"):
        (a.root / step).mkdir()
        (a.root / step / "__0_0.distcp").write_bytes(b"rank 0 shard of " + step.encode())
        (a.root / step / ".metadata").write_bytes(metadata)
    b.catalog.put(
        FileVersion("step-5/__1_0.distcp", 3, digest(b"one"), 1, 1, "lost"), b"one", own=False
    )  # what the lost host replicated to b before it died
    wait_until(lambda: len(b.catalog.versions()) == 5, 10, "a's files on b")
    # When the replacement c and the survivor a put their folders back before the next round
    c = nodes("c", peers=[a, b])
    report = c.folder.restore(30)
    a_report = a.folder.restore(30)
    # Then step-10 reads as incomplete on both (no .metadata), step-5 is whole on both
    assert report.incomplete == ["step-10"] and a_report.incomplete == ["step-10"]
    for node in (a, c):
        assert not (node.root / "step-10" / ".metadata").exists()
        assert {p.name for p in (node.root / "step-5").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert (a.root / "step-10" / ".resilrun-incomplete.metadata").read_bytes() == metadata


def test_a_file_too_large_for_the_memory_left_is_said_so_and_still_replicated_and_persisted(
    nodes, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = LocalStorage(tmp_path / "bucket")
    key = durable_key(SECRET, str(storage.root))
    b = nodes("b")
    # Given a node with less memory to spare than the snapshot's size
    a = nodes("a", targets=[b], storage=storage, mac_key=key, budget=MemoryBudget(lambda: 4096, 1024))
    written = save(a.root / "snapshot.pt", 3)
    assert len(written) > 4096 - 1024
    # Then the error says so, and the copy on the peer and in storage are made from the folder
    wait_until(lambda: held(b, "snapshot.pt") == written, 10, "the replica on b")
    wait_until(lambda: len(durable.listed(storage, key)) == 1, 10, "the upload")
    assert a.catalog.newest("snapshot.pt") is not None and a.catalog.read("snapshot.pt") is None
    assert "is not kept in node memory: too little memory left" in caplog.text
    # and a replacement still gets it
    c = nodes("c", peers=[b], storage=storage, mac_key=key)
    assert c.folder.restore(30).files == ["snapshot.pt"]
