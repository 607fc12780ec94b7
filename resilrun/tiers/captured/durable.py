"""Captured files in the persistent tier (``--checkpoint-uri``), beside resilrun's own steps.

Layout: ``captured/data/<sha256>`` holds a version's bytes, ``captured/index/<hex of path>.json``
names the newest version of each path (``FileVersion`` fields and a MAC). The index object is
written after the data: it is the commit point, so a reader never finds an index naming bytes
not yet uploaded. Bytes are addressed by content, so two paths with equal bytes share them and a
rewrite with the same bytes uploads nothing.

Authenticity: the index carries ``authentic.captured_mac`` under the durable key (a job secret
from outside the store). A restore writes a file into the script's folder only if its index
verifies and its bytes hash to the SHA-256 the index names: the script will ``torch.load`` them,
and unpickling what someone planted in the bucket runs their code. Without such a secret nothing
is signed, and nothing captured is restored from storage (the peers' copies, whose transport is
authenticated on the job secret, still are).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from resilrun.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    StorageError,
    StorageNotFoundError,
)
from resilrun.storage.api import Storage
from resilrun.tiers.authentic import captured_mac, same_mac
from resilrun.tiers.captured.catalog import FileVersion, digest

logger = logging.getLogger(__name__)

INDEX = "captured/index/"
DATA = "captured/data/"
_MAX_INDEX_BYTES = 64 * 1024


def index_key(path: str) -> str:
    return f"{INDEX}{path.encode().hex()}.json"


def data_key(sha256: str) -> str:
    return f"{DATA}{sha256}"


@dataclass(frozen=True, slots=True)
class Stored:
    """A version the persistent tier lists, and whether its index carried a valid MAC."""

    version: FileVersion
    signed: bool


def write(storage: Storage, version: FileVersion, data: bytes, mac_key: bytes | None) -> None:
    """Upload ``data`` (unless those bytes are there already), then the index naming it.

    Raises:
        StorageError: the upload failed.
    """
    key = data_key(version.sha256)
    try:
        present = storage.size(key) == len(data)
    except StorageNotFoundError:
        present = False
    if not present:
        storage.put(key, data)
    description = version.to_message()
    if mac_key is not None:
        description["mac"] = captured_mac(mac_key, description)
    storage.put(index_key(version.path), json.dumps(description, sort_keys=True).encode())


def listed(storage: Storage, mac_key: bytes | None) -> list[Stored]:
    """The newest version of every captured path in storage; an index that does not parse is
    skipped with a warning (it cannot name a file a restore would trust)."""
    found = []
    for key in storage.list(INDEX):
        try:
            found.append(_read_index(storage, key, mac_key))
        except (CheckpointError, StorageError) as exc:
            logger.warning("captured index %s in the persistent tier is unusable: %s", key, exc.message)
    return found


def _read_index(storage: Storage, key: str, mac_key: bytes | None) -> Stored:
    if storage.size(key) > _MAX_INDEX_BYTES:
        raise CheckpointCorruptError(f"more than {_MAX_INDEX_BYTES} bytes: not an index")
    try:
        description = json.loads(storage.get(key))
    except ValueError:
        raise CheckpointCorruptError("not JSON") from None
    if not isinstance(description, dict):
        raise CheckpointCorruptError("not a JSON object")
    version = FileVersion.from_message({k: v for k, v in description.items() if k != "mac"})
    if key != index_key(version.path):
        raise CheckpointCorruptError(f"names {version.path!r}, which belongs under another key")
    signed = mac_key is not None and same_mac(
        description.get("mac"), captured_mac(mac_key, {k: v for k, v in description.items() if k != "mac"})
    )
    return Stored(version, signed)


def read(storage: Storage, version: FileVersion) -> bytes:
    """The bytes of ``version``, checked against its SHA-256.

    Raises:
        CheckpointNotFoundError: not in storage (deleted since it was listed).
        CheckpointCorruptError: the bytes differ from what the index names.
        StorageError: the download failed.
    """
    try:
        data = storage.get(data_key(version.sha256))
    except StorageNotFoundError:
        raise CheckpointNotFoundError(f"captured file {version.path} is gone from the persistent tier") from None
    if len(data) != version.size or digest(data) != version.sha256:
        raise CheckpointCorruptError(f"captured file {version.path} in the persistent tier differs from its index")
    return data


def delete(storage: Storage, version: FileVersion) -> None:
    """Forget ``version`` (the script deleted the file): its index if it still names it, and its
    bytes unless another path's index names them too."""
    key = index_key(version.path)
    try:
        current = _read_index(storage, key, None).version
    except StorageNotFoundError:
        return
    except CheckpointError:
        current = None
    if current is not None and current.order > version.order:
        return  # rewritten since
    storage.delete(key)
    shared = any(_shares(storage, other, version.sha256) for other in storage.list(INDEX))
    if not shared:
        storage.delete(data_key(version.sha256))


def _shares(storage: Storage, key: str, sha256: str) -> bool:
    try:
        return _read_index(storage, key, None).version.sha256 == sha256
    except (CheckpointError, StorageError):
        return False
