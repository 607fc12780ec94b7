"""``resilrun status`` for a job run with ``--capture-dir``: each node's captured files and the tiers
holding each, from the agent's catalog and ship records through the store to the text a person reads.

No processes, no inotify watch, no sleeps: the folder is never started; its ship records are made by
its own push path over a fake peer channel and an in-memory persistent tier.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resilrun.agent.state import captured as captured_module
from resilrun.agent.state.captured import STATUS_FILES, CapturedFolder
from resilrun.agent.status import StatusPublisher
from resilrun.agent.supervision.rounds import Membership
from resilrun.cli._status_render import rich_view, text_lines
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.status.view import compose, read_raw
from resilrun.storage import MemoryStorage
from resilrun.tiers.captured.catalog import Catalog, FileVersion, MemoryBudget, digest
from resilrun.tiers.captured.durable import listed
from resilrun.tiers.peer.wire import ReplicationError

SECRET = b"job-secret-" + b"c" * 21
NODE = "n0"
T0 = 1_796_000_000 * 10**9  # a capture time (ns)


def version(path: str, data: bytes, at_s: float, node: str = NODE) -> FileVersion:
    at = T0 + int(at_s * 1e9)
    return FileVersion(path, len(data), digest(data), at, at, node)


class Peers:
    """The replica targets of the node, and a peer channel where some of them are down."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.targets = ["peer-a:1", "peer-b:1"]
        self.down: set[str] = {"peer-b:1"}
        monkeypatch.setattr(captured_module, "push_file", self.push)

    def push(self, address: str, secret: Any, version: FileVersion, data: bytes, timeout: Any) -> None:
        if address in self.down:
            raise ReplicationError(f"{address} refused the connection")


@pytest.fixture
def peers(monkeypatch: pytest.MonkeyPatch) -> Peers:
    return Peers(monkeypatch)


def folder(
    root: Path,
    peers: Peers,
    *,
    storage: MemoryStorage | None = None,
    budget: MemoryBudget | None = None,
    pattern: str = "*.pt",
) -> CapturedFolder:
    return CapturedFolder(
        root,
        Catalog(budget),
        NODE,
        pattern=pattern,
        secret=SECRET,
        targets=lambda: list(peers.targets),
        storage=storage,
        mac_key=b"k" * 32,
    )


def capture(captured: CapturedFolder, path: str, data: bytes, at_s: float, *, ship: bool = True) -> FileVersion:
    """What the watch thread does for a complete file (the bytes are in the folder too), and then
    the ship thread once the settle time passed."""
    (captured.root / path).parent.mkdir(parents=True, exist_ok=True)
    (captured.root / path).write_bytes(data)
    made = version(path, data, at_s)
    captured.catalog.put(made, data, own=True)
    if ship:
        captured._push(made)
    return made


def by_path(described: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["path"]: entry for entry in described["files"]}


# -- the node's section -----------------------------------------------------------------------------
def test_each_file_says_whether_memory_the_peers_and_storage_hold_its_newest_version(
    tmp_path: Path, peers: Peers
) -> None:
    storage = MemoryStorage()
    # Given a node whose budget keeps files up to 1000 bytes in memory
    captured = folder(tmp_path, peers, storage=storage, budget=MemoryBudget(lambda: 1000, 0))
    capture(captured, "snapshot.pt", b"s" * 300, 1.0)  # one target up, one down
    capture(captured, "big.pt", b"b" * 2000, 2.0)  # too large for memory: shipped from the folder
    capture(captured, "late.pt", b"l" * 10, 3.0, ship=False)  # still waiting out the settle time
    capture(captured, "epoch.pt", b"1" * 20, 4.0)
    capture(captured, "epoch.pt", b"2" * 20, 5.0, ship=False)  # rewritten: shipped was the old one
    peer_file = version("shard.pt", b"p" * 50, 6.0, node="n1")
    captured.catalog.put(peer_file, b"p" * 50, own=False)  # a peer's capture, replicated here

    described = captured.describe()

    assert described["dir"] == str(tmp_path) and described["pattern"] == "*.pt"
    assert [e["path"] for e in described["files"]] == ["big.pt", "epoch.pt", "late.pt", "shard.pt", "snapshot.pt"]
    files = by_path(described)
    assert files["snapshot.pt"] == {
        "path": "snapshot.pt",
        "bytes": 300,
        "captured_at": 1_796_000_001.0,
        "own": True,
        "memory": True,
        "replicas": 1,
        "persisted": True,
    }
    assert (files["big.pt"]["memory"], files["big.pt"]["replicas"], files["big.pt"]["persisted"]) == (False, 1, True)
    assert (files["late.pt"]["replicas"], files["late.pt"]["persisted"]) == (0, False)
    assert (files["epoch.pt"]["bytes"], files["epoch.pt"]["replicas"], files["epoch.pt"]["persisted"]) == (20, 0, False)
    assert files["shard.pt"] == {**files["shard.pt"], "own": False, "memory": True, "replicas": None, "persisted": None}
    assert described["more_files"] == 0
    assert described["bytes_in_memory"] == 300 + 10 + 20 + 50
    # the storage really holds what the section says was persisted
    assert {s.version.path for s in listed(storage, None)} == {"snapshot.pt", "big.pt", "epoch.pt"}


