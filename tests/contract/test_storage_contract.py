"""The Storage contract: every implementation passes this suite unchanged.

Parametrised over the in-memory storage, a directory, and S3 through a real moto server on loopback
(HTTP, not an in-process mock). What one implementation alone does is tested beside it:
tests/socket/test_storage_local.py (atomic writes, temporary files, permissions),
tests/socket/test_storage_s3.py (retries, bounded failure, multipart, bucket owner, credentials)
and tests/unit/test_storage_s3_policy.py (the retry policy, backoff and part plan alone).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilrun.errors import ExitCode, StorageError, StorageNotFoundError
from resilrun.storage import LocalStorage, MemoryStorage, Storage
from tests.conftest import STORAGE_DATA as DATA
from tests.conftest import S3Server


@pytest.fixture(params=["memory", "local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "memory":
        yield MemoryStorage()
    elif request.param == "local":
        yield LocalStorage(tmp_path / "root")
    else:
        from resilrun.storage.s3 import S3Storage

        server: S3Server = request.getfixturevalue("s3_server")
        bucket: str = request.getfixturevalue("s3_bucket")
        yield S3Storage(bucket, "some/prefix", endpoint_url=server.endpoint_url)


# -- put / get -------------------------------------------------------------------------------------
def test_put_then_get_returns_the_same_bytes(storage: Storage) -> None:
    storage.put("a/b/c.bin", DATA)
    assert storage.get("a/b/c.bin") == DATA


def test_put_accepts_a_memoryview_and_stores_a_copy(storage: Storage) -> None:
    buffer = bytearray(DATA)
    storage.put("view.bin", memoryview(buffer)[10:20])
    buffer[10:20] = b"\xff" * 10  # the caller reuses its buffer
    assert storage.get("view.bin") == DATA[10:20]


def test_put_overwrites_the_previous_object(storage: Storage) -> None:
    storage.put("k", b"first, longer value")
    storage.put("k", b"second")
    assert storage.get("k") == b"second"


def test_an_empty_object_round_trips(storage: Storage) -> None:
    storage.put("empty", b"")
    assert storage.get("empty") == b""
    assert storage.size("empty") == 0
    assert storage.exists("empty")


def test_get_of_a_missing_key_raises_storage_not_found(storage: Storage) -> None:
    with pytest.raises(StorageNotFoundError) as info:
        storage.get("never/written")
    assert isinstance(info.value, StorageError)
    assert info.value.exit_code == ExitCode.STORAGE


def test_size_is_the_object_length(storage: Storage) -> None:
    storage.put("sized", DATA)
    assert storage.size("sized") == len(DATA)
    with pytest.raises(StorageNotFoundError):
        storage.size("missing")


# -- get_range -------------------------------------------------------------------------------------
def test_get_range_returns_the_half_open_range(storage: Storage) -> None:
    storage.put("r", DATA)
    assert storage.get_range("r", 0, 8) == DATA[:8]
    assert storage.get_range("r", 100, 300) == DATA[100:300]


def test_get_range_past_the_end_is_short_and_never_fails(storage: Storage) -> None:
    storage.put("r", DATA)
    assert storage.get_range("r", len(DATA) - 4, len(DATA) + 2**40) == DATA[-4:]
    assert storage.get_range("r", len(DATA), len(DATA) + 10) == b""
    assert storage.get_range("r", len(DATA) + 10, len(DATA) + 20) == b""
    assert storage.get_range("r", 5, 5) == b""


def test_get_range_of_a_missing_key_raises_storage_not_found(storage: Storage) -> None:
    with pytest.raises(StorageNotFoundError):
        storage.get_range("missing", 0, 8)
    with pytest.raises(StorageNotFoundError):
        storage.get_range("missing", 0, 0)


def test_get_range_rejects_a_reversed_or_negative_range(storage: Storage) -> None:
    storage.put("r", DATA)
    with pytest.raises(ValueError):
        storage.get_range("r", 10, 5)
    with pytest.raises(ValueError):
        storage.get_range("r", -1, 5)


def test_get_ranges_returns_each_range_as_get_range_would(storage: Storage) -> None:
    storage.put("r", DATA)
    ranges = [(0, 8), (100, 300), (len(DATA) - 4, len(DATA) + 10), (5, 5), (len(DATA) + 1, len(DATA) + 2)]
    assert storage.get_ranges("r", ranges) == [storage.get_range("r", s, e) for s, e in ranges]
    assert storage.get_ranges("r", []) == []
    with pytest.raises(StorageNotFoundError):
        storage.get_ranges("missing", [(0, 8), (8, 16)])


# -- list / exists / delete ------------------------------------------------------------------------
def test_list_returns_sorted_keys_relative_to_the_root(storage: Storage) -> None:
    for key in ("step_2/b", "step_1/a", "step_1/sub/c", "other"):
        storage.put(key, b"x")
    assert storage.list() == ["other", "step_1/a", "step_1/sub/c", "step_2/b"]
    assert storage.list("step_") == ["step_1/a", "step_1/sub/c", "step_2/b"]
    assert storage.list("step_1/") == ["step_1/a", "step_1/sub/c"]
    assert storage.list("step_1/s") == ["step_1/sub/c"]
    assert storage.list("nothing/") == []


def test_list_of_an_empty_storage_is_empty(storage: Storage) -> None:
    assert storage.list() == []
    assert storage.list("step_") == []


def test_exists_is_true_only_for_stored_keys(storage: Storage) -> None:
    storage.put("here", b"x")
    assert storage.exists("here")
    assert not storage.exists("not/here")


def test_delete_removes_the_object_and_is_idempotent(storage: Storage) -> None:
    storage.put("d/one", b"1")
    storage.put("d/two", b"2")
    storage.delete("d/one")
    storage.delete("d/one")
    storage.delete("never/existed")
    assert not storage.exists("d/one")
    assert storage.list() == ["d/two"]


# -- keys ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "./a", "a/.", "a\\b", "a\x00b", "trailing/"])
def test_unsafe_keys_are_refused_before_any_io(storage: Storage, key: str) -> None:
    for call in (
        lambda: storage.put(key, b"x"),
        lambda: storage.get(key),
        lambda: storage.get_range(key, 0, 1),
        lambda: storage.size(key),
        lambda: storage.exists(key),
        lambda: storage.delete(key),
    ):
        with pytest.raises(StorageError):
            call()
    assert storage.list() == []


def test_list_refuses_a_prefix_that_climbs_out_of_the_root(storage: Storage) -> None:
    with pytest.raises(StorageError):
        storage.list("../")


# -- threads ---------------------------------------------------------------------------------------
def test_concurrent_puts_from_threads_are_all_stored(storage: Storage) -> None:
    def writer(index: int) -> None:
        for j in range(5):
            storage.put(f"t/{index}/{j}", f"{index}-{j}".encode())

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(storage.list("t/")) == 40
    assert storage.get("t/7/4") == b"7-4"
