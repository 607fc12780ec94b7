"""Pure rules of the durable format: key names, retention choice, manifest and COMPLETE.json checks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from resilrun.errors import CheckpointCorruptError
from resilrun.tiers import _manifest as m
from resilrun.tiers.durable import StepInfo, steps_to_delete, summarize_keys


@pytest.mark.parametrize(
    ("key", "parsed"),
    [
        ("step_000000000010/rank_00003.safetensors", (10, "data", 3)),
        ("step_000000000010/rank_00003.json", (10, "manifest", 3)),
        ("step_000000000010/COMPLETE.json", (10, "complete", None)),
        ("step_1000000000000/rank_123456.json", (10**12, "manifest", 123456)),
        ("step_0000000000010/COMPLETE.json", None),  # 13 digits: not the canonical spelling of step 10
        ("step_000000000010/rank_0003.json", None),
        ("step_000000000010/rank_00003.json.tmp", None),
        ("step_000000000010/sub/rank_00003.json", None),
        ("step_00000000001a/COMPLETE.json", None),
        ("other/COMPLETE.json", None),
    ],
)
def test_parse_key_accepts_only_canonical_checkpoint_keys(key: str, parsed: Any) -> None:
    assert m.parse_key(key) == parsed


def test_key_builders_match_the_documented_layout() -> None:
    assert m.data_key(7, 2) == "step_000000000007/rank_00002.safetensors"
    assert m.manifest_key(7, 2) == "step_000000000007/rank_00002.json"
    assert m.complete_key(7) == "step_000000000007/COMPLETE.json"


def test_summarize_keys_groups_by_step_and_ignores_strangers() -> None:
    keys = [
        "step_000000000002/rank_00000.safetensors",
        "step_000000000002/rank_00000.json",
        "step_000000000002/rank_00001.json",
        "step_000000000002/COMPLETE.json",
        "step_000000000003/rank_00001.safetensors",
        "step_000000000001/../../etc/passwd",
        "README",
    ]
    assert summarize_keys(keys) == [StepInfo(2, True, (0, 1)), StepInfo(3, False, ())]


@pytest.mark.parametrize(
    ("steps", "keep_last", "deleted"),
    [
        ([(1, True), (2, True), (3, True)], 2, [1]),
        ([(1, True), (2, False), (3, True), (4, True)], 2, [1, 2]),
        ([(1, False), (2, True), (3, False)], 1, [1]),
        ([(1, True), (2, True)], 2, []),
        ([(5, False), (6, False)], 1, []),
        ([], 1, []),
    ],
)
def test_steps_to_delete_keeps_the_newest_complete_and_everything_after(
    steps: list[tuple[int, bool]], keep_last: int, deleted: list[int]
) -> None:
    assert steps_to_delete([StepInfo(s, c, ()) for s, c in steps], keep_last) == deleted


def test_steps_to_delete_refuses_to_keep_nothing() -> None:
    with pytest.raises(ValueError):
        steps_to_delete([], 0)


@pytest.mark.parametrize(
    ("name", "safe"),
    [
        ("model/fc.weight", True),
        ("optim/state/0/exp_avg", True),
        ("a..b", True),
        ("", False),
        ("/abs", False),
        ("..", False),
        ("a/../b", False),
        ("a/./b", False),
        ("back\\slash", False),
        ("new\nline", False),
        ("x" * 5000, False),
    ],
)
def test_is_safe_tensor_name(name: str, safe: bool) -> None:
    assert m.is_safe_tensor_name(name) is safe


def _manifest(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": m.FORMAT,
        "step": 3,
        "rank": 1,
        "world_size": 2,
        "file": "rank_00001.safetensors",
        "file_bytes": 100,
        "header_crc32": 5,
        "tensors": {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "crc32": 7}},
        "values": None,
        "created_unix": 1.0,
    }
    doc.update(changes)
    return doc


def test_a_valid_manifest_parses() -> None:
    assert m.parse_manifest(m.encode(_manifest()), 3, 1, 2, "where")["file_bytes"] == 100


@pytest.mark.parametrize(
    "changes",
    [
        {"format": "resilrun-snapshot-0"},
        {"step": 4},
        {"step": "3"},
        {"rank": 0},
        {"rank": True},
        {"world_size": 3},
        {"world_size": 1},
        {"file": "../../etc/passwd"},
        {"file": "rank_00001.safetensors/../x"},
        {"file": "/tmp/rank_00001.safetensors"},
        {"file": "rank_00000.safetensors"},
        {"file_bytes": -1},
        {"file_bytes": 1.5},
        {"header_crc32": 1 << 32},
        {"tensors": []},
        {"tensors": {"../w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "crc32": 7}}},
        {"tensors": {"w": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8], "crc32": 7}}},
        {"tensors": {"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8], "crc32": 7}}},
        {"tensors": {"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8], "crc32": 7}}},
        {"tensors": {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0], "crc32": 7}}},
        {"tensors": {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0], "crc32": 7}}},
        {"tensors": {"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "crc32": -1}}},
        {"tensors": {"w": "not an object"}},
    ],
)
def test_invalid_manifests_are_corrupt(changes: dict[str, Any]) -> None:
    with pytest.raises(CheckpointCorruptError, match="where"):
        m.parse_manifest(m.encode(_manifest(**changes)), 3, 1, 2, "where")


def test_a_manifest_without_values_is_corrupt() -> None:
    doc = _manifest()
    del doc["values"]
    with pytest.raises(CheckpointCorruptError, match="values"):
        m.parse_manifest(m.encode(doc), 3, 1, 2, "where")


@pytest.mark.parametrize(
    "raw",
    [b"", b"not json", b"[1, 2]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"a": 1' + b"0" * 10_000 + b"}"],
)
def test_undecodable_documents_are_corrupt_not_crashes(raw: bytes) -> None:
    with pytest.raises(CheckpointCorruptError):
        m.parse_manifest(raw, 3, 1, 2, "where")
    with pytest.raises(CheckpointCorruptError):
        m.parse_complete(raw, 3, "where")


def _complete(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": m.FORMAT,
        "step": 3,
        "world_size": 2,
        "ranks": {"0": {"file_bytes": 10, "manifest_crc32": 1}, "1": {"file_bytes": 10, "manifest_crc32": 2}},
    }
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    "changes",
    [
        {"format": None},
        {"step": 2},
        {"world_size": 0},
        {"world_size": 10**12},  # with two entries: refused without building a range of 10**12
        {"world_size": 3},
        {"ranks": {"0": {"file_bytes": 10, "manifest_crc32": 1}, "../1": {"file_bytes": 10, "manifest_crc32": 2}}},
        {"ranks": {"0": {"file_bytes": 10, "manifest_crc32": 1}, "1": {"file_bytes": 10}}},
        {"ranks": {"0": {"file_bytes": 10, "manifest_crc32": 1}, "1": {"file_bytes": "10", "manifest_crc32": 2}}},
        {"ranks": [1, 2]},
    ],
)
def test_invalid_complete_documents_are_corrupt(changes: dict[str, Any]) -> None:
    with pytest.raises(CheckpointCorruptError, match="where"):
        m.parse_complete(m.encode(_complete(**changes)), 3, "where")


def test_encode_is_canonical_so_manifest_checksums_are_stable() -> None:
    assert m.encode({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'
    assert json.loads(m.encode(_manifest())) == _manifest()