def test_a_replica_on_a_node_that_is_no_longer_a_target_does_not_count(tmp_path: Path, peers: Peers) -> None:
    captured = folder(tmp_path, peers)
    peers.down.clear()
    capture(captured, "snapshot.pt", b"s" * 30, 1.0)
    assert by_path(captured.describe())["snapshot.pt"]["replicas"] == 2
    # When peer-b's node leaves and peer-c takes its place in the ring
    peers.targets = ["peer-a:1", "peer-c:1"]
    assert by_path(captured.describe())["snapshot.pt"]["replicas"] == 1


def test_without_a_checkpoint_uri_persisted_is_null_and_without_a_peer_channel_no_replica_counts(
    tmp_path: Path, peers: Peers
) -> None:
    captured = folder(tmp_path, peers)  # no --checkpoint-uri
    capture(captured, "snapshot.pt", b"s" * 30, 1.0)
    assert by_path(captured.describe())["snapshot.pt"]["persisted"] is None
    alone = CapturedFolder(tmp_path / "alone", Catalog(), NODE, targets=lambda: ["peer-a:1"])  # no secret
    alone.catalog.put(version("x.pt", b"x", 1.0), b"x", own=True)
    assert by_path(alone.describe())["x.pt"]["replicas"] == 0


def test_only_the_newest_files_are_listed_and_the_rest_are_counted(tmp_path: Path, peers: Peers) -> None:
    captured = folder(tmp_path, peers)
    for i in range(STATUS_FILES + 10):  # written oldest first, named so that path order is not age order
        captured.catalog.put(version(f"ckpt_{(i * 7) % 97:03d}.pt", b"c", float(i)), b"c", own=True)
    described = captured.describe()
    assert described["more_files"] == 10
    assert len(described["files"]) == STATUS_FILES
    assert min(e["captured_at"] for e in described["files"]) == (T0 + 10 * 10**9) / 1e9
    paths = [e["path"] for e in described["files"]]
    assert paths == sorted(paths)  # by path, so a --watch view does not reshuffle every refresh


# -- through the store to the screen ------------------------------------------------------------------
def publisher(captured: CapturedFolder | None) -> StatusPublisher:
    """A StatusPublisher over fakes of the agent's other parts; its thread publishes once, then idles."""
    telemetry = SimpleNamespace(
        events=SimpleNamespace(add_listener=lambda listener: None),
        counts={},
        progress={},
        uploaded={},
        persisted_step=None,
        interval=None,
    )
    control = SimpleNamespace(
        waiting_spares=lambda: [], silent_for=lambda pid: None, stalled_for=lambda pid: None, newest_step=lambda p: None
    )
    memory = SimpleNamespace(describe=lambda rank: {"committed": {}}, finished=lambda ranks: None)
    rdzv = SimpleNamespace(backend=MemoryBackend(), run_id="job", me=SimpleNamespace(node_id=NODE, addr="127.0.0.1"))
    config = SimpleNamespace(
        heartbeat_timeout_s=30.0,
        heartbeat_interval_s=1.0,
        spares=0,
        checkpoint_uri="/ckpt",
        snapshot_every=1,
        max_overhead_pct=3.0,
        replicas=1,
        replicate_every=1,
        persist_every=100,
    )
    return StatusPublisher(
        config,  # type: ignore[arg-type]
        rdzv,  # type: ignore[arg-type]
        Membership(NODE),
        control,  # type: ignore[arg-type]
        memory,  # type: ignore[arg-type]
        telemetry,  # type: ignore[arg-type]
        captured=captured,
        interval_s=3600.0,
    )


