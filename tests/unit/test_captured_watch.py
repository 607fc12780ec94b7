"""The capture folder's watch reports what an unmodified script writes, the way scripts write it
(issue 45): torch.save, an atomic rename, a DCP checkpoint folder, a removal; never the agent's own
temporary names, never symlinks, and nothing lost to a new folder's race or a queue overflow."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from resilrun.errors import ResilrunError
from resilrun.tiers.captured.complete import incomplete_reason
from resilrun.tiers.captured.watch import (
    IGNORED_PREFIX,
    IN_CLOSE_WRITE,
    IN_Q_OVERFLOW,
    Change,
    ChangeKind,
    FolderWatch,
    parse_events,
    scan,
)

WRITTEN = ChangeKind.WRITTEN
REMOVED = ChangeKind.REMOVED
MARKER = "marker-"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The capture folder (tmp_path itself holds what lies outside it)."""
    folder = tmp_path / "capture"
    folder.mkdir()
    return folder


@pytest.fixture
def watch(root: Path) -> Iterator[FolderWatch]:
    with FolderWatch(root) as folder_watch:
        yield folder_watch


def read_until(
    watch: FolderWatch, done: Callable[[list[Change]], bool], timeout_s: float = 5.0, what: str = "the changes"
) -> list[Change]:
    """Every change read until ``done(changes)`` holds: reads block on the descriptor, never sleep."""
    changes: list[Change] = []
    deadline = time.monotonic() + timeout_s
    while not done(changes):
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"{what} not reported within {timeout_s} s; got {changes}")
        changes += watch.read(min(left, 0.5))
    return changes


def has(path: str, kind: ChangeKind = WRITTEN) -> Callable[[list[Change]], bool]:
    return lambda changes: Change(path, kind) in changes


_markers = itertools.count()


def settle(watch: FolderWatch) -> list[Change]:
    """Everything reported up to a marker file written last (markers left out): the kernel reports in
    order, so what was not reported by then never will be."""
    marker = f"{MARKER}{next(_markers)}"
    (watch.root / marker).write_bytes(b"")
    found = read_until(watch, has(marker), what=marker)
    return [change for change in found if not change.path.startswith(MARKER)]


def files(root: Path) -> list[str]:
    """scan(), markers left out."""
    return [path for path in scan(root) if not path.startswith(MARKER)]


def test_torch_save_into_the_folder_is_one_written_change(root: Path, watch: FolderWatch) -> None:
    torch.save({"weight": torch.randn(8, 8), "bias": torch.zeros(8)}, root / "model.pt")
    assert settle(watch) == [Change("model.pt", WRITTEN)]


def test_an_atomic_rename_reports_the_final_name(root: Path, watch: FolderWatch) -> None:
    with open(root / "model.pt.tmp", "wb") as file:
        torch.save({"weight": torch.randn(4)}, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(root / "model.pt.tmp", root / "model.pt")
    changes = settle(watch)
    # the temporary name comes and goes as the kernel reports it; the final name is written once
    assert [change for change in changes if change.path == "model.pt"] == [Change("model.pt", WRITTEN)]
    assert changes[-1] == Change("model.pt", WRITTEN)


def test_a_dcp_checkpoint_folder_is_reported_file_by_file(root: Path, watch: FolderWatch) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    # Given a folder two levels down that FileSystemWriter makes and fills at once, before the watch
    # can be added to it (the race a listing of every new folder closes)
    state = {"weight": torch.randn(16), "bias": torch.zeros(4)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=FileSystemWriter(root / "ckpt" / "step_4"))
    changes = settle(watch)
    assert {change.path for change in changes if change.kind is WRITTEN} == {
        "ckpt/step_4/__0_0.distcp",
        "ckpt/step_4/.metadata",
    }
    assert files(root) == ["ckpt/step_4/.metadata", "ckpt/step_4/__0_0.distcp"]


def test_a_dcp_save_into_a_watched_folder_reports_metadata_after_its_data(root: Path, watch: FolderWatch) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    (root / "step_8").mkdir()
    assert settle(watch) == []  # an empty folder is nothing to capture
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"weight": torch.randn(16)}, storage_writer=FileSystemWriter(root / "step_8"))
    changes = settle(watch)
    # .metadata is written under a temporary name and renamed into place last: DCP's commit point
    assert changes == [
        Change("step_8/__0_0.distcp", WRITTEN),
        Change("step_8/.metadata.tmp", WRITTEN),
        Change("step_8/.metadata.tmp", REMOVED),
        Change("step_8/.metadata", WRITTEN),
    ]


