"""Issue 43's findings on the persistent tier, each shown by an attack that worked before the fix:

- F1: ``require_mac`` without a key (``--require-auth`` with no secret from outside) restored an
  unsigned step; now no step is restored that was not checked.
- F7: ``read_rank`` downloaded the data file before checking the MACs that vouch for it; now a
  planted (huge) file is refused before a byte of it is read.
- F11: a non-ASCII MAC, hash or tag in a stored document raised TypeError (exit 1, "internal
  error"); now it is a CheckpointCorruptError (exit 4).
- F13: the durable key is bound to the checkpoint URI (a step copied from another job's bucket is
  not authentic), and the restore path reports a rollback (newer COMPLETE markers deleted).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import zlib
from typing import Any

import pytest
import torch

from resilrun.agent.state.tiers import NodeTiers
from resilrun.errors import CheckpointCorruptError, ExitCode
from resilrun.snapshot.selection import Selection
from resilrun.storage import MemoryStorage
from resilrun.tiers import _manifest as m
from resilrun.tiers import durable
from resilrun.tiers.authentic import complete_mac, durable_key
from resilrun.tiers.memory import NodeMemoryTier
from tests.conftest import make_snapshot

STEP = 5
URI = "memory://job-a"
KEY = durable_key(b"s" * 32, URI)
HUGE = 1 << 40  # a 1 TB (sparse) file: downloading it would take the node down


class PlantedStorage(MemoryStorage):
    """Storage in which every data file a reader asks the size of may claim ``sizes[key]`` bytes
    (a sparse file), and which counts the bytes of data files downloaded."""

    def __init__(self, name: str = "job-a") -> None:
        super().__init__(name)
        self.sizes: dict[str, int] = {}
        self.data_bytes = 0

    def size(self, key: str) -> int:
        return self.sizes.get(key) or super().size(key)

    def _count(self, key: str, found: bytes) -> bytes:
        self.data_bytes += self.sizes.get(key, len(found)) if key.endswith(".safetensors") else 0
        return found

    def get(self, key: str) -> bytes:
        return self._count(key, super().get(key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._count(key, super().get_range(key, start, end))


def written(world: int = 2, key: bytes | None = KEY, step: int = STEP, storage: Any = None) -> PlantedStorage:
    storage = storage if storage is not None else PlantedStorage()
    for rank in range(world):
        tensors = {"model/w": torch.full((64,), float(rank)), "step": torch.tensor([step])}
        durable.write_rank(storage, step, rank, world, make_snapshot(tensors), {"rank": rank}, mac_key=key)
    durable.commit_step(storage, step, world, mac_key=key)
    storage.data_bytes = 0
    return storage


def plant_huge(storage: PlantedStorage, rank: int = 1) -> None:
    """What anyone who can write the bucket can do without the secret: a rank's file replaced by a
    1 TB one, its manifest and COMPLETE.json's entry made to agree (every crc32 recomputed)."""
    manifest = json.loads(storage.get(m.manifest_key(STEP, rank)))
    manifest["file_bytes"] = HUGE
    raw = m.encode(manifest)
    complete = json.loads(storage.get(m.complete_key(STEP)))
    complete["ranks"][str(rank)].update(file_bytes=HUGE, manifest_crc32=zlib.crc32(raw))
    storage.put(m.manifest_key(STEP, rank), raw)
    storage.put(m.complete_key(STEP), m.encode(complete))
    storage.sizes[m.data_key(STEP, rank)] = HUGE


