"""Bad input: truncated, bit-flipped, forged and malicious checkpoints are refused, never executed.

Two kinds of damage are tried. *Damaged* files keep the manifest and COMPLETE.json of the good
checkpoint (storage rot, a partial copy). *Forged* files come with a manifest and COMPLETE.json made
consistent with them (an attacker controls every object), so only the structural checks stand
between them and the reader. Every case must end in CheckpointCorruptError (or NotFound): no other
exception, no code run from the file, no allocation bigger than the file.
"""

from __future__ import annotations

import json
import pickle
import struct
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from resilrun.errors import CheckpointCorruptError, CheckpointNotFoundError
from resilrun.snapshot.layout import parse_header
from resilrun.storage import MemoryStorage
from resilrun.tiers import _manifest as m
from resilrun.tiers import durable
from tests.conftest import make_snapshot

STEP = 1
TENSORS = {
    "model/w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "model/b": torch.arange(3, dtype=torch.float16),
    "flag": torch.tensor([True, False]),
}
DATA_KEY = m.data_key(STEP, 0)
MANIFEST_KEY = m.manifest_key(STEP, 0)


def committed() -> MemoryStorage:
    storage = MemoryStorage()
    durable.write_rank(storage, STEP, 0, 1, make_snapshot(TENSORS), {"epoch": 3})
    durable.commit_step(storage, STEP, 1)
    return storage


def forge(storage: MemoryStorage, data: bytes, *, manifest_changes: dict[str, Any] | None = None) -> None:
    """Store ``data`` as rank 0 with a manifest and COMPLETE.json consistent with it."""
    header_crc = 0
    tensors: dict[str, Any] = {}
    if len(data) >= 8:
        (length,) = struct.unpack("<Q", data[:8])
        if 8 + length <= len(data):
            header_crc = zlib.crc32(data[: 8 + length])
            try:
                parsed = json.loads(data[8 : 8 + length])
                start = 8 + length
                for name, info in parsed.items():
                    if name != "__metadata__":
                        b, e = info["data_offsets"]
                        tensors[name] = {**info, "crc32": zlib.crc32(data[start + b : start + e])}
            except Exception:  # noqa: BLE001 - a forger writes whatever it likes
                tensors = {}
    manifest = {
        "format": m.FORMAT,
        "step": STEP,
        "rank": 0,
        "world_size": 1,
        "file": m.data_file_name(0),
        "file_bytes": len(data),
        "header_crc32": header_crc,
        "tensors": tensors,
        "values": {},
        "created_unix": 0.0,
    }
    manifest.update(manifest_changes or {})
    raw = m.encode(manifest)
    complete = {
        "format": m.FORMAT,
        "step": STEP,
        "world_size": 1,
        "ranks": {"0": {"file_bytes": len(data), "manifest_crc32": zlib.crc32(raw)}},
    }
    storage.put(DATA_KEY, data)
    storage.put(MANIFEST_KEY, raw)
    storage.put(m.complete_key(STEP), m.encode(complete))


def assert_refused(storage: MemoryStorage, match: str | None = None) -> None:
    with pytest.raises(CheckpointCorruptError, match=match):
        durable.read_rank(storage, STEP, 0, verify=True)
    with pytest.raises(CheckpointCorruptError, match=match):
        durable.read_layout(storage, STEP, 0)


