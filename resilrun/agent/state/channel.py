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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilrun import channel_protocol as proto
from resilrun import wire
from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.state.commits import CommitPipeline
from resilrun.agent.state.tiers import NodeTiers
from resilrun.agent.workers.control import WorkerControl
from resilrun.channel_protocol import Request
from resilrun.errors import ResilrunError
from resilrun.snapshot.selection import Selection
from resilrun.tiers.memory import NodeMemoryTier

logger = logging.getLogger(__name__)


# A handler's answer: the reply and the descriptors handed with it.
Answer = tuple[proto.Reply, list[int]]


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
        self,
        memory: NodeMemoryTier,
        tiers: NodeTiers,
        control: WorkerControl,
        telemetry: Telemetry | None = None,
        *,
        commits: CommitPipeline | None = None,
    ) -> None:
        """``telemetry``: where commits and the workers' recovery milestones are reported (none:
        nowhere); ``commits``: what a commit goes through (none: recorded and counted only, no
        replicas or persistence)."""
        self.memory = memory
        self.tiers = tiers
        self.control = control
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        self.commits = commits if commits is not None else CommitPipeline(memory, control, self.telemetry)
        self.token = secrets.token_hex(32)
        self._handlers = self._dispatch_table()
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
        try:
            auth = proto.parse_request(hello)
        except (ValueError, TypeError):
            return self._refuse(conn, "no agent token")
        token = auth.token if isinstance(auth, proto.Auth) else None
        if not isinstance(token, str):
            return self._refuse(conn, "no agent token")
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            return self._refuse(conn, "a wrong agent token")
        try:
            wire.send(conn, proto.Ack().to_message())
        except OSError:
            return False
        return True

    def _refuse(self, conn: socket.socket, why: str) -> bool:
        if why not in self._refusals:  # once per reason: a prober must not flood the agent's log
            self._refusals.add(why)
            logger.warning("refused a worker-channel connection: %s", why)
        with contextlib.suppress(OSError):
            wire.send(conn, proto.Refused(f"refused: {why}").to_message())
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
                answer: proto.Reply | proto.Refused
                try:
                    answer, fds = self.handle(proto.parse_request(request))
                except ResilrunError as exc:
                    answer, fds = proto.Refused(exc.message, exc.hint, type(exc).__name__), []
                except (KeyError, TypeError, ValueError) as exc:
                    answer, fds = proto.Refused(f"bad request: {exc}"), []
                try:
                    wire.send(conn, answer.to_message(), fds)
                except OSError:
                    return
                finally:
                    for fd in fds:
                        if isinstance(fd, HandedFd):
                            os.close(fd)

    def handle(self, request: Request[Any]) -> Answer:
        """One request -> (its reply, fds to pass), by the handler its type names."""
        return self._handlers[type(request)](request)

    def _dispatch_table(self) -> dict[type[Request[Any]], Callable[[Any], Answer]]:
        return {
            proto.Attach: self._attach,
            proto.Alloc: self._alloc,
            proto.Commit: self._commit,
            proto.Report: self._report,
            proto.Finished: self._finished,
            proto.Beat: self._beat,
            proto.HelloApi: self._hello_api,
            proto.HelloRerun: self._hello_rerun,
            proto.AwaitAssignment: self._await_assignment,
            proto.AwaitGeneration: self._await_generation,
            proto.RestoreInfo: self._restore_info,
            proto.Lend: self._lend,
            proto.Inventory: self._inventory,
            proto.Fetch: self._fetch,
            proto.Peek: self._peek,
            proto.GatherRanges: self._gather_ranges,
        }

    # -- the handlers: each a request of its type -> (reply, descriptors handed with it) -----------
    def _attach(self, request: proto.Attach) -> Answer:
        memory = self.memory.rank(request.rank)
        present = [i for i, buffer in enumerate(memory.slots) if buffer is not None]
        fds = [memory.ctl.fd] + [memory.slots[i].fd for i in present]  # type: ignore[union-attr]
        held = self.memory.describe(request.rank)
        return proto.Attached(len(memory.slots), present, held["committed"], held["next"]), fds

    def _alloc(self, request: proto.Alloc) -> Answer:
        buffer = self.memory.allocate(request.rank, request.slot, request.nbytes)
        if buffer is None:  # no room for the ring's extra slot: the worker uses the smaller ring
            return proto.Allocated(slots=len(self.memory.rank(request.rank).slots)), []
        return proto.Allocated(), [buffer.fd]

    def _commit(self, request: proto.Commit) -> Answer:
        return self.commits.commit(request), []

    def _report(self, request: proto.Report) -> Answer:
        if request.event == "device_checked":  # before the process joins (worker/health.py)
            detail = request.detail
            self.control.device_checked(detail.get("gflops"), passed=not detail.get("reason"))
            if detail.get("reason"):
                self.telemetry.device_unhealthy(request.rank, request.pid, detail)
            return proto.Ack(), []
        # A worker's recovery milestone (state restored, collectives rebuilt, first step done).
        report = {**request.detail, "event": request.event, "rank": request.rank, "pid": request.pid}
        self.telemetry.worker_report(request.pid, report)
        return proto.Ack(), []

    def _beat(self, request: proto.Beat) -> Answer:
        self.control.beat(request.pid)
        if request.step >= 0:
            self.control.report_step(request.pid, request.step)
        return proto.Ack(), []

    def _finished(self, request: proto.Finished) -> Answer:
        self.control.finished(request.pid)
        return proto.Ack(), []

    def _hello_api(self, request: proto.HelloApi) -> Answer:
        self.control.register_api(request.pid)
        return proto.Ack(), []

    def _hello_rerun(self, request: proto.HelloRerun) -> Answer:
        self.control.register_rerun(request.pid, request.reason)
        if request.reason:
            logger.warning(
                "worker %d cannot re-run its script in-process (%s): a failure restarts the job",
                request.pid,
                request.reason,
            )
        return proto.Ack(), []

    def _await_assignment(self, request: proto.AwaitAssignment) -> Answer:
        return proto.NewEnv(self.control.await_assignment(request.pid, request.timeout_s)), []

    def _await_generation(self, request: proto.AwaitGeneration) -> Answer:
        env = self.control.await_generation(request.pid, request.round, request.timeout_s, request.raised)
        return proto.NewEnv(env), []

    def _restore_info(self, request: proto.RestoreInfo) -> Answer:
        return self.tiers.restore_info(request.rank, request.world_size), []

    def _inventory(self, request: proto.Inventory) -> Answer:
        return self.tiers.inventory(), []

    def _fetch(self, request: proto.Fetch) -> Answer:
        return self.tiers.fetch(request.rank, request.step, request.tier), []

    def _peek(self, request: proto.Peek) -> Answer:
        return self.tiers.peek(request.rank, request.step, request.world_size), []

    def _lend(self, request: proto.Lend) -> Answer:
        borrowed, buffers = self.tiers.lend(request.rank, request.step)
        owners = sorted(buffers)
        return proto.Lent([list(r) for r in borrowed], owners), [buffers[owner].fd for owner in owners]

    def _gather_ranges(self, request: proto.GatherRanges) -> Answer:
        select = Selection.from_message(request.select)
        moved, fd = self.tiers.gather_ranges(request.rank, request.step, request.world_size, select)
        return moved, [] if fd is None else [HandedFd(fd)]

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def channel_env(channel: AgentChannel) -> dict[str, str]:
    """What a worker needs to reach this channel: its path and the token."""
    return {"RESILRUN_AGENT_SOCKET": channel.path, TOKEN_ENV: channel.token}