@pytest.fixture
def published(tmp_path: Path, peers: Peers) -> Iterator[tuple[StatusPublisher, dict[str, Any]]]:
    """The job's status as ``resilrun status`` composes it, one node capturing three files."""
    storage = MemoryStorage()
    captured = folder(tmp_path / "run", peers, storage=storage, budget=MemoryBudget(lambda: 1000, 0))
    capture(captured, "snapshot.pt", b"s" * 700, 1.0)
    capture(captured, "big.pt", b"b" * 3000, 2.0, ship=False)
    captured.catalog.put(version("peer/shard.pt", b"p" * 10, 3.0, node="n1"), None, own=False)
    status = publisher(captured)
    try:
        status.publish()
        yield status, compose(read_raw(status.backend, "job"))
    finally:
        status.close()


def test_the_published_document_carries_the_section_and_status_json_passes_it_through(
    published: tuple[StatusPublisher, dict[str, Any]],
) -> None:
    status, doc = published
    assert status.latest is not None
    (node,) = doc["nodes"]
    assert node["captured"] == status.latest["captured"]
    assert [e["path"] for e in node["captured"]["files"]] == ["big.pt", "peer/shard.pt", "snapshot.pt"]


def test_a_node_without_a_captured_folder_publishes_no_section() -> None:
    status = publisher(None)
    try:
        assert "captured" not in status.build()
    finally:
        status.close()


def test_the_text_view_shows_a_block_per_node_with_each_files_tiers(
    published: tuple[StatusPublisher, dict[str, Any]], tmp_path: Path
) -> None:
    _, doc = published
    doc["nodes"][0].update(node_rank=0, host="host0")
    lines = text_lines(doc)
    start = lines.index("CAPTURED CHECKPOINTS")
    block = lines[start : lines.index("HISTORY") - 1]
    assert block[1] == f"node 0 (host0): {tmp_path / 'run'} (files matching *.pt), 3 file(s), 700 B in node memory"
    assert block[2].split() == ["path", "size", "captured", "tiers"]
    rows = {line.split()[0]: line for line in block[3:]}
    assert "700 B" in rows["snapshot.pt"]
    assert rows["snapshot.pt"].rstrip().endswith("memory, 1 peer, persisted")
    assert rows["big.pt"].rstrip().endswith("folder only, 0 peers, not persisted yet")
    assert "2.9 KiB" in rows["big.pt"]
    assert rows["peer/shard.pt"].rstrip().endswith("replica of a peer's file (bytes not kept: memory ran short)")


def test_more_files_than_listed_are_said_and_a_lost_nodes_files_are_not_shown(
    published: tuple[StatusPublisher, dict[str, Any]],
) -> None:
    _, doc = published
    doc["nodes"][0]["captured"]["more_files"] = 12
    assert "  ... and 12 more (the newest 3 are listed)" in text_lines(doc)
    doc["nodes"][0]["state"] = "lost"
    assert "CAPTURED CHECKPOINTS" not in text_lines(doc)


def test_the_terminal_view_has_a_captured_checkpoints_table() -> None:
    from rich.console import Console

    doc = compose({"run_id": "job", "rdzv": None, "nodes": [], "history": [], "parts": {}})
    doc["nodes"] = [
        {
            "node_rank": 1,
            "host": "host1",
            "state": "active",
            "captured": {
                "dir": "/run",
                "pattern": "*",
                "files": [
                    {
                        "path": "snapshot.pt",
                        "bytes": 1048576,
                        "captured_at": 1_796_000_001.0,
                        "own": True,
                        "memory": True,
                        "replicas": 2,
                        "persisted": False,
                    }
                ],
                "more_files": 0,
                "bytes_in_memory": 1048576,
            },
        }
    ]
    screen = io.StringIO()
    Console(file=screen, width=200, color_system=None).print(rich_view(doc))
    text = screen.getvalue()
    assert "Captured checkpoints, node 1 (host1): /run, 1 file(s), 1.0 MiB in node memory" in text
    assert "memory, 2 peers, not persisted yet" in text and "1.0 MiB" in text
