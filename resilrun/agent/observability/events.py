"""The agent's structured event log: one JSON object per line in ``<log-dir>/<run-id>/events.jsonl``.

Why a file of its own: operators and tools grep and parse what happened (a failure, a spare promoted,
state transferred, recovered, a snapshot persisted, a restart, a node lost, the exit) without
scraping human log lines. Every record has the same envelope::

    {"event": str, "time": ISO-8601 UTC, "wall": unix seconds, "mono": this agent's monotonic seconds,
     "node_id": str, "host": str, "node_rank": int | null, ...event fields}

``wall`` is for people and for lining up nodes; durations are measured on monotonic clocks and
carried in ``*_s`` fields. Several agents of one job on one machine share the run's log directory,
so each line is written with a single ``write`` on a file opened for appending (POSIX keeps such
appends whole), and flushed at once: the log is complete up to the moment an agent is killed.

Thread-safe: the supervisor, the channel's threads and the persister all record events.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from resilrun.errors import ConfigError
from resilrun.private_file import open_private_output

logger = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"

# The kinds an agent writes; docs/status.md describes each one's fields.
KINDS = (
    "agent_started",
    "round_started",
    "failure_detected",
    "hang_detected",
    "spare_exited",
    "spare_promoted",
    "generation_entered",
    "state_transferred",
    "collectives_rebuilt",
    "first_step",
    "recovered",
    "snapshot_persisted",
    "snapshot_interval",
    "replica_behind",
    "replica_caught_up",
    "replica_dropped",
    "straggler_detected",
    "straggler_cleared",
    "straggler_swapped",
    "straggler_swap_skipped",
    "device_unhealthy",
    "restart",
    "node_lost",
    "file_captured",
    "captured_restored",
    "exit",
)

Listener = Callable[[dict[str, Any]], None]


class EventLog:
    """Appends events to a JSONL file (or nowhere) and hands each record to listeners."""

    def __init__(self, path: Path | None, *, node_id: str, host: str) -> None:
        self.path = path
        self.node_id = node_id
        self.host = host
        self.node_rank: int | None = None
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self._fd: int | None = None
        self._failed = False
        if path is not None:
            try:
                # 0600: the events name hosts, addresses, pids and failures (tracebacks' first lines);
                # never through a link planted at the path (it would append to the link's target)
                self._fd = open_private_output(path, append=True)
            except ConfigError as exc:
                logger.warning("cannot write events: %s", exc.message)
            except OSError as exc:
                logger.warning("cannot write events to %s: %s", path, exc.strerror)

    def add_listener(self, listener: Listener) -> None:
        """``listener(record)`` runs on the recording thread after the line is written: keep it short."""
        self._listeners.append(listener)

    def record(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event; returns the record. Never raises for I/O (the job matters more than its log)."""
        if event not in KINDS:
            raise ValueError(f"unknown event kind {event!r}")
        wall = time.time()
        record: dict[str, Any] = {
            "event": event,
            "time": datetime.fromtimestamp(wall, timezone.utc).isoformat(timespec="milliseconds"),
            "wall": round(wall, 6),
            "mono": round(time.monotonic(), 6),
            "node_id": self.node_id,
            "host": self.host,
            "node_rank": self.node_rank,
            **fields,
        }
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                try:
                    os.write(self._fd, line)
                except OSError as exc:
                    if not self._failed:
                        logger.warning("cannot write events to %s: %s", self.path, exc.strerror)
                    self._failed = True
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # noqa: BLE001 - a sink's bug must not break the agent loop
                logger.exception("event listener failed on %s", event)
        return record

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def read_events(path: Path) -> list[dict[str, Any]]:
    """Parse an events file (tests and tools); a torn last line (agent killed mid-write) is skipped."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
