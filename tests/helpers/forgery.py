"""What anyone can do to crc32-protected bytes without a key (the attack tests of issue 19)."""

from __future__ import annotations

import pickle
import zlib
from pathlib import Path
from typing import Any


def forged_keeping_crc32(segment: bytes, edit_at: int, fix_at: int) -> bytes:
    """``segment`` with its byte at ``edit_at`` changed and the 4 bytes at ``fix_at`` chosen so that
    its crc32 is unchanged: what anyone can do to a crc32-protected stream (crc32 is affine, so the
    32 bits at ``fix_at`` reach every crc32 value; solved over GF(2))."""
    forged = bytearray(segment)
    want = zlib.crc32(segment)
    forged[edit_at] ^= 0xFF
    base = zlib.crc32(forged)
    basis: dict[int, tuple[int, int]] = {}  # highest bit -> (crc32 change, the bits flipped for it)
    for bit in range(32):
        forged[fix_at + bit // 8] ^= 1 << (bit % 8)
        vector, combination = zlib.crc32(forged) ^ base, 1 << bit
        forged[fix_at + bit // 8] ^= 1 << (bit % 8)
        for pivot in sorted(basis, reverse=True):
            if vector >> pivot & 1:
                vector, combination = vector ^ basis[pivot][0], combination ^ basis[pivot][1]
        if vector:
            basis[vector.bit_length() - 1] = (vector, combination)
    target, flips = base ^ want, 0
    for pivot in sorted(basis, reverse=True):
        if target >> pivot & 1:
            target, flips = target ^ basis[pivot][0], flips ^ basis[pivot][1]
    assert target == 0
    for bit in range(32):
        if flips >> bit & 1:
            forged[fix_at + bit // 8] ^= 1 << (bit % 8)
    return bytes(forged)


class _Payload:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def pickle_payload(marker: Path) -> bytes:
    """A pickle that creates ``marker`` when unpickled: proof that something unpickled it."""
    return pickle.dumps(_Payload(marker))