def test_a_removed_file_is_reported_removed(root: Path) -> None:
    (root / "old.pt").write_bytes(b"written before the watch")
    with FolderWatch(root) as watch:
        os.remove(root / "old.pt")
        assert settle(watch) == [Change("old.pt", REMOVED)]


def test_a_folder_renamed_in_place_moves_its_files(root: Path, watch: FolderWatch) -> None:
    # transformers' Trainer writes tmp-checkpoint-N, then renames it to checkpoint-N
    (root / "tmp-checkpoint-4").mkdir()
    (root / "tmp-checkpoint-4" / "model.safetensors").write_bytes(b"weights")
    settle(watch)
    os.rename(root / "tmp-checkpoint-4", root / "checkpoint-4")
    (root / "checkpoint-4" / "trainer_state.json").write_text("{}")
    changes = settle(watch)
    assert changes[0] == Change("tmp-checkpoint-4/model.safetensors", REMOVED)
    assert Change("checkpoint-4/model.safetensors", WRITTEN) in changes
    assert Change("checkpoint-4/trainer_state.json", WRITTEN) in changes
    # the folder is still watched, under its new name
    os.remove(root / "checkpoint-4" / "model.safetensors")
    assert settle(watch) == [Change("checkpoint-4/model.safetensors", REMOVED)]


def test_a_deleted_folder_reports_its_files_removed_and_drops_its_watch(root: Path, watch: FolderWatch) -> None:
    (root / "step_1" / "deep").mkdir(parents=True)
    (root / "step_1" / "deep" / "a.pt").write_bytes(b"a")
    settle(watch)
    shutil.rmtree(root / "step_1")
    assert settle(watch) == [Change("step_1/deep/a.pt", REMOVED)]
    assert set(watch._folders.values()) == {""}


def test_a_hard_link_to_a_written_file_is_reported_as_it_appears(
    tmp_path: Path, root: Path, watch: FolderWatch
) -> None:
    # a link has no close of its own: what a script linking its checkpoint into place relies on
    (tmp_path / "staged.pt").write_bytes(b"complete")
    os.link(tmp_path / "staged.pt", root / "model.pt")
    assert settle(watch) == [Change("model.pt", WRITTEN)]


def test_the_agents_own_temporary_names_are_never_reported(root: Path, watch: FolderWatch) -> None:
    (root / f"{IGNORED_PREFIX}restore-1").write_bytes(b"put back by the agent")
    (root / f"{IGNORED_PREFIX}staging" / "inner").mkdir(parents=True)
    (root / f"{IGNORED_PREFIX}staging" / "inner" / "a.pt").write_bytes(b"a")
    os.remove(root / f"{IGNORED_PREFIX}restore-1")
    (root / f"{IGNORED_PREFIX}restore-2").write_bytes(b"renamed into place")
    os.replace(root / f"{IGNORED_PREFIX}restore-2", root / "model.pt")
    assert settle(watch) == [Change("model.pt", WRITTEN)]
    assert files(root) == ["model.pt"]


def test_symlinks_are_neither_followed_nor_reported(tmp_path: Path, root: Path, watch: FolderWatch) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.pt").write_bytes(b"not ours")
    (root / "linked-folder").symlink_to(outside)
    (root / "linked-file.pt").symlink_to(outside / "secret.pt")
    os.rename(root / "linked-file.pt", root / "renamed-link.pt")
    (outside / "later.pt").write_bytes(b"written where nothing is watched")
    os.remove(root / "renamed-link.pt")
    assert settle(watch) == []
    assert files(root) == []


def test_odd_bytes_in_a_name_survive_as_surrogates(root: Path, watch: FolderWatch) -> None:
    name = b"step-\xff\xfe.pt"
    with open(os.path.join(os.fsencode(root), name), "wb") as file:
        file.write(b"x")
    assert settle(watch) == [Change(os.fsdecode(name), WRITTEN)]
    assert files(root) == [os.fsdecode(name)]


