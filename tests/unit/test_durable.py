"""Tier 3 on storage: write ranks, commit, list, read back, retain (memory and directory storage)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from resilrun.errors import CheckpointCorruptError, CheckpointNotFoundError, StorageError
from resilrun.storage import LocalStorage, MemoryStorage, Storage
from resilrun.tiers import durable
from resilrun.tiers.durable import StepInfo
from tests.conftest import make_snapshot


def rank_tensors(rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return {
        "model/fc.weight": torch.randn(4, 3, generator=generator),
        "model/fc.bias": torch.randn(4, generator=generator).to(torch.bfloat16),
        "optim/state/0/step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


def write_step(storage: Storage, step: int, world_size: int, ranks: list[int] | None = None) -> None:
    for rank in range(world_size) if ranks is None else ranks:
        snapshot = make_snapshot(rank_tensors(rank))
        durable.write_rank(storage, step, rank, world_size, snapshot, {"step": step, "r": rank})


@pytest.fixture(params=["memory", "local"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    yield MemoryStorage() if request.param == "memory" else LocalStorage(tmp_path / "ckpt")


def test_two_ranks_round_trip_through_write_commit_and_read(storage: Storage) -> None:
    write_step(storage, 10, 2)
    complete = durable.commit_step(storage, 10, 2)
    assert complete["world_size"] == 2 and set(complete["ranks"]) == {"0", "1"}
    for rank in range(2):
        layout, data, manifest = durable.read_rank(storage, 10, rank, verify=True)
        assert data == make_snapshot(rank_tensors(rank))
        assert manifest["values"] == {"step": 10, "r": rank}
        assert manifest["file"] == f"rank_{rank:05d}.safetensors"
        assert {e.name for e in layout.entries} == set(rank_tensors(rank))


def test_the_safetensors_library_loads_our_files(storage: Storage) -> None:
    from safetensors.torch import load

    write_step(storage, 3, 2)
    durable.commit_step(storage, 3, 2)
    for rank in range(2):
        loaded = load(storage.get(f"step_000000000003/rank_{rank:05d}.safetensors"))
        expected = rank_tensors(rank)
        assert loaded.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), name


def test_a_file_written_by_the_safetensors_library_is_accepted(storage: Storage) -> None:
    from safetensors.torch import save

    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.int16)}
    durable.write_rank(storage, 1, 0, 1, save(tensors), None)
    durable.commit_step(storage, 1, 1)
    _, data, manifest = durable.read_rank(storage, 1, 0)
    assert data == save(tensors)
    assert manifest["values"] is None


def test_manifest_has_the_documented_fields(storage: Storage) -> None:
    manifest = durable.write_rank(storage, 5, 1, 2, make_snapshot(rank_tensors(1)), [1, 2.5, "x"])
    on_storage = json.loads(storage.get("step_000000000005/rank_00001.json"))
    assert on_storage == manifest
    assert {"format", "step", "rank", "world_size", "file", "file_bytes", "tensors", "values", "created_unix"} <= set(
        manifest
    )
    assert manifest["format"] == "resilrun-snapshot-1"
    entry = manifest["tensors"]["model/fc.weight"]
    assert set(entry) == {"dtype", "shape", "data_offsets", "crc32"}
    assert entry["dtype"] == "F32" and entry["shape"] == [4, 3]


def test_a_partial_step_is_listed_but_never_complete(storage: Storage) -> None:
    write_step(storage, 4, 3, ranks=[0, 2])
    assert durable.list_steps(storage) == [StepInfo(4, False, (0, 2))]
    assert durable.latest_complete_step(storage) is None
    with pytest.raises(CheckpointNotFoundError, match="rank_00001.json"):
        durable.commit_step(storage, 4, 3)
    assert not storage.exists("step_000000000004/COMPLETE.json")
    with pytest.raises(CheckpointNotFoundError):
        durable.read_rank(storage, 4, 0)


def test_commit_refuses_a_manifest_whose_data_file_is_missing(storage: Storage) -> None:
    write_step(storage, 4, 2)
    storage.delete("step_000000000004/rank_00001.safetensors")
    with pytest.raises(CheckpointNotFoundError, match="rank_00001.safetensors"):
        durable.commit_step(storage, 4, 2)


def test_latest_complete_step_skips_newer_partial_steps(storage: Storage) -> None:
    for step in (1, 2):
        write_step(storage, step, 2)
        durable.commit_step(storage, step, 2)
    write_step(storage, 3, 2, ranks=[1])
    assert durable.latest_complete_step(storage) == 2
    assert [(s.step, s.complete) for s in durable.list_steps(storage)] == [(1, True), (2, True), (3, False)]


def test_reading_a_rank_outside_the_world_is_not_found(storage: Storage) -> None:
    write_step(storage, 1, 2)
    durable.commit_step(storage, 1, 2)
    with pytest.raises(CheckpointNotFoundError, match="not rank 2"):
        durable.read_rank(storage, 1, 2)


def test_read_layout_reads_only_the_header_and_matches_read_rank(storage: Storage) -> None:
    write_step(storage, 1, 1)
    durable.commit_step(storage, 1, 1)
    layout, manifest = durable.read_layout(storage, 1, 0)
    full_layout, _, full_manifest = durable.read_rank(storage, 1, 0)
    assert layout == full_layout and manifest == full_manifest


def test_write_rank_writes_only_the_snapshot_not_the_slack_of_a_larger_slot(storage: Storage) -> None:
    snapshot = make_snapshot(rank_tensors(0))
    slot = bytearray(snapshot) + bytearray(b"\xee" * 1000)
    manifest = durable.write_rank(storage, 1, 0, 1, memoryview(slot), {})
    assert manifest["file_bytes"] == len(snapshot)
    assert storage.get("step_000000000001/rank_00000.safetensors") == snapshot


def test_write_rank_refuses_values_that_are_not_json_and_writes_nothing(storage: Storage) -> None:
    with pytest.raises(TypeError, match="JSON"):
        durable.write_rank(storage, 1, 0, 1, make_snapshot(rank_tensors(0)), {"bad": object()})
    assert storage.list() == []


def test_write_rank_keeps_nan_and_infinite_values(storage: Storage) -> None:
    manifest = durable.write_rank(storage, 1, 0, 1, make_snapshot(rank_tensors(0)), {"loss": float("nan")})
    durable.commit_step(storage, 1, 1)
    assert manifest["values"]["loss"] != manifest["values"]["loss"]
    _, _, read = durable.read_rank(storage, 1, 0)
    assert read["values"]["loss"] != read["values"]["loss"]


@pytest.mark.parametrize("name", ["../escape", "/abs", "a/./b", "back\\slash", "nul\x00"])
def test_write_rank_refuses_unsafe_tensor_names(storage: Storage, name: str) -> None:
    with pytest.raises(CheckpointCorruptError, match="not allowed"):
        durable.write_rank(storage, 1, 0, 1, make_snapshot({name: torch.zeros(2)}), {})
    assert storage.list() == []


@pytest.mark.parametrize(("step", "rank", "world_size"), [(-1, 0, 1), (0, 1, 1), (0, -1, 2), (0, 0, 0), (True, 0, 1)])
def test_write_rank_refuses_impossible_ids(storage: Storage, step: Any, rank: int, world_size: int) -> None:
    with pytest.raises(ValueError):
        durable.write_rank(storage, step, rank, world_size, make_snapshot(rank_tensors(0)), {})


def test_write_rank_refuses_a_buffer_that_is_not_a_snapshot(storage: Storage) -> None:
    with pytest.raises(CheckpointCorruptError):
        durable.write_rank(storage, 1, 0, 1, b"\x00" * 4, {})
    assert storage.list() == []


# -- retention -------------------------------------------------------------------------------------
class RecordingStorage(MemoryStorage):
    """Remembers the order of deletes, to check COMPLETE.json always goes first."""

    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[str] = []

    def delete(self, key: str) -> None:
        self.deleted.append(key)
        super().delete(key)


def test_retain_keeps_the_newest_complete_steps_and_deletes_complete_json_first() -> None:
    storage = RecordingStorage()
    for step in (1, 2, 3, 4, 5):
        write_step(storage, step, 2)
        durable.commit_step(storage, step, 2)
    write_step(storage, 6, 2, ranks=[0])  # still uploading
    assert durable.retain(storage, keep_last=2) == [1, 2, 3]
    assert [(s.step, s.complete) for s in durable.list_steps(storage)] == [(4, True), (5, True), (6, False)]
    for step in (1, 2, 3):
        keys = [k for k in storage.deleted if k.startswith(f"step_{step:012d}/")]
        assert keys[0].endswith("COMPLETE.json")
        assert all(k.endswith(".json") for k in keys[:3])  # COMPLETE, then both manifests, then data


def test_retain_deletes_whole_step_directories_on_disk(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    for step in (1, 2):
        write_step(storage, step, 1)
        durable.commit_step(storage, step, 1)
    durable.retain(storage, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000000002"]


def test_retain_with_few_complete_steps_deletes_only_abandoned_older_partials(storage: Storage) -> None:
    write_step(storage, 1, 2, ranks=[0])  # abandoned
    write_step(storage, 2, 1)
    durable.commit_step(storage, 2, 1)
    write_step(storage, 3, 1)  # uploading
    assert durable.retain(storage, keep_last=3) == [1]
    assert durable.retain(storage, keep_last=1) == []
    assert [s.step for s in durable.list_steps(storage)] == [2, 3]


def test_storage_errors_pass_through_unchanged() -> None:
    class Broken(MemoryStorage):
        def list(self, prefix: str = "") -> list[str]:
            raise StorageError("the bucket is on fire")

    with pytest.raises(StorageError, match="on fire"):
        durable.latest_complete_step(Broken())


def test_the_fast_crc32_is_zlibs_crc32() -> None:
    # Stored checksums must verify with plain zlib (other tools, older versions) and vice versa.
    import os
    import zlib

    from resilrun.snapshot.crc import crc32

    data = os.urandom(1 << 20)
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[1000:], crc32(data[:1000])) == zlib.crc32(data)
    assert crc32(memoryview(data)[5:77]) == zlib.crc32(data[5:77])
    assert crc32(b"") == 0
