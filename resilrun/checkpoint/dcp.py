"""A DCP storage writer and reader on resilrun's tiers: ``torch.distributed.checkpoint`` saves
that land in node memory, on peer nodes and in ``--checkpoint-uri``, with a few lines changed::

    import torch.distributed.checkpoint as dcp
    from resilrun.checkpoint import StorageReader, StorageWriter, latest

    dcp.save(state, storage_writer=StorageWriter(f"step-{step}"))        # or dcp.async_save(...)
    if (found := latest()) is not None:
        dcp.load(state, storage_reader=StorageReader(found))

Why a folder and not a new transport: DCP already writes one file per rank and a ``.metadata``
last (by a rename), reshards on load and runs ``async_save`` in the background; what a job lacks
is where to put the files so that they outlive a node without a shared file system. The writer
puts them under the job's captured folder (``--capture-dir``, ``RESILRUN_CAPTURE_DIR``); the agent
then keeps each file in node memory, sends it to the replica peers and uploads it (signed), and
before every round's workers start puts the newest complete version of every file back on every
node (docs/captured-checkpoints.md). A load therefore reads local files, whichever node wrote them,
and DCP's own planner reshards as it does on a shared file system. Files are not fsynced: the copy
that survives a power loss is the peer's and the persistent tier's, not this disk's.

Outside resilrun (plain ``python`` or ``torchrun``: no captured folder) the same calls read and
write the given path as DCP's ``FileSystemWriter``/``FileSystemReader`` would, so the script still
runs everywhere.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from resilrun.env import capture_dir
from resilrun.errors import ConfigError

__all__ = ["StorageReader", "StorageWriter", "latest"]

_METADATA = ".metadata"


def resolve(checkpoint_id: str | os.PathLike[str]) -> Path:
    """Where ``checkpoint_id`` lives: under the captured folder when the job has one.

    Raises:
        ConfigError: an absolute path or one with ``..`` outside the captured folder (its files
            would not be captured, and the checkpoint would not outlive this node).
    """
    root = capture_dir()
    path = Path(checkpoint_id)
    if root is None:
        return path
    base = Path(root)
    target = path if path.is_absolute() else base / path
    if os.path.commonpath([os.path.abspath(base), os.path.abspath(target)]) != os.path.abspath(base):
        raise ConfigError(
            f"DCP checkpoint {str(checkpoint_id)!r} is outside the captured folder {root}",
            hint="give StorageWriter/StorageReader a path relative to --capture-dir",
        )
    return target


class StorageWriter(FileSystemWriter):
    """DCP's file-system writer into the captured folder (see the module), without fsync."""

    def __init__(self, checkpoint_id: str | os.PathLike[str], **kwargs: Any) -> None:
        kwargs.setdefault("sync_files", False)
        super().__init__(resolve(checkpoint_id), **kwargs)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(resolve(checkpoint_id) if checkpoint_id is not None else None)


class StorageReader(FileSystemReader):
    """DCP's file-system reader of a checkpoint in the captured folder (see the module)."""

    def __init__(self, checkpoint_id: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(resolve(checkpoint_id), **kwargs)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        super().reset(resolve(checkpoint_id) if checkpoint_id is not None else None)


def latest(parent: str | os.PathLike[str] = ".") -> str | None:
    """The newest complete DCP checkpoint under ``parent`` (relative to the captured folder): the
    subfolder with a ``.metadata`` (DCP writes it last) whose name ends in the largest number
    (``step-100`` after ``step-99``), else the newest such ``.metadata``; None when there is none.
    Returned relative to ``parent``'s resolution root, ready for ``StorageReader``."""
    folder = resolve(parent)
    try:
        complete = [entry for entry in folder.iterdir() if (entry / _METADATA).is_file()]
    except OSError:
        return None
    if not complete:
        return None

    def order(entry: Path) -> tuple[int, float]:
        number = re.search(r"(\d+)$", entry.name)
        return (int(number.group(1)) if number else -1, (entry / _METADATA).stat().st_mtime)

    newest = max(complete, key=order)
    root = capture_dir()
    return os.path.relpath(newest, root) if root is not None else str(newest)
