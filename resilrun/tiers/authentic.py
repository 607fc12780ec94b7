"""Authenticity of the persistent tier: MACs under a key derived from the job secret (issue 19).

crc32 catches accidents; whoever can write the bucket can also recompute every crc32 (or keep them:
crc32 is linear). With a job secret from outside the store, the persister also records

- per rank file, a GMAC of its bytes (AES-256-GCM over no plaintext: faster than a copy) under a key
  of its own, ``HMAC(durable key, "file" | salt)`` with a random salt kept in the manifest, so that
  no key ever authenticates two files and GCM's fixed nonce is safe;
- per chunk of that file (``_manifest.chunk_bounds``), a GMAC under a second key of the file's,
  ``HMAC(durable key, "chunk" | salt)``, with the chunk's index as its nonce, so a ranged read
  (a rank resuming at another world size) checks the bytes it read without the rest of the file;
- per manifest, its SHA-256 in COMPLETE.json (the manifest holds the file's GMACs);
- COMPLETE.json itself, an HMAC-SHA256 of its canonical JSON (every field but ``mac``).

The durable key is bound to the checkpoint's URI (``checkpoint_identity``): a step copied from
another job's bucket, written under the same secret, is not authentic where it was copied to (issue
43, F13). So a checkpoint verifies where it was written, under the same spelling up to what
``checkpoint_identity`` normalizes; one moved elsewhere no longer does.

A restore, ``inspect-checkpoint --verify`` or ``resilrun.checkpoint.load`` given the secret checks
the chain: COMPLETE's HMAC, each manifest's hash (both before a byte of the data file is
downloaded), each file's GMAC. A step without MACs (written by a job without a secret from outside
the store) is restored with a warning, or refused under ``--require-auth``: otherwise a forger
would strip the MACs. Every MAC, hash or tag read from storage is checked to be ASCII text before
it is compared (``hmac.compare_digest`` raises TypeError on other text): a malformed one is
reported as not authentic, never as an internal error.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from resilrun.errors import CheckpointCorruptError

_LABEL = b"resilrun durable tier v2\0"  # v2: bound to the checkpoint URI
_NONCE = bytes(12)  # fixed: every file has a key of its own (see the module docstring)


def checkpoint_identity(uri: str) -> str:
    """The form of a checkpoint URI its key is bound to: the same for spellings that differ only
    lexically (a trailing '/', ``file://``, a relative path, ``.`` and ``..`` segments), so the job,
    ``inspect-checkpoint``, ``load`` and ``export`` agree. Symlinks are not resolved: nodes that
    mount one shared folder through links of their own (automounts, ``/scratch`` links) resolve it
    differently, and every node's persister must sign with the same key; they give it the same
    spelling on their command lines."""
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://") :].partition("/")
        return f"s3://{bucket}/{prefix.strip('/')}".rstrip("/")
    if "://" in uri and not uri.startswith("file://"):
        return uri.rstrip("/")  # (memory:// in tests)
    path = uri[len("file://") :] if uri.startswith("file://") else uri
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def durable_key(secret: bytes, uri: str) -> bytes:
    """The persistent tier's MAC key for the checkpoint at ``uri``, derived from the job secret (a
    key per purpose, and per checkpoint: see the module docstring)."""
    return hmac.new(secret, _LABEL + checkpoint_identity(uri).encode(), hashlib.sha256).digest()


def _same(found: Any, expected: str) -> bool:
    """Whether a MAC read from storage is ``expected``, in constant time; False for anything that
    is not ASCII text (which ``hmac.compare_digest`` would raise TypeError on)."""
    return isinstance(found, str) and found.isascii() and hmac.compare_digest(found, expected)


def _salt(found: Any) -> bytes:
    """A file's salt as a manifest records it (hex); empty when malformed."""
    salt = found.get("salt") if isinstance(found, dict) else None
    if not isinstance(salt, str) or not salt.isascii():
        return b""
    try:
        return bytes.fromhex(salt)
    except ValueError:
        return b""


def _file_tag(key: bytes, salt: bytes, data: bytes | memoryview) -> str:
    file_key = hmac.new(key, b"file" + salt, hashlib.sha256).digest()
    gcm = Cipher(algorithms.AES(file_key), modes.GCM(_NONCE)).encryptor()
    gcm.authenticate_additional_data(data)
    gcm.finalize()
    return gcm.tag.hex()


def _chunk_key(key: bytes, salt: bytes) -> bytes:
    return hmac.new(key, b"chunk" + salt, hashlib.sha256).digest()


