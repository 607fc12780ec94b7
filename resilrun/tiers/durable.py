"""Tier 3 (durable): each rank's snapshot on Storage, a step committed by a COMPLETE.json written last.

On storage (keys relative to the Storage root)::

    step_{step:012d}/rank_{rank:05d}.safetensors   the snapshot bytes exactly as resilrun.snapshot.layout lays them out
    step_{step:012d}/rank_{rank:05d}.json          the rank's manifest, written after its .safetensors
    step_{step:012d}/COMPLETE.json                 the commit point, written once every manifest exists

Lifecycle of a step (each row is what a reader can observe):

    | state    | objects present                                       | restorable |
    |----------|-------------------------------------------------------|------------|
    | writing  | some .safetensors, some .json                         | no         |
    | partial  | every rank's .safetensors and .json, no COMPLETE.json | no         |
    | complete | COMPLETE.json, naming each manifest's size and crc32  | yes        |
    | deleting | COMPLETE.json gone first, then manifests, then data   | no         |

Invariants: a step counts only when COMPLETE.json exists, and its content pins every manifest (crc32
of the manifest bytes), every manifest pins its data file (size, header crc32, per-tensor crc32).
Reading never unpickles, never builds a path from a stored file name (the names are checked to be the
expected ones), never downloads an object before its size has been checked against a limit, and any
mismatch is a CheckpointCorruptError naming the step, rank, file and tensor.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from resilrun.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, StorageNotFoundError
from resilrun.snapshot.crc import crc32
from resilrun.snapshot.layout import FORMAT, MAX_HEADER_BYTES, Layout, parse_header
from resilrun.snapshot.selection import Selection
from resilrun.storage.api import Storage
from resilrun.tiers import _manifest as m
from resilrun.tiers import authentic
from resilrun.tiers._manifest import COMPLETE_NAME, complete_key, data_key, manifest_key, step_prefix

__all__ = [
    "FORMAT",
    "StepInfo",
    "commit_step",
    "latest_complete_step",
    "list_steps",
    "read_complete",
    "read_layout",
    "read_rank",
    "read_rank_ranges",
    "retain",
    "steps_to_delete",
    "summarize_keys",
    "write_rank",
]

T = TypeVar("T")
R = TypeVar("R")
# Manifests and COMPLETE.json are read concurrently: S3 latency, not bandwidth, bounds them.
_READ_CONCURRENCY = 16


@dataclass(frozen=True, slots=True)
class StepInfo:
    """What storage holds for one step: committed or not, and which ranks' manifests exist."""

    step: int
    complete: bool
    ranks: tuple[int, ...]


# -- write -----------------------------------------------------------------------------------------
def write_rank(
    storage: Storage,
    step: int,
    rank: int,
    world_size: int,
    snapshot: bytes | memoryview,
    values: Any,
    *,
    mac_key: bytes | None = None,
) -> dict[str, Any]:
    """Upload one rank's snapshot, then its manifest (the snapshot first, so a manifest never names
    bytes that are not there yet).

    Args:
        storage: where the checkpoint lives.
        step, rank, world_size: identify the snapshot; ``0 <= rank < world_size``.
        snapshot: a safetensors buffer laid out by ``resilrun.snapshot.layout``; bytes after the last
            tensor (the unused tail of a reused, larger slot) are not written.
        values: the tracked non-tensor values, any JSON document (NaN and infinities allowed).
        mac_key: the durable key (``authentic.durable_key``): the manifest then records the file's
            GMAC, so a reader with the secret can tell a forged file.

    Returns:
        The manifest that was written.

    Raises:
        CheckpointCorruptError: ``snapshot`` is not a valid layout or has an unsafe tensor name.
        TypeError: ``values`` is not JSON-serialisable; nothing was written.
        ValueError: step, rank or world size out of range.
        StorageError: an upload failed.
    """
    m.check_ids(step, rank, world_size)
    view = memoryview(snapshot).cast("B")
    layout = parse_header(view, view.nbytes)
    data = view[: layout.total_bytes]
    start = layout.data_start
    chunks = m.layout_chunks(layout)
    tensors = {}
    for entry in layout.entries:
        if not m.is_safe_tensor_name(entry.name):
            raise CheckpointCorruptError(f"tensor name {entry.name!r} is not allowed in a checkpoint")
        tensors[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [entry.begin, entry.end],
            "crc32": crc32(data[start + entry.begin : start + entry.end]),
        }
    manifest = {
        "format": FORMAT,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "file": m.data_file_name(rank),
        "file_bytes": layout.total_bytes,
        "header_crc32": crc32(layout.header),
        "chunks": {
            "bytes": m.CHUNK_BYTES,
            "per_tensor": m.CHUNKS_PER_TENSOR,
            "crc32": [crc32(data[b:e]) for b, e in chunks],
        },
        "tensors": tensors,
        "values": values,
        "created_unix": time.time(),
    }
    if mac_key is not None:
        manifest["mac"] = authentic.file_mac(mac_key, data, chunks)
    encoded = m.encode(manifest)  # before any upload: bad values must not leave an orphan file
    storage.put(data_key(step, rank), data)
    storage.put(manifest_key(step, rank), encoded)
    return manifest


