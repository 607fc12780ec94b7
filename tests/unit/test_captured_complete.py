"""A file a writer stopped part way through is told from a whole one by its bytes (issue 45): the
kernel reports the close of a killed writer's file like any other, so the format is the proof."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from resilrun.tiers.captured.complete import describe_format, incomplete_reason, is_verifiable


def _torch_save_bytes(**kwargs: object) -> bytes:
    buffer = io.BytesIO()
    torch.save({"weight": torch.randn(64, 8), "bias": torch.zeros(8), "step": 4}, buffer, **kwargs)
    return buffer.getvalue()


def _safetensors_bytes() -> bytes:
    tensors = {"weight": torch.randn(16, 4), "bias": torch.zeros(4)}
    try:
        from safetensors.torch import save
    except ImportError:  # the format by hand: u64 header length, JSON header, then the data
        header: dict[str, object] = {}
        data = b""
        for name, tensor in tensors.items():
            raw = tensor.numpy().tobytes()
            header[name] = {
                "dtype": "F32",
                "shape": list(tensor.shape),
                "data_offsets": [len(data), len(data) + len(raw)],
            }
            data += raw
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data
    return save(tensors)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_a_whole_torch_save_file_is_complete(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"weight": torch.randn(64, 8)}, path)
    data = path.read_bytes()
    assert incomplete_reason("model.pt", data) is None
    assert describe_format(data) == "torch.save (zip)"
    assert is_verifiable("model.pt", data)


def test_no_prefix_of_a_torch_save_file_is_judged_complete() -> None:
    # Wherever a killed writer stopped, the end-of-central-directory record (written last) is missing
    data = _torch_save_bytes()
    judged_complete = [n for n in range(1, len(data)) if incomplete_reason("model.pt", data[:n]) is None]
    assert judged_complete == [1, 2]  # "P" and "PK" could as well be the start of a text file
    assert "end-of-central-directory record: truncated" in incomplete_reason("model.pt", data[: len(data) // 2])
    assert incomplete_reason("model.pt", data[: len(data) // 2]).startswith("a zip archive (torch.save)")


def test_a_memoryview_is_judged_without_copying_the_file() -> None:
    data = bytearray(_torch_save_bytes())
    assert incomplete_reason("model.pt", memoryview(data)) is None
    assert incomplete_reason("model.pt", memoryview(data)[:-1]) is not None


def test_a_zip_whose_member_reaches_past_its_end_is_truncated() -> None:
    # The end record alone is not enough: every member's bytes must lie within the data. Here the
    # central directory says a member is far longer than what is there.
    data = bytearray(_torch_save_bytes())
    entry = data.index(b"PK\x01\x02")  # the first central directory entry
    struct.pack_into("<I", data, entry + 20, len(data))  # its compressed size
    reason = incomplete_reason("model.pt", bytes(data))
    assert (
        reason == "a zip archive (torch.save) whose member 'archive/data.pkl' ends past the end of the data: truncated"
    )


def test_numpy_savez_is_a_zip_and_judged_as_one() -> None:
    buffer = io.BytesIO()
    np.savez(buffer, a=np.arange(100.0))
    data = buffer.getvalue()
    assert incomplete_reason("arrays.npz", data) is None
    assert describe_format(data) == "zip"
    assert (
        incomplete_reason("arrays.npz", data[:-10])
        == "a zip archive without its end-of-central-directory record: truncated"
    )


def test_the_legacy_torch_save_format_is_unknown_not_judged() -> None:
    data = _torch_save_bytes(_use_new_zipfile_serialization=False)
    assert incomplete_reason("model.pt", data) is None
    assert incomplete_reason("model.pt", data[:-100]) is None  # nothing in a pickle stream says its length
    assert describe_format(data) == "bytes"
    assert not is_verifiable("model.pt", data[:-100])


def test_a_whole_safetensors_file_is_complete_and_every_prefix_is_not() -> None:
    data = _safetensors_bytes()
    assert incomplete_reason("model.safetensors", data) is None
    assert incomplete_reason("model.bin", data) is None  # recognised by its bytes too
    assert describe_format(data) == "safetensors"
    assert is_verifiable("model.bin", data)
    prefixes = [n for n in range(1, len(data)) if incomplete_reason("model.safetensors", data[:n]) is None]
    assert prefixes == []
    reason = incomplete_reason("model.safetensors", data[:-5])
    assert reason == f"a safetensors file of {len(data) - 5} bytes whose header describes {len(data)}: truncated"
    # without the name, a file cut inside its first 9 bytes cannot be recognised; past them it can
    assert incomplete_reason("model.bin", data[:-5]) == reason


def test_a_safetensors_file_with_bytes_past_its_data_is_not_as_written() -> None:
    data = _safetensors_bytes()
    assert incomplete_reason("model.safetensors", data + b"\0") is not None
    assert "trailing bytes" in incomplete_reason("model.safetensors", data + b"\0")


def test_a_file_named_safetensors_whose_header_is_not_json_is_damaged() -> None:
    header = b"{not json}"
    data = struct.pack("<Q", len(header)) + header
    assert "does not parse" in incomplete_reason("model.safetensors", data)
    assert incomplete_reason("notes.bin", data) is None  # not named so: some other format


def test_numpy_save_whole_and_cut_short() -> None:
    data = _npy_bytes(np.arange(1000, dtype=np.float32).reshape(10, 100))
    assert incomplete_reason("a.npy", data) is None
    assert describe_format(data) == "numpy"
    assert is_verifiable("a.npy", data)
    assert (
        incomplete_reason("a.npy", data[:-1])
        == f"a numpy .npy file of {len(data) - 1} bytes whose header describes {len(data)}: truncated"
    )
    assert "header is cut short" in incomplete_reason("a.npy", data[:40])
    assert [n for n in range(1, len(data), 7) if incomplete_reason("a.npy", data[:n]) is None] == []


def test_numpy_of_python_objects_cannot_be_sized_and_is_unknown() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    data = buffer.getvalue()
    assert incomplete_reason("objects.npy", data[:-3]) is None
    assert not is_verifiable("objects.npy", data)


@pytest.mark.parametrize("data", [b"", b"step=4\nloss=0.25\n", b"PK", "caf\u00e9 ol\u00e9".encode()])
def test_empty_files_and_plain_text_pass_as_unknown(data: bytes) -> None:
    assert incomplete_reason("notes.txt", data) is None
    assert describe_format(data) == "bytes"
    assert not is_verifiable("notes.txt", data)


def test_dcp_data_files_are_not_judged_by_their_first_zip(tmp_path: Path) -> None:
    """A .distcp file is torch.save zips and raw bytes end to end: its completeness is the .metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"weight": torch.randn(32), "blob": io.BytesIO(b"opaque")}, storage_writer=FileSystemWriter(tmp_path))
    data = (tmp_path / "__0_0.distcp").read_bytes()
    assert incomplete_reason("step_4/__0_0.distcp", data) is None
    assert incomplete_reason("step_4/__0_0.distcp", data[: len(data) // 2]) is None
    assert not is_verifiable("step_4/__0_0.distcp", data)
