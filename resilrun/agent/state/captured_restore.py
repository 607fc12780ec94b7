"""Putting a captured folder back before a round's workers start: plan from every tier, then write.

The plan: the newest version of each captured path that this node's memory, any peer of the round
(``list_files``) or the persistent tier (signed versions only: the script will unpickle them) lists;
then DCP checkpoint folders whose ``.metadata`` names a shard no tier holds are hidden. The
execution: each version not already in place is read from the fastest tier that has an intact
copy (memory, then the peers listing it, then storage) and written atomically into the folder with
its writer's mtime, so that a second restore, or the watch seeing the rename, finds it in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from resilrun.errors import CheckpointError, ResilrunError, StorageError
from resilrun.storage.api import Storage
from resilrun.tiers.captured import durable
from resilrun.tiers.captured.catalog import AGENT_PREFIX, Catalog, FileVersion, check_path
from resilrun.tiers.peer.files import fetch_file, list_files
from resilrun.tiers.peer.wire import Credential

logger = logging.getLogger(__name__)

# DCP writes a checkpoint folder's .metadata last, naming its shard files (``__<rank>_<n>.distcp``).
DCP_METADATA = ".metadata"
_DCP_SHARD = re.compile(rb"__\d+_\d+\.distcp")
_LIST_TIMEOUT = timedelta(seconds=10)


@dataclass
class Restored:
    """What one restore wrote into the folder (the ``captured_restored`` event's fields)."""

    files: list[str] = field(default_factory=list)
    nbytes: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # tier -> files
    missing: list[str] = field(default_factory=list)  # newest versions no tier could give
    incomplete: list[str] = field(default_factory=list)  # DCP folders missing a shard: hidden
    seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class _Candidate:
    """The newest version of a path, and where it is listed."""

    version: FileVersion
    peers: tuple[str, ...]  # replica servers listing it
    stored: bool  # in the persistent tier, signed


class FolderRestore:
    """The restore of one captured folder (see the module); ``run`` under the folder's lock."""

    def __init__(
        self,
        root: Path,
        catalog: Catalog,
        wanted: Callable[[str], bool],
        *,
        secret: Credential | None,
        peers: Callable[[], list[str]],
        storage: Storage | None,
        mac_key: bytes | None,
    ) -> None:
        self.root = root
        self.catalog = catalog
        self._wanted = wanted
        self._secret = secret
        self._peers = peers
        self._storage = storage
        self._mac_key = mac_key
        self._unsigned_warned = False

    def run(self, deadline: float) -> Restored:
        report = Restored()
        candidates = self._candidates()
        fetched: dict[str, tuple[str, bytes] | None] = {}
        report.incomplete = self._incomplete_dcp(candidates, fetched, deadline)
        for path, candidate in sorted(candidates.items()):
            if posixpath.basename(path) == DCP_METADATA and posixpath.dirname(path) in report.incomplete:
                continue
            if self._in_place(candidate.version):
                continue
            got = fetched[path] if path in fetched else self._fetch(candidate, deadline)
            if got is None:
                report.missing.append(path)
                continue
            tier, data = got
            try:
                self._write(candidate.version, data)
            except (OSError, CheckpointError) as exc:
                logger.error("captured %s could not be put back in %s: %s", path, self.root, exc)
                report.missing.append(path)
                continue
            self.catalog.put(candidate.version, data, own=False)
            report.files.append(path)
            report.nbytes += len(data)
            report.sources[tier] = report.sources.get(tier, 0) + 1
        return report

    def _incomplete_dcp(
        self, candidates: dict[str, _Candidate], fetched: dict[str, tuple[str, bytes] | None], deadline: float
    ) -> list[str]:
        """DCP checkpoint folders whose ``.metadata`` names a shard no tier holds: the host that
        wrote the shard was lost before it was replicated. Its ``.metadata`` is then not put back,
        and this node's own is moved aside (``.resilrun-incomplete.metadata``), so that a script
        looking for the newest folder with a ``.metadata`` takes the one before, which loads.

        The names are read from the ``.metadata`` bytes as text (DCP names its files
        ``__<rank>_<n>.distcp``), never unpickled: it is the script's file, not ours to run."""
        incomplete = []
        for path, candidate in sorted(candidates.items()):
            if posixpath.basename(path) != DCP_METADATA:
                continue
            fetched[path] = got = self._fetch(candidate, deadline)
            if got is None:
                continue
            folder = posixpath.dirname(path)
            shards = {name.decode() for name in _DCP_SHARD.findall(got[1])}
            lost = sorted(n for n in shards if posixpath.join(folder, n) not in candidates)
            if not lost:
                continue
            incomplete.append(folder)
            logger.warning(
                "DCP checkpoint %s is incomplete: no tier holds %s (its host was lost before they were "
                "replicated); it is hidden from the script (its .metadata moved aside)",
                self.root / folder,
                ", ".join(lost),
            )
            local = self.root / path
            if local.is_file():
                with contextlib.suppress(OSError):
                    os.replace(local, local.parent / f"{AGENT_PREFIX}incomplete{DCP_METADATA}")
            self.catalog.remove(path)
        return incomplete

    def _candidates(self) -> dict[str, _Candidate]:
        """The newest version of each path any tier lists, and where it is listed."""
        found: dict[str, _Candidate] = {}

        def offer(version: FileVersion, peer: str | None = None, stored: bool = False) -> None:
            if not self._wanted(version.path):
                return
            held = found.get(version.path)
            if held is None or version.order > held.version.order:
                found[version.path] = _Candidate(version, (peer,) if peer else (), stored)
            elif version.order == held.version.order:
                peers = held.peers + ((peer,) if peer else ())
                found[version.path] = _Candidate(held.version, peers, held.stored or stored)

        for version in self.catalog.versions():
            offer(version)
        if self._secret is not None:
            for address in self._peers():
                try:
                    listed = list_files(address, self._secret, _LIST_TIMEOUT)
                except ResilrunError as exc:
                    logger.info("peer %s not asked for captured files: %s", address, exc.message)
                    continue
                for version in listed:
                    offer(version, peer=address)
        if self._storage is not None:
            try:
                stored = durable.listed(self._storage, self._mac_key)
            except (StorageError, CheckpointError) as exc:
                logger.warning("captured files in the persistent tier not listed: %s", exc.message)
                stored = []
            unsigned = [s for s in stored if not s.signed]
            if unsigned and not self._unsigned_warned:
                self._unsigned_warned = True
                logger.warning(
                    "%d captured file(s) in the persistent tier carry no valid MAC under this job's secret and are "
                    "not restored (the script would unpickle them)%s",
                    len(unsigned),
                    "" if self._mac_key is not None else ": give the job a --job-secret-file to sign and restore them",
                )
            for item in stored:
                if item.signed:
                    offer(item.version, stored=True)
        return found

    def _in_place(self, version: FileVersion) -> bool:
        try:
            found = os.lstat(self.root / version.path)
        except OSError:
            return False
        return stat.S_ISREG(found.st_mode) and (found.st_size, found.st_mtime_ns) == (version.size, version.mtime_ns)

    def _fetch(self, candidate: _Candidate, deadline: float) -> tuple[str, bytes] | None:
        version = candidate.version
        held = self.catalog.read(version.path, version.sha256)
        if held is not None:
            return "memory", held[1]
        for address in candidate.peers:
            left = deadline - time.monotonic()
            if left <= 0 or self._secret is None:
                break
            try:
                return "peer", fetch_file(address, self._secret, version, timedelta(seconds=left))
            except ResilrunError as exc:
                logger.warning("peer %s could not give captured %s: %s", address, version.path, exc.message)
        if candidate.stored and self._storage is not None:
            try:
                return "persistent", durable.read(self._storage, version)
            except (StorageError, CheckpointError) as exc:
                logger.warning("the persistent tier could not give captured %s: %s", version.path, exc.message)
        return None

    def _write(self, version: FileVersion, data: bytes) -> None:
        """Atomically, inside the folder only, with the version's mtime (so it reads as in place)."""
        target = self.root / check_path(version.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        root = os.path.realpath(self.root)
        if os.path.commonpath([root, os.path.realpath(target.parent)]) != root:
            raise CheckpointError(f"{version.path} would be written outside the folder (a link on its way)")
        temporary = target.parent / f"{AGENT_PREFIX}{target.name}.{os.getpid()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.utime(temporary, ns=(version.mtime_ns, version.mtime_ns))
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