def _chunk_tag(chunk_key: bytes, index: int, piece: bytes | memoryview) -> str:
    gcm = Cipher(algorithms.AES(chunk_key), modes.GCM(index.to_bytes(12, "big"))).encryptor()
    gcm.authenticate_additional_data(piece)
    gcm.finalize()
    return gcm.tag.hex()


def file_mac(key: bytes, data: bytes | memoryview, chunks: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    """What a manifest records for its file: a fresh salt, the GMAC under the key it makes and,
    given its ``chunks`` (``_manifest.chunk_bounds``), one GMAC per chunk."""
    salt = os.urandom(16)
    mac: dict[str, Any] = {"salt": salt.hex(), "gmac": _file_tag(key, salt, data)}
    if chunks is not None:
        view, chunk_key = memoryview(data), _chunk_key(key, salt)
        mac["chunks"] = [_chunk_tag(chunk_key, i, view[b:e]) for i, (b, e) in enumerate(chunks)]
    return mac


def manifest_hash(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def complete_mac(key: bytes, complete: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in complete.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def check_file(key: bytes, rank: int, manifest: dict[str, Any], data: bytes | memoryview, where: str) -> None:
    """Check a file against the GMAC its manifest (authenticated by ``check_manifest``) records.

    Raises:
        CheckpointCorruptError: the GMAC does not verify, or is malformed.
    """
    found = manifest.get("mac")
    salt = _salt(found)
    tag = found.get("gmac") if isinstance(found, dict) else None
    if not salt or not _same(tag, _file_tag(key, salt, data)):
        raise CheckpointCorruptError(f"{where}: rank {rank}'s file is not authentic (its GMAC does not verify)")


def check_manifest(key: bytes, complete: dict[str, Any], rank: int, manifest_raw: bytes, where: str) -> bool:
    """Check COMPLETE.json's HMAC and rank's manifest hash: the chain down to the file's MACs;
    False when the step carries no MACs. Needs no byte of the data file, so a reader calls it
    before downloading one.

    Raises:
        CheckpointCorruptError: a MAC or hash does not match, or is malformed.
    """
    mac = complete.get("mac")
    if mac is None:
        return False
    if not _same(mac, complete_mac(key, complete)):
        raise CheckpointCorruptError(
            f"{where}: COMPLETE.json is not authentic (its MAC does not verify under this job secret)",
            hint="the checkpoint was changed after it was written, written under another job secret, written "
            "at another URI spelling (a MAC binds the place it was written to), or persisted by an earlier resilrun "
            "(before the key was bound to the URI and the secret stretched with scrypt: those steps verify only "
            "with that version)",
        )
    wanted = complete["ranks"][str(rank)].get("manifest_sha256")
    if not _same(wanted, manifest_hash(manifest_raw)):
        raise CheckpointCorruptError(f"{where}: rank {rank}'s manifest is not authentic (its SHA-256 differs)")
    return True


class ChunkChecker:
    """Checks chunks of one file against the GMACs its (authenticated) manifest records."""

    def __init__(self, key: bytes, manifest: dict[str, Any], where: str) -> None:
        found = manifest.get("mac")
        tags = found.get("chunks") if isinstance(found, dict) else None
        salt = _salt(found)
        if not salt or not isinstance(tags, list) or not all(isinstance(t, str) and t.isascii() for t in tags):
            raise CheckpointCorruptError(f"{where}: the manifest carries no valid chunk GMACs")
        self._key = _chunk_key(key, salt)
        self._tags: list[str] = tags
        self._where = where

    def check(self, index: int, piece: bytes | memoryview) -> None:
        """Raises CheckpointCorruptError unless chunk ``index`` is ``piece``'s bytes as written."""
        if not 0 <= index < len(self._tags) or not hmac.compare_digest(
            self._tags[index], _chunk_tag(self._key, index, piece)
        ):
            raise CheckpointCorruptError(f"{self._where}: chunk {index} is not authentic (its GMAC does not verify)")


def has_chunk_tags(manifest: dict[str, Any]) -> bool:
    found = manifest.get("mac")
    return isinstance(found, dict) and isinstance(found.get("chunks"), list)


def captured_mac(key: bytes, description: dict[str, Any]) -> str:
    """The MAC of a captured file's description (``tiers.captured.durable``): an HMAC-SHA256 under
    a key of its own purpose, over the canonical JSON of every field but ``mac``. The description
    names the file's SHA-256, so this MAC covers its bytes too; a restore checks both before the
    script's own ``torch.load`` may unpickle them."""
    purpose = hmac.new(key, b"captured file", hashlib.sha256).digest()
    return complete_mac(purpose, description)


def same_mac(found: Any, expected: str) -> bool:
    """``_same`` for other modules: a MAC read from storage compared in constant time."""
    return _same(found, expected)