def test_a_writer_killed_mid_torch_save_is_reported_written_but_judged_truncated(
    tmp_path: Path, root: Path, watch: FolderWatch
) -> None:
    # Given the first half of a real torch.save file, written by a process that then dies by SIGKILL
    whole = tmp_path / "whole.pt"
    torch.save({"weight": torch.randn(256, 16)}, whole)
    child = (
        "import os, signal, sys\n"
        "data = open(sys.argv[1], 'rb').read()\n"
        "out = open(sys.argv[2], 'wb')\n"
        "out.write(data[: len(data) // 2])\n"
        "out.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = subprocess.run([sys.executable, "-c", child, str(whole), str(root / "model.pt")], timeout=30)
    assert result.returncode == -signal.SIGKILL
    # Then the kernel's close of its descriptor is reported like any other close: WRITTEN does not
    # mean complete. The bytes say it is cut short.
    assert settle(watch) == [Change("model.pt", WRITTEN)]
    reason = incomplete_reason("model.pt", (root / "model.pt").read_bytes())
    assert reason == "a zip archive (torch.save) without its end-of-central-directory record: truncated"


def test_an_overflow_rescans_the_whole_tree(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Given a tree changed behind the watch's back, as when the kernel drops events: the watch is
    # made, then changes are made and the events are never read
    (root / "gone.pt").write_bytes(b"g")
    with FolderWatch(root) as watch:
        (root / "a" / "b").mkdir(parents=True)
        (root / "a" / "b" / "new.pt").write_bytes(b"n")
        (root / "a" / "b" / f"{IGNORED_PREFIX}tmp").write_bytes(b"t")
        os.remove(root / "gone.pt")
        # When the overflow event is handled (a real one needs a smaller queue: a sysctl)
        overflow = struct.pack("iIII", -1, IN_Q_OVERFLOW, 0, 0)
        with caplog.at_level(logging.DEBUG, logger="resilrun.tiers.captured.watch"):
            changes = watch._apply(parse_events(overflow))
            again = watch._apply(parse_events(overflow))
        # Then every file is reported, the vanished one removed, and the new folders are watched
        assert changes == [Change("gone.pt", REMOVED), Change("a/b/new.pt", WRITTEN)]
        assert again == [Change("a/b/new.pt", WRITTEN)]
        assert [r.levelname for r in caplog.records if "overflowed" in r.getMessage()] == ["WARNING", "DEBUG"]
        (root / "a" / "b" / "later.pt").write_bytes(b"l")
        assert Change("a/b/later.pt", WRITTEN) in settle(watch)


def test_events_parse_with_padding_and_several_per_read() -> None:
    first = struct.pack("iIII", 1, IN_CLOSE_WRITE, 0, 16) + b"model.pt".ljust(16, b"\0")
    second = struct.pack("iIII", 2, IN_CLOSE_WRITE, 7, 16) + b"caf\xe9".ljust(16, b"\0")
    events = parse_events(first + second)
    assert [(event.wd, event.cookie, event.name) for event in events] == [(1, 0, "model.pt"), (2, 7, "caf\udce9")]


def test_the_root_must_be_an_existing_folder(tmp_path: Path) -> None:
    with pytest.raises(ResilrunError, match="does not exist"):
        FolderWatch(tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ResilrunError, match="is not a folder"):
        FolderWatch(tmp_path / "file")


def test_a_deleted_root_stops_the_watch_quietly(root: Path) -> None:
    (root / "sub").mkdir()
    (root / "sub" / "a.pt").write_bytes(b"a")
    watch = FolderWatch(root)
    shutil.rmtree(root)
    read_until(watch, lambda changes: watch.stopped, what="the root's removal")
    assert watch.read(0.0) == []
    watch.close()
    watch.close()  # idempotent
    assert watch.read(0.0) == []
    with pytest.raises(ValueError):
        watch.fileno()


def test_scan_lists_regular_files_sorted(root: Path) -> None:
    (root / "b" / "c").mkdir(parents=True)
    for name in ("z.pt", "b/c/x.pt", "b/a.pt", f"b/{IGNORED_PREFIX}part"):
        (root / name).write_bytes(b"")
    (root / "link.pt").symlink_to(root / "z.pt")
    os.mkfifo(root / "fifo")
    assert scan(root) == ["b/a.pt", "b/c/x.pt", "z.pt"]
