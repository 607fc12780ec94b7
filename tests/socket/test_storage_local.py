"""What only the directory storage does: writes that leave no temporary files, empty folders
removed, and the file system's own refusals turned into StorageError.

What every storage does is the contract (tests/contract/test_storage_contract.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilrun.errors import StorageAuthError, StorageError
from resilrun.storage import LocalStorage
from tests.conftest import STORAGE_DATA as DATA


def test_local_put_leaves_no_temporary_files(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    storage.put("step/x.bin", DATA)
    storage.put("step/x.bin", DATA[:10])
    assert sorted(p.name for p in (tmp_path / "step").iterdir()) == ["x.bin"]


def test_local_list_ignores_temporary_files_of_an_interrupted_put(tmp_path: Path) -> None:
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / ".resilrun-tmp-abc").write_bytes(b"torn")
    (tmp_path / "step" / "whole").write_bytes(b"whole")
    assert LocalStorage(tmp_path).list() == ["step/whole"]


def test_local_delete_removes_directories_it_empties_but_never_the_root(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    storage.put("a/b/c", b"x")
    storage.delete("a/b/c")
    assert (tmp_path / "root").is_dir()
    assert list((tmp_path / "root").iterdir()) == []


def test_local_refuses_to_read_a_device_behind_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "step").mkdir()
    os.symlink("/dev/zero", tmp_path / "step" / "zero")
    storage = LocalStorage(tmp_path)
    with pytest.raises(StorageError, match="not a regular file"):
        storage.get("step/zero")
    with pytest.raises(StorageError, match="not a regular file"):
        storage.get_range("step/zero", 0, 2**40)


def test_local_put_under_a_file_is_a_storage_error_not_an_oserror(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_bytes(b"a file, not a directory")
    with pytest.raises(StorageError) as info:
        LocalStorage(tmp_path).put("blocker/key", b"x")
    assert "blocker/key" in info.value.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_local_permission_denied_is_a_storage_auth_error(tmp_path: Path) -> None:
    root = tmp_path / "locked"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(StorageAuthError):
            LocalStorage(root).put("k", b"x")
    finally:
        root.chmod(0o700)
