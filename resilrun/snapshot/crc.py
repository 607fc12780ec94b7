"""crc32 with zlib's polynomial, computed by ISA-L when it is installed.

Why: checksums bound the peer-transfer and snapshot-verification throughput. zlib's crc32 runs at
about 1.2 GB/s here, ISA-L's (the ``isal`` package, a dependency) at about 8 GB/s, and both give
the same value, so files written with one verify with the other. Both release the GIL on large
buffers. zlib stays as the fallback for an environment without the wheel.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; keep working without it
    from zlib import crc32

__all__ = ["crc32"]