def into(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


# -- F1: --require-auth never restores a step it could not check -----------------------------------
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_require_mac_without_a_key_refuses_every_step(signed: bool) -> None:
    storage = written(key=KEY if signed else None)
    with pytest.raises(CheckpointCorruptError, match="no job secret") as caught:
        durable.read_rank(storage, STEP, 0, require_mac=True)
    assert caught.value.exit_code == ExitCode.CHECKPOINT
    with pytest.raises(CheckpointCorruptError, match="no job secret"):
        durable.read_rank_ranges(storage, STEP, 0, Selection(), into, require_mac=True)
    assert storage.data_bytes == 0  # refused before any download
    durable.read_rank(storage, STEP, 0)  # (without --require-auth it is read, as before)


def test_node_tiers_under_require_auth_without_a_key_refuse_an_unsigned_step() -> None:
    storage = written(key=None)
    memory = NodeMemoryTier("durable-security-f1")
    try:
        tiers = NodeTiers(memory, storage, mac_key=None, require_mac=True)
        with pytest.raises(CheckpointCorruptError, match="no job secret"):
            tiers.fetch(0, STEP, "persistent")
        with pytest.raises(CheckpointCorruptError, match="no job secret"):
            tiers.peek(0, STEP, 2)
    finally:
        memory.close()


# -- F7: MACs before the download ------------------------------------------------------------------
def test_a_planted_huge_file_is_refused_before_it_is_downloaded() -> None:
    storage = written()
    plant_huge(storage)
    with pytest.raises(CheckpointCorruptError, match="not authentic"):
        durable.read_rank(storage, STEP, 1, mac_key=KEY)
    assert storage.data_bytes == 0


def test_a_huge_file_in_a_stripped_step_is_refused_before_it_is_downloaded_under_require_mac() -> None:
    storage = written()
    plant_huge(storage)
    complete = json.loads(storage.get(m.complete_key(STEP)))
    del complete["mac"]  # the forger strips the MACs
    storage.put(m.complete_key(STEP), m.encode(complete))
    with pytest.raises(CheckpointCorruptError, match="carries no MAC"):
        durable.read_rank(storage, STEP, 1, mac_key=KEY, require_mac=True)
    assert storage.data_bytes == 0


def test_an_authentic_step_still_reads_whole_and_checked() -> None:
    storage = written()
    _, data, manifest = durable.read_rank(storage, STEP, 1, mac_key=KEY, require_mac=True)
    assert manifest["authentic"] is True and storage.data_bytes == len(data)


# -- F11: malformed MAC fields are corrupt, not internal errors ------------------------------------
def _complete_mac(doc: dict[str, Any]) -> None:
    doc["mac"] = "\u00e9" * 64


def _manifest_hash(doc: dict[str, Any]) -> None:
    doc["ranks"]["0"]["manifest_sha256"] = "\u00e9" * 64
    doc["mac"] = complete_mac(KEY, doc)  # (as if by a holder of the key: only the field is bad)


@pytest.mark.parametrize("change", [_complete_mac, _manifest_hash], ids=["complete-mac", "manifest-sha256"])
def test_a_non_ascii_mac_in_complete_json_is_corrupt_not_an_internal_error(change: Any) -> None:
    storage = written()
    complete = json.loads(storage.get(m.complete_key(STEP)))
    change(complete)
    storage.put(m.complete_key(STEP), m.encode(complete))
    for read in (
        lambda: durable.read_rank(storage, STEP, 0, mac_key=KEY),
        lambda: durable.read_rank_ranges(storage, STEP, 0, Selection(), into, mac_key=KEY),
    ):
        with pytest.raises(CheckpointCorruptError, match="not authentic"):
            read()


def _file_gmac(mac: dict[str, Any]) -> None:
    mac["gmac"] = "\u00e9" * 32


def _chunk_tag(mac: dict[str, Any]) -> None:
    mac["chunks"] = ["\u00e9" * 32 for _ in mac["chunks"]]


def _salt(mac: dict[str, Any]) -> None:
    mac["salt"] = "\u00e9" * 32


@pytest.mark.parametrize(
    ("change", "whole", "ranged"),
    [(_file_gmac, True, False), (_chunk_tag, False, True), (_salt, True, True)],
    ids=["gmac", "chunk-tags", "salt"],
)
def test_a_non_ascii_tag_in_a_signed_manifest_is_corrupt_not_an_internal_error(
    change: Any, whole: bool, ranged: bool
) -> None:
    """A manifest re-signed by someone with the key cannot happen; what is checked here is that the
    fields a MAC check reads are validated before use, whatever vouched for them."""
    storage = written()
    manifest = json.loads(storage.get(m.manifest_key(STEP, 0)))
    change(manifest["mac"])
    raw = m.encode(manifest)
    complete = json.loads(storage.get(m.complete_key(STEP)))
    complete["ranks"]["0"].update(manifest_crc32=zlib.crc32(raw), manifest_sha256=hashlib.sha256(raw).hexdigest())
    complete["mac"] = complete_mac(KEY, complete)  # (as if by a holder of the key: only the fields are bad)
    storage.put(m.manifest_key(STEP, 0), raw)
    storage.put(m.complete_key(STEP), m.encode(complete))
    if whole:  # (a whole read checks the file's GMAC, a ranged read the chunks' tags)
        with pytest.raises(CheckpointCorruptError, match="not authentic|no valid chunk"):
            durable.read_rank(storage, STEP, 0, mac_key=KEY)
    if ranged:
        with pytest.raises(CheckpointCorruptError, match="not authentic|no valid chunk"):
            durable.read_rank_ranges(storage, STEP, 0, Selection({"model/w": (0, 1)}), into, mac_key=KEY)


# -- F13: the key is bound to the URI; a rollback is reported --------------------------------------
def test_the_durable_key_is_bound_to_the_normalized_checkpoint_uri() -> None:
    secret = b"s" * 32
    assert durable_key(secret, "s3://bucket/job-a") != durable_key(secret, "s3://bucket/job-b")
    assert durable_key(secret, "s3://bucket/job-a/") == durable_key(secret, "s3://bucket/job-a")
    assert durable_key(secret, "/data/ckpt/") == durable_key(secret, "/data/ckpt")
    assert durable_key(secret, "file:///data/ckpt") == durable_key(secret, "/data/ckpt")
    assert durable_key(secret, "/data/./ckpt") == durable_key(secret, "/data/ckpt")


def test_a_step_copied_from_another_jobs_bucket_under_the_same_secret_is_not_authentic() -> None:
    source = written(storage=PlantedStorage("job-b"), key=durable_key(b"s" * 32, "memory://job-b"))
    target = PlantedStorage("job-a")
    for key in source.list("step_"):
        target.put(key, source.get(key))
    with pytest.raises(CheckpointCorruptError, match="not authentic"):
        durable.read_rank(target, STEP, 0, mac_key=KEY, require_mac=True)
    durable.read_rank(source, STEP, 0, mac_key=durable_key(b"s" * 32, source.uri), require_mac=True)


def test_deleting_the_newest_complete_markers_is_reported_as_a_rollback(caplog: pytest.LogCaptureFixture) -> None:
    storage = written(world=1, step=3, key=None)
    written(world=1, step=7, key=None, storage=storage)
    memory = NodeMemoryTier("durable-security-f13")
    found: list[tuple[int | None, int]] = []
    try:
        tiers = NodeTiers(memory, storage, on_rollback=lambda now, before: found.append((now, before)))
        assert tiers.restore_info(0, 1).persisted == 7
        assert found == []
        storage.delete(m.complete_key(7))  # someone rolls the bucket back to step 3
        with caplog.at_level(logging.WARNING, logger="resilrun.agent.state.tiers"):
            assert tiers.restore_info(0, 1).persisted == 3
            tiers.restore_info(0, 1)  # (said once)
        assert found == [(3, 7)]
        assert sum("rolled back" in r.getMessage() for r in caplog.records) == 1
    finally:
        memory.close()


def test_a_step_this_job_persisted_but_storage_no_longer_has_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    storage = written(world=1, step=3, key=None)
    memory = NodeMemoryTier("durable-security-f13b")
    found: list[tuple[int | None, int]] = []
    try:
        tiers = NodeTiers(
            memory, storage, persisted_before=lambda: 9, on_rollback=lambda now, before: found.append((now, before))
        )
        with caplog.at_level(logging.WARNING, logger="resilrun.agent.state.tiers"):
            tiers.restore_info(0, 1)
        assert found == [(3, 9)]
        assert any("step 9" in r.getMessage() and "rolled back" in r.getMessage() for r in caplog.records)
    finally:
        memory.close()
