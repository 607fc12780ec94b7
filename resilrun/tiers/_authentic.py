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

A restore, ``inspect-checkpoint --verify`` or ``resilrun.checkpoint.load`` given the secret checks
the chain: COMPLETE's HMAC, each manifest's hash, each file's GMAC. A step without MACs (written by
a job without a secret from outside the store) is restored with a warning, or refused under
``--require-auth``: otherwise a forger would strip the MACs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from resilrun.errors import CheckpointCorruptError

_LABEL = b"resilrun durable tier v1"
_NONCE = bytes(12)  # fixed: every file has a key of its own (see the module docstring)


def durable_key(secret: bytes) -> bytes:
    """The persistent tier's MAC key, derived from the job secret (a key per purpose)."""
    return hmac.new(secret, _LABEL, hashlib.sha256).digest()


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


def check(
    key: bytes,
    complete: dict[str, Any],
    rank: int,
    manifest_raw: bytes,
    manifest: dict[str, Any],
    data: bytes | memoryview,
    where: str,
) -> bool:
    """Check one rank of a step against its MACs; False when the step carries none.

    Raises:
        CheckpointCorruptError: a MAC or hash does not match ("not authentic"), or is malformed.
    """
    if not check_manifest(key, complete, rank, manifest_raw, where):
        return False
    found = manifest.get("mac")
    salt = found.get("salt") if isinstance(found, dict) else None
    tag = found.get("gmac") if isinstance(found, dict) else None
    try:
        ok = isinstance(tag, str) and hmac.compare_digest(tag, _file_tag(key, bytes.fromhex(str(salt)), data))
    except ValueError:
        ok = False
    if not ok:
        raise CheckpointCorruptError(f"{where}: rank {rank}'s file is not authentic (its GMAC does not verify)")
    return True


def check_manifest(key: bytes, complete: dict[str, Any], rank: int, manifest_raw: bytes, where: str) -> bool:
    """Check COMPLETE.json's HMAC and rank's manifest hash: the chain down to the file's MACs;
    False when the step carries no MACs.

    Raises:
        CheckpointCorruptError: a MAC or hash does not match, or is malformed.
    """
    mac = complete.get("mac")
    if mac is None:
        return False
    if not isinstance(mac, str) or not hmac.compare_digest(mac, complete_mac(key, complete)):
        raise CheckpointCorruptError(
            f"{where}: COMPLETE.json is not authentic (its MAC does not verify under this job secret)",
            hint="the checkpoint was changed after it was written, or written under another job secret",
        )
    wanted = complete["ranks"][str(rank)].get("manifest_sha256")
    if not isinstance(wanted, str) or not hmac.compare_digest(wanted, manifest_hash(manifest_raw)):
        raise CheckpointCorruptError(f"{where}: rank {rank}'s manifest is not authentic (its SHA-256 differs)")
    return True


class ChunkChecker:
    """Checks chunks of one file against the GMACs its (authenticated) manifest records."""

    def __init__(self, key: bytes, manifest: dict[str, Any], where: str) -> None:
        found = manifest.get("mac")
        tags = found.get("chunks") if isinstance(found, dict) else None
        try:
            salt = bytes.fromhex(str(found.get("salt"))) if isinstance(found, dict) else b""
        except ValueError:
            salt = b""
        if not salt or not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
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
