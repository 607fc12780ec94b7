"""Ranged reads of the persistent tier (``durable.read_rank_ranges``): a rank resuming at another
world size reads only the rows it needs, each chunk checked against its manifest's crc32 (and GMAC
with the job secret), and steps written before chunks were recorded are still read, whole."""

from __future__ import annotations

import json
import mmap
import zlib

import pytest
import torch

from resilrun.errors import CheckpointCorruptError
from resilrun.snapshot.layout import parse_header
from resilrun.snapshot.selection import Selection, check_ranges, merge
from resilrun.storage import MemoryStorage
from resilrun.tiers import _manifest as m
from resilrun.tiers import durable
from resilrun.tiers.authentic import durable_key
from tests.conftest import make_snapshot
from tests.helpers.forgery import forged_keeping_crc32

STEP = 4
KEY = durable_key(b"r" * 32, "memory://default")
ROWS, COLS = 1024, 1024  # 4 MiB of float32: four chunks


class CountingStorage(MemoryStorage):
    """Counts the data bytes a reader downloads (get and get_range of .safetensors objects)."""

    def __init__(self) -> None:
        super().__init__()
        self.data_bytes = 0

    def get(self, key: str) -> bytes:
        found = super().get(key)
        self.data_bytes += len(found) if key.endswith(".safetensors") else 0
        return found

    def get_range(self, key: str, start: int, end: int) -> bytes:
        found = super().get_range(key, start, end)
        self.data_bytes += len(found) if key.endswith(".safetensors") else 0
        return found


def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "model/w": torch.randn(ROWS, COLS, generator=generator),
        "model/b": torch.randn(ROWS, generator=generator),
        "step": torch.tensor([STEP]),
    }


def written(key: bytes | None = None) -> tuple[CountingStorage, bytes]:
    storage = CountingStorage()
    data = make_snapshot(tensors())
    durable.write_rank(storage, STEP, 0, 1, data, {"v": 1}, mac_key=key)
    durable.commit_step(storage, STEP, 1, mac_key=key)
    storage.data_bytes = 0
    return storage, data


def sparse(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, max(size, 1)))[:size]


def read(storage: MemoryStorage, select: Selection, **kwargs: object) -> tuple[memoryview, dict, int]:
    made: list[memoryview] = []

    def into(size: int) -> memoryview:
        made.append(sparse(size))
        return made[-1]

    _, manifest, nbytes = durable.read_rank_ranges(storage, STEP, 0, select, into, **kwargs)  # type: ignore[arg-type]
    return made[-1], manifest, nbytes


def view_of(buffer: memoryview, name: str) -> torch.Tensor:
    layout = parse_header(buffer, len(buffer))
    entry = next(e for e in layout.entries if e.name == name)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)[layout.data_start + entry.begin : layout.data_start + entry.end]
    return raw.view(torch.float32).view(entry.shape)


def test_rows_of_a_tensor_are_read_without_the_rest_of_the_file() -> None:
    storage, data = written()

    buffer, manifest, nbytes = read(storage, Selection({"model/w": (300, 500)}))

    assert torch.equal(view_of(buffer, "model/w")[300:500], tensors()["model/w"][300:500])
    assert manifest["values"] == {"v": 1}
    # 200 rows of 4 KiB, and at most one chunk's worth more at each end, plus the header
    header = parse_header(data, len(data)).data_start
    assert storage.data_bytes == nbytes <= 200 * COLS * 4 + 2 * m.CHUNK_BYTES + header < len(data) // 2


def test_the_rest_whole_and_some_rows_of_one_tensor() -> None:
    storage, _ = written()

    buffer, _, _ = read(storage, Selection({"model/w": (0, 10)}, rest=True))

    assert torch.equal(view_of(buffer, "model/b"), tensors()["model/b"])
    assert torch.equal(view_of(buffer, "model/w")[:10], tensors()["model/w"][:10])


def test_a_corrupt_chunk_outside_the_selection_is_not_read_and_one_inside_is_named() -> None:
    storage, data = written()
    layout = parse_header(data, len(data))
    entry = next(e for e in layout.entries if e.name == "model/w")
    at = layout.data_start + entry.begin + 900 * COLS * 4  # row 900
    index = next(i for i, (b, e) in enumerate(m.layout_chunks(layout)) if b <= at < e)
    broken = bytearray(data)
    broken[at] ^= 0xFF
    storage.put(m.data_key(STEP, 0), bytes(broken))

    read(storage, Selection({"model/w": (0, 100)}))  # rows 0-99 are fine
    with pytest.raises(CheckpointCorruptError, match=rf"chunk {index} .*crc32"):
        read(storage, Selection({"model/w": (850, 950)}))


