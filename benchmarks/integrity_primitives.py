"""Throughput of the integrity and encryption primitives a replica stream could carry, next to crc32.

    python benchmarks/integrity_primitives.py [--size-mib 256] [--runs 5] [--json out.json]

Why: issue 19 asks for a keyed MAC on every replica and fetch stream, chosen by measurement, and
for optional encryption; what the stream can afford is bounded by the primitive's GB/s on one
core, since a transfer already spends its cores on the copy and on crc32. Every primitive runs
over the same random bytes in ``CHUNK_BYTES`` frames (what the stream sends), single-threaded,
interleaved round by round (the order rotates; this machine is shared and noisy), and is
reported as median and min-max GB/s and as a ratio to crc32 (resilrun's, ISA-L when installed)
and to a plain memcpy of the same bytes. Encryption (AES-256-GCM, ChaCha20-Poly1305) needs the
``cryptography`` package and is skipped with the reason where it is missing; BLAKE3 likewise
needs ``blake3``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from resilrun.snapshot.crc import crc32  # noqa: E402 - benchmarks/ is not a package
from resilrun.tiers.peer.wire import CHUNK_BYTES  # noqa: E402

KEY = os.urandom(32)


def _crc32(frames: list[memoryview]) -> None:
    value = 0
    for frame in frames:
        value = crc32(frame, value)


def _memcpy(frames: list[memoryview]) -> None:
    target = bytearray(CHUNK_BYTES)
    for frame in frames:
        target[: len(frame)] = frame


def _hashlib(name: str, **kwargs: object) -> Callable[[list[memoryview]], None]:
    def run(frames: list[memoryview]) -> None:
        digest = hashlib.new(name, **kwargs) if kwargs else hashlib.new(name)
        for frame in frames:
            digest.update(frame)
        digest.digest()

    return run


def _blake2b_keyed(frames: list[memoryview]) -> None:
    digest = hashlib.blake2b(key=KEY, digest_size=32)
    for frame in frames:
        digest.update(frame)
    digest.digest()


def _hmac_sha256(frames: list[memoryview]) -> None:
    mac = hmac.new(KEY, digestmod="sha256")
    for frame in frames:
        mac.update(frame)
    mac.digest()


def _optional() -> tuple[dict[str, Callable[[list[memoryview]], None]], list[str]]:
    found: dict[str, Callable[[list[memoryview]], None]] = {}
    missing: list[str] = []
    try:
        import blake3

        def _blake3_keyed(frames: list[memoryview]) -> None:
            digest = blake3.blake3(key=KEY)
            for frame in frames:
                digest.update(frame)
            digest.digest()

        found["BLAKE3 keyed (MAC)"] = _blake3_keyed
    except ImportError:
        missing.append("BLAKE3: the blake3 package is not installed")
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

        ciphers = (("AES-256-GCM (encrypt + MAC)", AESGCM(KEY)), ("ChaCha20-Poly1305", ChaCha20Poly1305(KEY)))
        for label, cipher in ciphers:

            def _seal(frames: list[memoryview], cipher: object = cipher) -> None:
                for index, frame in enumerate(frames):
                    cipher.encrypt(index.to_bytes(12, "big"), frame, None)  # type: ignore[attr-defined]

            found[label] = _seal
        gmac = AESGCM(KEY)

        def _gmac(frames: list[memoryview]) -> None:  # GCM over no plaintext: the frame is only authenticated
            for index, frame in enumerate(frames):
                gmac.encrypt(index.to_bytes(12, "big"), b"", frame)

        found["AES-256-GMAC (MAC)"] = _gmac
    except ImportError:
        missing.append("AES-GCM, ChaCha20-Poly1305: the cryptography package is not installed")
    return found, missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    data = os.urandom(args.size_mib * 2**20)
    view = memoryview(data)
    frames = [view[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    primitives: dict[str, Callable[[list[memoryview]], None]] = {
        "memcpy (ceiling)": _memcpy,
        "crc32 (today)": _crc32,
        "BLAKE2b keyed (MAC)": _blake2b_keyed,
        "HMAC-SHA256 (MAC)": _hmac_sha256,
        "SHA-256 (unkeyed)": _hashlib("sha256"),
    }
    extra, missing = _optional()
    primitives.update(extra)
    names = list(primitives)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for run in range(args.runs):
        for name in names[run % len(names) :] + names[: run % len(names)]:
            started = time.perf_counter()
            primitives[name](frames)
            seconds[name].append(time.perf_counter() - started)
    gbs = {name: [len(data) / s / 1e9 for s in values] for name, values in seconds.items()}
    median = {name: statistics.median(values) for name, values in gbs.items()}
    print(f"{args.size_mib} MiB in {CHUNK_BYTES // 2**20} MiB frames, one core, {args.runs} interleaved runs:\n")
    print("| primitive | GB/s (median, min-max) | vs crc32 | vs memcpy |")
    print("| --- | --- | --- | --- |")
    for name in names:
        low, high = min(gbs[name]), max(gbs[name])
        print(
            f"| {name} | {median[name]:.2f} ({low:.2f}-{high:.2f}) | {median[name] / median['crc32 (today)']:.2f}x | "
            f"{median[name] / median['memcpy (ceiling)']:.2f}x |"
        )
    for why in missing:
        print(f"\n(skipped: {why})")
    if args.json:
        args.json.write_text(json.dumps({"size_mib": args.size_mib, "gb_s": gbs}, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