def _boundaries() -> list[int]:
    snapshot = make_snapshot(TENSORS)
    layout = parse_header(snapshot, len(snapshot))
    start = layout.data_start
    cuts = {0, 4, 8, 8 + (start - 8) // 2, start - 1, start, len(snapshot) - 1}
    for entry in layout.entries:
        cuts |= {start + entry.begin + 1, start + entry.end - 1, start + entry.end}
    return sorted(c for c in cuts if c < len(snapshot))


# -- truncation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cut", _boundaries())
def test_a_file_truncated_at_any_section_boundary_is_refused(cut: int) -> None:
    storage = committed()
    storage.put(DATA_KEY, storage.get(DATA_KEY)[:cut])
    assert_refused(storage, "truncated")


@pytest.mark.parametrize("cut", _boundaries())
def test_a_forged_truncated_file_with_consistent_manifests_is_refused(cut: int) -> None:
    storage = committed()
    good = durable.read_rank(storage, STEP, 0)[2]
    forge(storage, make_snapshot(TENSORS)[:cut], manifest_changes={"tensors": good["tensors"]})
    assert_refused(storage)


# -- bit flips -------------------------------------------------------------------------------------
def test_every_bit_flip_in_the_header_is_detected_without_verify() -> None:
    storage = committed()
    data = storage.get(DATA_KEY)
    data_start = durable.read_layout(storage, STEP, 0)[0].data_start
    for index in range(data_start):
        flipped = bytearray(data)
        flipped[index] ^= 1 << (index % 8)
        storage.put(DATA_KEY, bytes(flipped))
        with pytest.raises(CheckpointCorruptError):
            durable.read_rank(storage, STEP, 0, verify=False)
        with pytest.raises(CheckpointCorruptError):
            durable.read_layout(storage, STEP, 0)


def test_every_bit_flip_in_tensor_data_fails_verify_and_names_the_tensor() -> None:
    storage = committed()
    data = storage.get(DATA_KEY)
    layout = durable.read_layout(storage, STEP, 0)[0]
    for entry in layout.entries:
        for offset in range(entry.begin, entry.end):
            flipped = bytearray(data)
            flipped[layout.data_start + offset] ^= 0x10
            storage.put(DATA_KEY, bytes(flipped))
            with pytest.raises(CheckpointCorruptError, match=f"tensor '{entry.name}' fails its crc32"):
                durable.read_rank(storage, STEP, 0, verify=True)
    durable.read_rank(storage, STEP, 0, verify=False)  # without verify only the header is checked


# -- forged structure ------------------------------------------------------------------------------
def _raw_file(header: dict[str, Any], data: bytes, *, length: int | None = None) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def test_overlapping_tensors_are_refused() -> None:
    storage = committed()
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    forge(storage, _raw_file(header, bytes(12)))
    assert_refused(storage, "overlap")


def test_offsets_past_the_end_of_the_file_are_refused() -> None:
    storage = committed()
    forge(storage, _raw_file({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)))
    assert_refused(storage, "outside the data")


def test_a_shape_that_disagrees_with_its_offsets_is_refused() -> None:
    storage = committed()
    forge(storage, _raw_file({"a": {"dtype": "F32", "shape": [10**18], "data_offsets": [0, 8]}}, bytes(8)))
    assert_refused(storage, "does not match")


@pytest.mark.parametrize("length", [2**63, 2**64 - 1, 90 * 1024 * 1024, 17])
def test_an_absurd_header_length_is_refused_without_a_large_allocation(length: int) -> None:
    storage = committed()
    forge(storage, _raw_file({}, bytes(8), length=length))
    tracemalloc.start()
    try:
        assert_refused(storage)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 4 * 1024 * 1024


def test_a_header_that_is_not_a_json_object_is_refused() -> None:
    storage = committed()
    for text in (b"[1,2,3]", b"\xff\xfe\x00\x00", b"[" * 50_000 + b"]" * 50_000, b'{"a": {"dtype": []}}'):
        forge(storage, struct.pack("<Q", len(text)) + text)
        assert_refused(storage)


@pytest.mark.parametrize("name", ["../../etc/passwd", "rank_00000.safetensors/../x", "/tmp/rank_00000.safetensors"])
def test_a_manifest_naming_another_file_is_refused(name: str) -> None:
    storage = committed()
    forge(storage, make_snapshot(TENSORS), manifest_changes={"file": name})
    assert_refused(storage, "names file")


def test_a_manifest_with_an_unsafe_tensor_name_is_refused() -> None:
    storage = committed()
    forge(storage, make_snapshot({"../../evil": torch.zeros(2)}))
    assert_refused(storage, "unsafe tensor name")


def test_complete_json_with_path_like_rank_keys_is_refused() -> None:
    storage = committed()
    raw = storage.get(MANIFEST_KEY)
    ranks = {"../0": {"file_bytes": 1, "manifest_crc32": zlib.crc32(raw)}}
    forged = {"format": m.FORMAT, "step": STEP, "world_size": 1, "ranks": ranks}
    storage.put(m.complete_key(STEP), m.encode(forged))
    assert_refused(storage, "no valid entry for rank 0")


class _Payload:
    """Unpickling this opens (creates) ``path``: proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_a_pickle_disguised_as_safetensors_is_refused_and_never_runs(tmp_path: Path) -> None:
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps(_Payload(proof))).close()  # the payload is live: loading it runs code
    assert proof.exists()
    marker = tmp_path / "marker"
    storage = committed()
    for payload in (pickle.dumps(_Payload(marker)), pickle.dumps({"w": _Payload(marker)}, protocol=0)):
        forge(storage, payload)
        assert_refused(storage)
    assert not marker.exists()


def test_a_torch_save_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(3)}, path)
    storage = committed()
    forge(storage, path.read_bytes())
    assert_refused(storage)


# -- missing and mismatched objects ----------------------------------------------------------------
def test_a_committed_manifest_naming_a_missing_file_is_refused() -> None:
    storage = committed()
    storage.delete(DATA_KEY)
    assert_refused(storage, "missing")


def test_a_committed_step_with_a_missing_manifest_is_refused() -> None:
    storage = committed()
    storage.delete(MANIFEST_KEY)
    assert_refused(storage, "does not exist")


def test_a_manifest_edited_after_commit_no_longer_matches_complete_json() -> None:
    storage = committed()
    manifest = durable.read_rank(storage, STEP, 0)[2]
    manifest["values"] = {"epoch": 999}
    storage.put(MANIFEST_KEY, m.encode(manifest))
    assert_refused(storage, "COMPLETE.json")


def test_a_file_swapped_for_a_same_sized_one_fails_the_checks() -> None:
    storage = committed()
    other = make_snapshot({name: (~t if t.dtype == torch.bool else t + 1) for name, t in TENSORS.items()})
    assert len(other) == len(storage.get(DATA_KEY))
    storage.put(DATA_KEY, other)
    with pytest.raises(CheckpointCorruptError, match="fails its crc32"):
        durable.read_rank(storage, STEP, 0, verify=True)


def test_an_oversized_manifest_is_refused_before_it_is_downloaded() -> None:
    class Huge(MemoryStorage):
        def size(self, key: str) -> int:
            return 10**12 if key == MANIFEST_KEY else super().size(key)

        def get(self, key: str) -> bytes:
            assert key != MANIFEST_KEY, "downloaded an oversized manifest"
            return super().get(key)

    storage = Huge()
    durable.write_rank(storage, STEP, 0, 1, make_snapshot(TENSORS), {})
    storage.put(m.complete_key(STEP), committed().get(m.complete_key(STEP)))
    assert_refused(storage, "more than")


def test_a_step_that_was_never_written_is_not_found() -> None:
    with pytest.raises(CheckpointNotFoundError):
        durable.read_rank(committed(), 99, 0)