def test_a_chunk_forged_with_its_crc32_kept_is_refused_by_its_gmac() -> None:
    storage, data = written(KEY)
    layout = parse_header(data, len(data))
    entry = next(e for e in layout.entries if e.name == "model/w")
    begin, end = m.layout_chunks(layout)[5]  # a chunk of model/w's rows
    forged = bytearray(data)
    forged[begin:end] = forged_keeping_crc32(data[begin:end], 100, 200)
    storage.put(m.data_key(STEP, 0), bytes(forged))
    row = (begin + 100 - layout.data_start - entry.begin) // (COLS * 4)
    wanted = Selection({"model/w": (row, row + 1)})  # the forged row

    with pytest.raises(CheckpointCorruptError, match="chunk 5 is not authentic"):
        read(storage, wanted, mac_key=KEY)
    _, manifest, _ = read(storage, Selection({"model/w": (0, 10)}), mac_key=KEY)
    assert manifest["authentic"] is True


def test_a_step_written_before_chunk_checksums_is_read_whole() -> None:
    storage, data = written()
    raw = json.loads(storage.get(m.manifest_key(STEP, 0)))
    del raw["chunks"]
    encoded = m.encode(raw)
    complete = json.loads(storage.get(m.complete_key(STEP)))
    complete["ranks"]["0"]["manifest_crc32"] = zlib.crc32(encoded)
    storage.put(m.manifest_key(STEP, 0), encoded)
    storage.put(m.complete_key(STEP), m.encode(complete))

    buffer, _, nbytes = read(storage, Selection({"model/w": (0, 10)}))

    assert nbytes == len(data) and bytes(buffer) == data


@pytest.mark.parametrize(
    ("chunks", "problem"),
    [
        ({"bytes": 1000, "per_tensor": 64, "crc32": [0]}, "chunk size"),
        ({"bytes": 1 << 20, "per_tensor": 0, "crc32": [0]}, "chunks-per-tensor"),
        ({"bytes": 1 << 20, "per_tensor": 4, "crc32": []}, "one valid crc32 per chunk"),
        ({"bytes": 1 << 20, "per_tensor": 4, "crc32": ["x"] * 7}, "one valid crc32 per chunk"),
        ({"bytes": 1 << 20, "per_tensor": 4, "crc32": [0] * 6}, "one valid crc32 per chunk"),
        ("1MiB", "invalid chunk list"),
    ],
)
def test_a_malformed_chunk_list_is_refused(chunks: object, problem: str) -> None:
    storage, _ = written()
    raw = json.loads(storage.get(m.manifest_key(STEP, 0)))
    raw["chunks"] = chunks
    with pytest.raises(CheckpointCorruptError, match=problem):
        m.parse_manifest(m.encode(raw), STEP, 0, 1, where="rank_00000.json")


def test_chunks_follow_the_tensors_so_a_range_never_reads_a_neighbours_bytes() -> None:
    data = make_snapshot(tensors())
    layout = parse_header(data, len(data))
    chunks = m.layout_chunks(layout)
    assert chunks[0] == (0, layout.data_start)
    assert [c for c in chunks if c[0] < c[1]] == chunks and sorted(chunks) == chunks
    assert chunks[-1][1] == len(data) and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    for entry in layout.entries:  # every tensor starts a chunk
        assert any(b == layout.data_start + entry.begin for b, _ in chunks)
    # the header, "step" (8 bytes), model/w (4 MiB) in 64 chunks, model/b (4 KiB) in one
    assert len(chunks) == 1 + 1 + m.CHUNKS_PER_TENSOR + 1
    assert m.tensor_chunk(4 << 20, 1 << 16, 64) == 1 << 16 and m.tensor_chunk(1 << 30, 1 << 16, 64) == 1 << 24
    assert m.tensor_chunk(5 << 20, 1 << 16, 64) == 1 << 17  # 80 KiB wanted: a power of two above it


def test_selection_ranges_are_merged_clipped_and_start_with_the_header() -> None:
    data = make_snapshot(tensors())
    layout = parse_header(data, len(data))
    w = next(e for e in layout.entries if e.name == "model/w")

    ranges = Selection({"model/w": (ROWS - 2, ROWS + 50)}).ranges(layout)

    assert ranges == [(0, layout.data_start), (layout.data_start + w.end - 2 * COLS * 4, layout.data_start + w.end)]
    assert Selection(rest=True).ranges(layout) == [(0, len(data))]  # everything, merged into one
    assert Selection().ranges(layout) == [(0, layout.data_start)]
    assert merge([(5, 9), (0, 3), (3, 4), (8, 12), (20, 20)]) == [(0, 4), (5, 12)]


@pytest.mark.parametrize(
    "message",
    [
        None,
        {"rows": {}},
        {"rows": [], "rest": True},
        {"rows": {"w": [3, 1]}, "rest": False},
        {"rows": {"w": [0, True]}, "rest": False},
    ],
)
def test_a_malformed_selection_is_refused(message: object) -> None:
    with pytest.raises(ValueError, match="selection"):
        Selection.from_message(message)


def test_byte_ranges_from_a_message_must_be_sorted_disjoint_and_inside() -> None:
    assert check_ranges([[0, 8], [16, 32]], 32) == [(0, 8), (16, 32)]
    for bad in ([[0, 8], [4, 12]], [[0, 40]], [[3, 3]], "x", [[0, 1, 2]]):
        with pytest.raises(ValueError):
            check_ranges(bad, 32)