def commit_step(storage: Storage, step: int, world_size: int, *, mac_key: bytes | None = None) -> dict[str, Any]:
    """Write COMPLETE.json for ``step`` once every rank's manifest and file are in place (with
    ``mac_key``, each manifest's SHA-256 and an HMAC of the whole: see ``authentic``).

    Returns:
        The COMPLETE.json document written.

    Raises:
        CheckpointNotFoundError: a rank's manifest or data file does not exist yet.
        CheckpointCorruptError: a manifest is unreadable or disagrees with its file's size.
        StorageError: storage failed.
    """
    m.check_ids(step, 0, world_size)

    def check(rank: int) -> tuple[str, dict[str, int]]:
        raw = _get_small(storage, manifest_key(step, rank), m.MAX_MANIFEST_BYTES, missing=CheckpointNotFoundError)
        manifest = m.parse_manifest(raw, step, rank, world_size, where=manifest_key(step, rank))
        try:
            size = storage.size(data_key(step, rank))
        except StorageNotFoundError:
            raise CheckpointNotFoundError(f"{data_key(step, rank)} does not exist; cannot commit step {step}") from None
        if size != manifest["file_bytes"]:
            raise CheckpointCorruptError(
                f"{data_key(step, rank)} is {size} bytes but its manifest says {manifest['file_bytes']}"
            )
        entry: dict[str, Any] = {"file_bytes": size, "manifest_crc32": crc32(raw)}
        if mac_key is not None:
            entry["manifest_sha256"] = authentic.manifest_hash(raw)
        return str(rank), entry

    ranks = dict(_parallel(check, range(world_size)))
    complete: dict[str, Any] = {"format": FORMAT, "step": step, "world_size": world_size, "ranks": ranks}
    if mac_key is not None:
        complete["mac"] = authentic.complete_mac(mac_key, complete)
    storage.put(complete_key(step), m.encode(complete))
    return complete


# -- list and retain -------------------------------------------------------------------------------
def summarize_keys(keys: Iterable[str]) -> list[StepInfo]:
    """Group storage keys into steps (pure; keys that are not checkpoint objects are ignored)."""
    complete: dict[int, bool] = {}
    ranks: dict[int, set[int]] = {}
    for key in keys:
        parsed = m.parse_key(key)
        if parsed is None:
            continue
        step, kind, rank = parsed
        complete.setdefault(step, False)
        ranks.setdefault(step, set())
        if kind == "complete":
            complete[step] = True
        elif kind == "manifest" and rank is not None:
            ranks[step].add(rank)
    return [StepInfo(step, complete[step], tuple(sorted(ranks[step]))) for step in sorted(complete)]


def list_steps(storage: Storage) -> list[StepInfo]:
    """Every step with at least one checkpoint object, oldest first.

    ``complete`` means COMPLETE.json exists; its content is verified only when a rank is read.
    """
    return summarize_keys(storage.list("step_"))


def latest_complete_step(storage: Storage) -> int | None:
    """The newest step with a COMPLETE.json, or None when no step was ever committed."""
    steps = [info.step for info in list_steps(storage) if info.complete]
    return max(steps) if steps else None


