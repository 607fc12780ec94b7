"""The agent side of the worker channel: a Unix socket the node's workers talk to.

It serves the tier-1 requests (attach to the rank's buffers, allocate a slot, commit a step),
heartbeats and the in-process recovery handshakes. It hands out file descriptors of node memory,
so it must refuse strangers. Three layers, each enough against a different stranger:

- the socket lives in a private directory (mode 0700): other users cannot even connect;
- the kernel-attested peer uid (``SO_PEERCRED``) must be the agent's own, so a loosened directory
  (or a process that kept an old path) still gets nothing;
- the first message must carry this agent's token (32 random bytes, hex), which the agent puts
  only in the environment of the workers it spawns (``RESILRUN_AGENT_TOKEN``). This refuses a
  process of the same user that is not one of this agent's workers: another job's worker holding a
  stale socket path, a script run by hand, a probe. (A same-user process that reads a worker's
  /proc/PID/environ can get the token; within one uid there is no boundary to defend: it could
  ptrace the agent too.)

A refused connection gets one ``{"ok": false, "error": ...}`` and is closed; it is logged once per
reason. The socket is removed when the agent stops.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from pathlib import Path
from typing import Any

from resilrun import wire
from resilrun.agent.control import WorkerControl
from resilrun.agent.telemetry import Telemetry
from resilrun.agent.tiers import NodeTiers
from resilrun.errors import ResilrunError
from resilrun.snapshot.dedup import parse_borrowed, parse_shared
from resilrun.snapshot.selection import Selection
from resilrun.tiers.memory import NodeMemoryTier

logger = logging.getLogger(__name__)


class HandedFd(int):
    """A descriptor made for one reply: the channel closes it once sent (the worker has its own)."""


TOKEN_ENV = "RESILRUN_AGENT_TOKEN"
# A worker sends its token as its very first message, right after connecting; a peer that has not
# done so within this long is not a worker (the agent answers from memory in microseconds).
AUTH_TIMEOUT_S = 10.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class AgentChannel:
    """Accepts worker connections and answers their requests, one thread per worker."""

    def __init__(
        self, memory: NodeMemoryTier, tiers: NodeTiers, control: WorkerControl, telemetry: Telemetry | None = None
    ) -> None:
        """``telemetry``: where commits and the workers' recovery milestones are reported (none: nowhere)."""
        self.memory = memory
        self.tiers = tiers
        self.control = control
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.token = secrets.token_hex(32)
        self._refusals: set[str] = set()
        self._dir = Path(tempfile.mkdtemp(prefix="resilrun-agent-"))  # mode 0700
        self.path = str(self._dir / "agent.sock")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(64)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="resilrun-channel", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="resilrun-channel-conn", daemon=True).start()

    def _authenticate(self, conn: socket.socket) -> bool:
        """The peer's uid (from the kernel) and its first message (the token) decide; see the module."""
        try:
            _, uid, _ = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            # The first message is read before any verdict, so that a refused client reads the reason
            # instead of a broken pipe; descriptors it may have sent are closed unread.
            conn.settimeout(AUTH_TIMEOUT_S)
            hello, fds = wire.receive(conn)
            conn.settimeout(None)
        except (wire.ChannelError, OSError):
            return False
        for fd in fds:
            os.close(fd)
        if uid != os.getuid():
            return self._refuse(conn, f"uid {uid} is not the agent's")
        token = hello.get("token")
        if hello.get("op") != "auth" or not isinstance(token, str):
            return self._refuse(conn, "no agent token")
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            return self._refuse(conn, "a wrong agent token")
        try:
            wire.send(conn, {"ok": True})
        except OSError:
            return False
        return True

    def _refuse(self, conn: socket.socket, why: str) -> bool:
        if why not in self._refusals:  # once per reason: a prober must not flood the agent's log
            self._refusals.add(why)
            logger.warning("refused a worker-channel connection: %s", why)
        with contextlib.suppress(OSError):
            wire.send(conn, {"ok": False, "error": f"refused: {why}"})
        return False

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if not self._authenticate(conn):
                return
            while not self._closed.is_set():
                try:
                    request, _ = wire.receive(conn)
                except (wire.ChannelError, OSError):
                    return
                try:
                    response, fds = self.handle(request)
                except ResilrunError as exc:
                    response = {"ok": False, "error": exc.message, "hint": exc.hint, "code": type(exc).__name__}
                    fds = []
                except (KeyError, TypeError, ValueError) as exc:
                    response, fds = {"ok": False, "error": f"bad request: {exc}"}, []
                try:
                    wire.send(conn, response, fds)
                except OSError:
                    return
                finally:
                    for fd in fds:
                        if isinstance(fd, HandedFd):
                            os.close(fd)

    def handle(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """One request -> (response, fds to pass)."""
        op = request["op"]
        if op == "attach":
            rank = int(request["rank"])
            memory = self.memory.rank(rank)
            present = [i for i, buffer in enumerate(memory.slots) if buffer is not None]
            fds = [memory.ctl.fd] + [memory.slots[i].fd for i in present]  # type: ignore[union-attr]
            return {"ok": True, "slots": len(memory.slots), "present": present, **self.memory.describe(rank)}, fds
        if op == "alloc":
            rank = int(request["rank"])
            buffer = self.memory.allocate(rank, int(request["slot"]), int(request["nbytes"]))
            if buffer is None:  # no room for the ring's extra slot: the worker uses the smaller ring
                return {"ok": True, "slots": len(self.memory.rank(rank).slots)}, []
            return {"ok": True}, [buffer.fd]
        if op == "commit":
            if "pid" in request:
                self.control.report_step(int(request["pid"]), int(request["step"]))
            rank, step, nbytes = int(request["rank"]), int(request["step"]), int(request["nbytes"])
            whole = self.memory.commit(
                rank,
                step,
                int(request["slot"]),
                nbytes,
                request.get("values"),
                parse_borrowed(request.get("borrowed"), rank, nbytes),
                int(request.get("layout", 0)),
                parse_shared(request.get("shared"), rank, nbytes),
                int(request.get("round", -1)),
                previous=int(request["previous"]) if "previous" in request else None,
                replicate=bool(request["replicate"]) if "replicate" in request else None,
            )
            # The answer waits for the replicas to catch up (peer.py's commit gate): the worker reads
            # it only before its next snapshot, so this costs training time only when they lag.
            self.memory.pass_gates(rank, step)
            copy_s = request.get("copy_s")
            copied = int(request.get("copied", nbytes))  # less than nbytes when the snapshot borrows
            self.telemetry.committed(rank, step, copied, None if copy_s is None else float(copy_s))
            return {"ok": True, "whole": whole, "next": self.memory.next_slot(rank)}, []
        if op == "report":
            # A worker's recovery milestone (state restored, collectives rebuilt, first step done).
            self.telemetry.worker_report(int(request["pid"]), request)
            return {"ok": True}, []
        if op == "finished":
            self.control.finished(int(request["pid"]))
            return {"ok": True}, []
        if op == "beat":
            self.control.beat(int(request["pid"]))
            if int(request.get("step", -1)) >= 0:
                self.control.report_step(int(request["pid"]), int(request["step"]))
            return {"ok": True}, []
        if op == "hello_api":
            self.control.register_api(int(request["pid"]))
            return {"ok": True}, []
        if op == "await_assignment":
            env = self.control.await_assignment(int(request["pid"]), float(request["timeout_s"]))
            return {"ok": True, "env": env}, []
        if op == "await_generation":
            env = self.control.await_generation(
                int(request["pid"]), int(request["round"]), float(request["timeout_s"]), bool(request.get("raised"))
            )
            return {"ok": True, "env": env}, []
        if op == "restore_info":
            return {"ok": True, **self.tiers.restore_info(int(request["rank"]), int(request["world_size"]))}, []
        if op == "lend":
            borrowed, buffers = self.tiers.lend(int(request["rank"]), int(request["step"]))
            owners = sorted(buffers)
            return {"ok": True, "borrowed": [list(r) for r in borrowed], "owners": owners}, [
                buffers[owner].fd for owner in owners
            ]
        if op == "inventory":
            return {"ok": True, **self.tiers.inventory()}, []
        if op == "fetch":
            info = self.tiers.fetch(int(request["rank"]), int(request["step"]), str(request["tier"]))
            return {"ok": True, **info}, []
        if op == "peek":
            info = self.tiers.peek(int(request["rank"]), int(request["step"]), int(request["world_size"]))
            return {"ok": True, **info}, []
        if op == "gather_ranges":
            select = Selection.from_message(request["select"])
            info, fd = self.tiers.gather_ranges(
                int(request["rank"]), int(request["step"]), int(request["world_size"]), select
            )
            return {"ok": True, **info}, [] if fd is None else [HandedFd(fd)]
        raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def channel_env(channel: AgentChannel) -> dict[str, str]:
    """What a worker needs to reach this channel: its path and the token."""
    return {"RESILRUN_AGENT_SOCKET": channel.path, TOKEN_ENV: channel.token}
