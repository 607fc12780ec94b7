"""The persistent tier's MACs (tiers/authentic.py): a bucket changed by someone who recomputes
every crc32 is told apart from the real checkpoint by a reader with the job secret, and a step
stripped of its MACs is refused where authenticity is required."""

from __future__ import annotations

import json
import zlib

import pytest
import torch

from resilrun.errors import CheckpointCorruptError
from resilrun.snapshot.layout import parse_header
from resilrun.storage import MemoryStorage
from resilrun.tiers import _manifest as m
from resilrun.tiers import durable
from resilrun.tiers.authentic import durable_key
from tests.conftest import make_snapshot
from tests.helpers.forgery import forged_keeping_crc32

STEP = 3
KEY = durable_key(b"s" * 32, "memory://default")


def written(world: int = 2, key: bytes | None = KEY) -> MemoryStorage:
    storage = MemoryStorage()
    for rank in range(world):
        tensors = {"model/w": torch.full((64,), float(rank)), "step": torch.tensor([STEP])}
        durable.write_rank(storage, STEP, rank, world, make_snapshot(tensors), {"rank": rank}, mac_key=key)
    durable.commit_step(storage, STEP, world, mac_key=key)
    return storage


def forge_rank(storage: MemoryStorage, rank: int) -> None:
    """Change a weight of ``rank`` and recompute every crc32 that covers it (tensor, manifest): what
    anyone who can write the bucket can do without the secret."""
    data = bytearray(storage.get(m.data_key(STEP, rank)))
    layout = parse_header(memoryview(data), len(data))
    entry = next(e for e in layout.entries if e.name == "model/w")
    start = layout.data_start + entry.begin
    data[start : start + 4] = torch.tensor([1234.5]).numpy().tobytes()
    manifest = json.loads(storage.get(m.manifest_key(STEP, rank)))
    manifest["tensors"]["model/w"]["crc32"] = zlib.crc32(data[start : layout.data_start + entry.end])
    raw = m.encode(manifest)
    complete = json.loads(storage.get(m.complete_key(STEP)))
    complete["ranks"][str(rank)]["manifest_crc32"] = zlib.crc32(raw)
    storage.put(m.data_key(STEP, rank), bytes(data))
    storage.put(m.manifest_key(STEP, rank), raw)
    storage.put(m.complete_key(STEP), m.encode(complete))


def test_a_step_written_with_the_key_reads_back_authentic() -> None:
    storage = written()
    for rank in (0, 1):
        _, _, manifest = durable.read_rank(storage, STEP, rank, mac_key=KEY, require_mac=True)
        assert manifest["authentic"] is True


def test_a_forgery_with_every_crc32_recomputed_passes_the_checksums_but_not_the_macs() -> None:
    storage = written()
    forge_rank(storage, 1)
    _, data, _ = durable.read_rank(storage, STEP, 1)  # crc32 alone cannot tell
    assert torch.tensor([1234.5]).numpy().tobytes() in data
    for rank in (1, 0):  # COMPLETE.json had to change with the manifest: the whole step is refused
        with pytest.raises(CheckpointCorruptError, match="COMPLETE.json is not authentic"):
            durable.read_rank(storage, STEP, rank, mac_key=KEY)


def test_a_file_forged_with_its_crc32s_kept_is_refused_by_its_gmac() -> None:
    storage = written()
    data = storage.get(m.data_key(STEP, 1))
    layout = parse_header(memoryview(data), len(data))
    entry = next(e for e in layout.entries if e.name == "model/w")
    start = layout.data_start + entry.begin
    storage.put(m.data_key(STEP, 1), forged_keeping_crc32(data, start, start + 4))  # manifest, COMPLETE untouched
    durable.read_rank(storage, STEP, 1)  # every crc32 still matches
    with pytest.raises(CheckpointCorruptError, match="rank 1's file is not authentic"):
        durable.read_rank(storage, STEP, 1, mac_key=KEY)
    durable.read_rank(storage, STEP, 0, mac_key=KEY, require_mac=True)  # the rank left alone verifies


def test_a_forged_complete_json_and_another_secret_are_not_authentic() -> None:
    storage = written()
    complete = json.loads(storage.get(m.complete_key(STEP)))
    complete["ranks"]["0"]["manifest_crc32"] ^= 1
    storage.put(m.complete_key(STEP), m.encode(complete))
    with pytest.raises(CheckpointCorruptError, match="COMPLETE.json is not authentic"):
        durable.read_rank(written(), STEP, 0, mac_key=durable_key(b"t" * 32, "memory://default"))
    storage = written()
    manifest = json.loads(storage.get(m.manifest_key(STEP, 0)))
    manifest["values"] = {"rank": 7}  # the manifest's own fields (values travel in it)
    raw = m.encode(manifest)
    complete = json.loads(storage.get(m.complete_key(STEP)))
    complete["ranks"]["0"]["manifest_crc32"] = zlib.crc32(raw)
    storage.put(m.manifest_key(STEP, 0), raw)
    storage.put(m.complete_key(STEP), m.encode(complete))
    with pytest.raises(CheckpointCorruptError, match="not authentic"):
        durable.read_rank(storage, STEP, 0, mac_key=KEY)


def test_a_step_without_macs_is_read_unauthenticated_and_refused_when_required() -> None:
    storage = written(key=None)
    _, _, manifest = durable.read_rank(storage, STEP, 0, mac_key=KEY)
    assert manifest["authentic"] is False
    with pytest.raises(CheckpointCorruptError, match="carries no MAC"):
        durable.read_rank(storage, STEP, 0, mac_key=KEY, require_mac=True)
    stripped = written()
    complete = json.loads(stripped.get(m.complete_key(STEP)))
    del complete["mac"]  # a forger strips the MAC
    stripped.put(m.complete_key(STEP), m.encode(complete))
    with pytest.raises(CheckpointCorruptError, match="carries no MAC"):
        durable.read_rank(stripped, STEP, 0, mac_key=KEY, require_mac=True)