def steps_to_delete(steps: Iterable[StepInfo], keep_last: int) -> list[int]:
    """Which steps retention deletes (pure): every step, complete or abandoned partial, older than
    the oldest of the ``keep_last`` newest complete steps. Partial steps newer than that may still
    be uploading and are kept; with no complete step at all nothing is deleted.

    Raises:
        ValueError: ``keep_last < 1`` (deleting every complete step would leave nothing to restore).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}")
    infos = list(steps)
    complete = sorted(info.step for info in infos if info.complete)
    if not complete:
        return []
    oldest_kept = complete[max(0, len(complete) - keep_last)]
    return sorted(info.step for info in infos if info.step < oldest_kept)


def retain(storage: Storage, keep_last: int) -> list[int]:
    """Delete all but the newest ``keep_last`` complete steps (see ``steps_to_delete``); return them.

    COMPLETE.json goes first, so a step that is half deleted (a crash in between) is never
    mistaken for a complete one; manifests go before data for the same reason.
    """
    doomed = steps_to_delete(list_steps(storage), keep_last)
    for step in doomed:
        storage.delete(complete_key(step))
        keys = storage.list(step_prefix(step))
        for key in sorted(keys, key=lambda k: (not k.endswith(".json"), k)):
            storage.delete(key)
    return doomed


# -- read ------------------------------------------------------------------------------------------
def read_complete(storage: Storage, step: int) -> dict[str, Any]:
    """Read and validate COMPLETE.json of ``step``.

    Raises:
        CheckpointNotFoundError: the step is not complete (or does not exist).
        CheckpointCorruptError: COMPLETE.json is malformed.
    """
    raw = _get_small(storage, complete_key(step), m.MAX_COMPLETE_BYTES, missing=CheckpointNotFoundError)
    return m.parse_complete(raw, step, where=complete_key(step))


def read_layout(
    storage: Storage, step: int, rank: int, *, complete: dict[str, Any] | None = None, require_complete: bool = True
) -> tuple[Layout, dict[str, Any]]:
    """Read a rank's manifest and its file's header only (two small ranged reads), cross-checked.

    Args:
        complete: the step's COMPLETE.json if already read (saves a request per rank).
        require_complete: when False, a rank of a partial step is read without the COMPLETE check.

    Raises:
        CheckpointNotFoundError: the step is not complete (with require_complete) or the rank
            does not exist.
        CheckpointCorruptError: anything disagrees.
    """
    manifest, _ = _read_manifest(storage, step, rank, complete, require_complete)
    key = data_key(step, rank)
    size = _checked_size(storage, key, manifest["file_bytes"])
    prefix = storage.get_range(key, 0, 8)
    if len(prefix) == 8:
        length = int.from_bytes(prefix, "little")
        if length <= MAX_HEADER_BYTES and 8 + length <= size:  # else parse_header reports it
            prefix += storage.get_range(key, 8, 8 + length)
    layout = _parse(prefix, size, key)
    m.check_layout(layout, manifest, where=key)
    return layout, manifest


def read_rank(
    storage: Storage,
    step: int,
    rank: int,
    *,
    verify: bool = True,
    complete: dict[str, Any] | None = None,
    require_complete: bool = True,
    mac_key: bytes | None = None,
    require_mac: bool = False,
) -> tuple[Layout, bytes, dict[str, Any]]:
    """Read one rank's snapshot of a complete step, checked against its manifest and COMPLETE.json
    (and, with ``mac_key``, against its MACs: ``authentic``; the manifest then says
    ``authentic`` True, or False for a step written without MACs, refused with ``require_mac``).

    COMPLETE.json, the manifest and (with ``mac_key``) their MACs are checked before the data file
    is downloaded, and the file's size against what they declare: a planted file, however large,
    is refused without a byte of it read (issue 43, F7).

    Args:
        verify: also check every tensor's crc32 (2+ GB/s; skip only when the bytes are re-checked).
        complete: the step's COMPLETE.json if already read.
        require_complete: when False (inspecting a partial step), a rank is read without the
            COMPLETE.json cross-check; restore must never pass False.
        require_mac: only a step whose MACs verify under ``mac_key`` is read; without a key, none
            is (``--require-auth`` never restores what it could not check).

    Returns:
        ``(layout, snapshot bytes, manifest)``; the bytes are a valid safetensors file.

    Raises:
        CheckpointNotFoundError: the step is not complete or has no such rank.
        CheckpointCorruptError: naming the file and, for a checksum mismatch, the tensor; a step
            that carries no MACs (or no key to check them) with ``require_mac``.
        StorageError: storage failed.
    """
    _refuse_unchecked(step, mac_key, require_mac)
    if mac_key is not None and complete is None:
        complete = read_complete(storage, step)
    manifest, manifest_raw = _read_manifest(storage, step, rank, complete, require_complete)
    key, file_bytes = data_key(step, rank), manifest["file_bytes"]
    signed = False
    if mac_key is not None and complete is not None:
        signed = _check_signed(mac_key, complete, step, rank, manifest_raw, key, require_mac)
    _checked_size(storage, key, file_bytes)  # before the download, so a replaced file is not fetched
    try:
        data = storage.get(key)
    except StorageNotFoundError:
        raise CheckpointCorruptError(f"{key} named by its manifest is missing") from None
    if len(data) != file_bytes:
        raise CheckpointCorruptError(f"{key} is {len(data)} bytes but its manifest says {file_bytes}")
    layout = _parse(data, len(data), key)
    m.check_layout(layout, manifest, where=key)
    if verify:
        m.check_tensor_crcs(layout, data, manifest, where=key)
    if mac_key is not None and complete is not None:
        if signed:
            authentic.check_file(mac_key, rank, manifest, data, key)
        manifest["authentic"] = signed
    return layout, data, manifest


def read_rank_ranges(
    storage: Storage,
    step: int,
    rank: int,
    select: Selection,
    into: Callable[[int], memoryview],
    *,
    complete: dict[str, Any] | None = None,
    mac_key: bytes | None = None,
    require_mac: bool = False,
) -> tuple[Layout, dict[str, Any], int]:
    """Read only the bytes of one rank's snapshot that ``select`` names (its header always), each
    chunk read checked against the crc32 (and, with ``mac_key``, the GMAC) its manifest records.

    Args:
        into: given the file's size, the buffer the bytes go to at their file offsets (a sparse
            one: the rest is left as it is).

    Returns:
        ``(layout, manifest, bytes read)``. A step written before manifests carried chunk
        checksums is read whole (``read_rank``) and copied in: correct, just not ranged.

    Raises:
        As ``read_rank``; a chunk that fails its checks is a CheckpointCorruptError naming it.
    """
    _refuse_unchecked(step, mac_key, require_mac)
    complete = read_complete(storage, step) if complete is None else complete
    manifest, manifest_raw = _read_manifest(storage, step, rank, complete, True)
    key, file_bytes = data_key(step, rank), manifest["file_bytes"]
    checker = None
    if mac_key is not None:
        manifest["authentic"] = _check_signed(mac_key, complete, step, rank, manifest_raw, key, require_mac)
        if manifest["authentic"] and authentic.has_chunk_tags(manifest):
            checker = authentic.ChunkChecker(mac_key, manifest, key)
    if "chunks" not in manifest or (manifest.get("authentic") and checker is None):
        layout, data, manifest = read_rank(
            storage, step, rank, complete=complete, mac_key=mac_key, require_mac=require_mac
        )
        target = into(len(data))
        target[:] = data
        return layout, manifest, len(data)
    _checked_size(storage, key, file_bytes)
    chunks, crcs = m.manifest_chunks(manifest), manifest["chunks"]["crc32"]
    target = into(file_bytes)
    done: set[int] = set()
    nbytes = _read_chunks(storage, key, [chunks[0]], chunks, crcs, checker, target, done)
    layout = _parse(bytes(target[: chunks[0][1]]), file_bytes, key)
    m.check_layout(layout, manifest, where=key)
    nbytes += _read_chunks(storage, key, select.ranges(layout), chunks, crcs, checker, target, done)
    return layout, manifest, nbytes


def _read_chunks(
    storage: Storage,
    key: str,
    ranges: list[tuple[int, int]],
    chunks: list[tuple[int, int]],
    crcs: list[int],
    checker: authentic.ChunkChecker | None,
    target: memoryview,
    done: set[int],
) -> int:
    """Read the chunks overlapping ``ranges`` but not in ``done`` (runs of adjacent chunks, one
    range each, ``Storage.get_ranges``), check each and copy it into ``target``; add them to ``done``.
    Returns the bytes read."""
    starts = [begin for begin, _ in chunks]
    indices: set[int] = set()
    for begin, end in ranges:
        first = max(0, bisect.bisect_right(starts, begin) - 1)
        last = bisect.bisect_left(starts, end)
        indices.update(i for i in range(first, last) if chunks[i][1] > begin and chunks[i][1] > chunks[i][0])
    todo = sorted(indices - done)
    done.update(todo)
    runs: list[tuple[int, int]] = []
    for index in todo:
        if runs and runs[-1][1] == index and chunks[index - 1][1] == chunks[index][0]:
            runs[-1] = (runs[-1][0], index + 1)
        else:
            runs.append((index, index + 1))

    spans = [(chunks[first][0], chunks[last - 1][1]) for first, last in runs]
    try:
        found = storage.get_ranges(key, spans)
    except StorageNotFoundError:
        raise CheckpointCorruptError(f"{key} named by its manifest is missing") from None
    for (first, last), (begin, end), data in zip(runs, spans, found, strict=True):
        if len(data) != end - begin:
            raise CheckpointCorruptError(f"{key}: bytes {begin}..{end} came back {len(data)} bytes long (truncated)")
        view = memoryview(data)
        for index in range(first, last):
            piece = view[chunks[index][0] - begin : chunks[index][1] - begin]
            if crc32(piece) != crcs[index]:
                raise CheckpointCorruptError(f"{key}: chunk {index} (bytes {chunks[index][0]}..) fails its crc32")
            if checker is not None:
                checker.check(index, piece)
        target[begin:end] = view
    return sum(end - begin for begin, end in spans)


# -- helpers ---------------------------------------------------------------------------------------
def _refuse_unchecked(step: int, mac_key: bytes | None, require_mac: bool) -> None:
    """``require_mac`` without a key: nothing could be checked, so nothing is read (issue 43, F1)."""
    if require_mac and mac_key is None:
        raise CheckpointCorruptError(
            f"step {step} is not restored: --require-auth, but there is no job secret from outside the store "
            "to check its MACs with (it may be unsigned, or signed under a key this reader lacks)",
            hint="give the job secret the checkpoint was written under (--job-secret-file or RESILRUN_JOB_SECRET)",
        )


def _check_signed(
    mac_key: bytes, complete: dict[str, Any], step: int, rank: int, manifest_raw: bytes, where: str, require_mac: bool
) -> bool:
    """COMPLETE.json's MAC and the manifest's hash (needing none of the data file); whether the
    step carries MACs at all, refused when ``require_mac`` and it does not."""
    signed = authentic.check_manifest(mac_key, complete, rank, manifest_raw, where)
    if require_mac and not signed:
        raise CheckpointCorruptError(
            f"step {step} carries no MAC: it cannot be told from a forgery (--require-auth)",
            hint="a job without a job secret from outside the store wrote it; restore it without --require-auth",
        )
    return signed


def _read_manifest(
    storage: Storage, step: int, rank: int, complete: dict[str, Any] | None, require_complete: bool
) -> tuple[dict[str, Any], bytes]:
    if complete is None and require_complete:
        complete = read_complete(storage, step)
    key = manifest_key(step, rank)
    if complete is not None:
        world_size = complete["world_size"]
        if not 0 <= rank < world_size:
            raise CheckpointNotFoundError(f"step {step} has ranks 0..{world_size - 1}, not rank {rank}")
        expected = complete["ranks"][str(rank)]
        raw = _get_small(storage, key, m.MAX_MANIFEST_BYTES, missing=CheckpointCorruptError)
        if crc32(raw) != expected["manifest_crc32"]:
            raise CheckpointCorruptError(f"{key} does not match the checksum recorded in {COMPLETE_NAME}")
        manifest = m.parse_manifest(raw, step, rank, world_size, where=key)
        if manifest["file_bytes"] != expected["file_bytes"]:
            raise CheckpointCorruptError(f"{key} and {COMPLETE_NAME} disagree on the file size")
        return manifest, raw
    raw = _get_small(storage, key, m.MAX_MANIFEST_BYTES, missing=CheckpointNotFoundError)
    return m.parse_manifest(raw, step, rank, None, where=key), raw


def _checked_size(storage: Storage, key: str, file_bytes: int) -> int:
    try:
        size = storage.size(key)
    except StorageNotFoundError:
        raise CheckpointCorruptError(f"{key} named by its manifest is missing") from None
    if size != file_bytes:
        raise CheckpointCorruptError(f"{key} is {size} bytes, its manifest says {file_bytes} (truncated or replaced)")
    return size


def _get_small(storage: Storage, key: str, limit: int, *, missing: type[CheckpointError]) -> bytes:
    """Download a JSON object, refusing (before the download) one larger than ``limit``."""
    try:
        size = storage.size(key)
        if size > limit:
            raise CheckpointCorruptError(f"{key} is {size} bytes, more than the {limit} a valid one can be")
        return storage.get(key)
    except StorageNotFoundError:
        raise missing(f"{key} does not exist") from None


def _parse(prefix: bytes, size: int, key: str) -> Layout:
    try:
        return parse_header(prefix, size)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"{key}: {exc.message}") from None


def _parallel(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    work = list(items)
    if len(work) <= 1:
        return [fn(item) for item in work]
    pool = ThreadPoolExecutor(max_workers=min(_READ_CONCURRENCY, len(work)))
    try:
        return list(pool.map(fn, work))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # the first failure ends the work at once
