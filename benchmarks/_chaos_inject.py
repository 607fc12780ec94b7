"""Mechanics of the chaos run: nodes as process trees, and the faults that need more than a signal.

- ``Node``: one resilrun agent with its stderr stamped on arrival and every descendant remembered
  (by pid and create time, so a reused pid is never hit), killable as a whole (a node going away).
- ``corrupt_replicas``: flips bytes inside the replicas another node holds for a lost node's ranks.
  Replicas live in memfds of the holding agent; the harness (same uid) opens them through
  ``/proc/PID/fd`` and writes: the same thing a bad DIMM or a stray write does, no hook in resilrun.
- ``limit_memory``: makes a running agent's next node-memory allocations fail, by lowering its
  RLIMIT_FSIZE (prlimit): growing a memfd past the limit fails with EFBIG, as a full memory cgroup
  fails with ENOMEM. Reversible (the hard limit is untouched), so "memory freed later" is testable.
- ``memfd_holders`` / ``shm_files``: what shared memory a run left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import signal
import struct
import subprocess
import threading
import time
from pathlib import Path

import psutil


class Node:
    """One agent process (its own session) and everything it ever spawned."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path, cwd: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self.log = log
        self._sink = log.open("w", encoding="utf-8")
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            text=True, start_new_session=True, cwd=cwd,
        )  # fmt: skip
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.lost = False
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.lines.append((time.time(), line.rstrip("\n")))
            self._sink.write(line)
            self._sink.flush()
        self._sink.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def text(self, since: float = 0.0) -> str:
        return "\n".join(line for at, line in list(self.lines) if at >= since)

    def first(self, needle: str, since: float) -> float | None:
        """Arrival time of the first line containing ``needle`` at or after ``since``."""
        return next((at for at, line in list(self.lines) if at >= since and needle in line), None)

    def track(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault((child.pid, child.create_time()), child)
        return list(self.seen.values())

    def workers(self) -> list[psutil.Process]:
        """Live direct children (workers and hot spares)."""
        with contextlib.suppress(psutil.Error):
            return [p for p in psutil.Process(self.pid).children() if p.status() != psutil.STATUS_ZOMBIE]
        return []

    def kill_tree(self) -> list[psutil.Process]:
        """SIGKILL the agent and all its processes at once; returns the victims."""
        victims = [psutil.Process(self.pid), *self.track()]
        for proc in victims:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        self.lost = True
        return victims

    def stop(self) -> int:
        """Kill what is left of this node; returns how many processes were still alive."""
        left = alive([psutil.Process(self.pid)] if self.proc.poll() is None else []) + alive(self.track())
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._pump_thread.join(timeout=5)
        return len(left)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes still running (the same pid and create time; zombies count as gone)."""
    living = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                living.append(proc)
    return living


def memfds(pid: int) -> list[tuple[int, str]]:
    """(fd, memfd name) of every memfd the process holds."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{entry}")
                if target.startswith("/memfd:"):
                    found.append((int(entry), target.removeprefix("/memfd:").removesuffix(" (deleted)")))
    return found


def node_ranks(pid: int, run_id: str) -> set[int]:
    """Global ranks whose node memory this agent holds (one control page per rank)."""
    pattern = re.compile(rf"^resilrun-{re.escape(run_id)}-r(\d+)-ctl$")
    return {int(m.group(1)) for _, name in memfds(pid) if (m := pattern.match(name))}


def corrupt_replicas(pid: int, run_id: str, ranks: set[int]) -> int:
    """Flip bytes in the header of every replica ``pid`` holds for ``ranks``; returns how many.

    The header: a replica's DDP-equal tensors may be held by reference to the holder's own
    snapshot (not in the replica's buffer until it is read), so only the header and each rank's
    own tensors are surely the replica's bytes at rest; the header is the one found without
    knowing which tensors are whose."""
    pattern = re.compile(rf"^resilrun-{re.escape(run_id)}-replica-r(\d+)-s\d+$")
    corrupted = 0
    seen: set[int] = set()
    for fd, name in memfds(pid):
        match = pattern.match(name)
        if not match or int(match.group(1)) not in ranks:
            continue
        try:
            inode = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
            if inode in seen:  # the same memfd under a second descriptor: flipping twice would undo it
                continue
            seen.add(inode)
            with open(f"/proc/{pid}/fd/{fd}", "r+b", buffering=0) as handle:
                head = handle.read(8)
                if len(head) < 8:
                    continue
                header_bytes = struct.unpack("<Q", head)[0]
                size = os.fstat(handle.fileno()).st_size
                if header_bytes < 48 or 8 + header_bytes > size:
                    continue
                handle.seek(8 + 16)
                chunk = handle.read(32)
                handle.seek(8 + 16)
                handle.write(bytes(b ^ 0xFF for b in chunk))
                corrupted += 1
        except OSError:
            continue
    return corrupted


def limit_memory(pid: int, limit_bytes: int | None) -> None:
    """Cap (or, with None, uncap) the size the agent can grow a memfd to; see the module docstring."""
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        _, hard = proc.rlimit(resource.RLIMIT_FSIZE)
        proc.rlimit(resource.RLIMIT_FSIZE, (hard if limit_bytes is None else limit_bytes, hard))


def memfd_holders(run_id: str) -> dict[int, int]:
    """pid -> how many memfds of this run it holds, over every process on the machine."""
    holders = {}
    for pid in psutil.pids():
        count = sum(1 for _, name in memfds(pid) if name.startswith(f"resilrun-{run_id}-"))
        if count:
            holders[pid] = count
    return holders


def shm_files() -> set[str]:
    """Files named resilrun* in /dev/shm (resilrun itself uses memfds: there should be none)."""
    with contextlib.suppress(OSError):
        return {name for name in os.listdir("/dev/shm") if name.startswith("resilrun")}
    return set()


def stop_process(proc: psutil.Process) -> None:
    """SIGSTOP: the process stays, frozen (a hang the agent must detect and clear)."""
    with contextlib.suppress(psutil.Error):
        proc.send_signal(signal.SIGSTOP)
