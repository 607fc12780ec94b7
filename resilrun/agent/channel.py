"""The agent side of the worker channel: a Unix socket the node's workers talk to.

It serves the tier-1 requests (attach to the rank's buffers, allocate a slot, commit a step) and is
where heartbeats will land. The socket lives in a private directory (mode 0700), so only this
user's processes on this node can reach it; it is removed when the agent stops.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from resilrun import wire
from resilrun.agent.control import WorkerControl
from resilrun.agent.telemetry import Telemetry
from resilrun.agent.tiers import NodeTiers
from resilrun.errors import ResilrunError
from resilrun.state.memory import SLOTS, NodeMemoryTier

logger = logging.getLogger(__name__)


class AgentChannel:
    """Accepts worker connections and answers their requests, one thread per worker."""

    # Where commits and the workers' recovery milestones are reported (set by the composition root).
    telemetry: Telemetry = Telemetry()

    def __init__(self, memory: NodeMemoryTier, tiers: NodeTiers, control: WorkerControl) -> None:
        self.memory = memory
        self.tiers = tiers
        self.control = control
        self._dir = Path(tempfile.mkdtemp(prefix="resilrun-agent-"))
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

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    request, _ = wire.receive(conn)
                except (wire.ChannelError, OSError):
                    return
                try:
                    response, fds = self.handle(request)
                except ResilrunError as exc:
                    response, fds = {"ok": False, "error": exc.message, "hint": exc.hint}, []
                except (KeyError, TypeError, ValueError) as exc:
                    response, fds = {"ok": False, "error": f"bad request: {exc}"}, []
                try:
                    wire.send(conn, response, fds)
                except OSError:
                    return

    def handle(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """One request -> (response, fds to pass)."""
        op = request["op"]
        if op == "attach":
            rank = int(request["rank"])
            memory = self.memory.rank(rank)
            present = [i for i in range(SLOTS) if memory.slots[i] is not None]
            fds = [memory.ctl.fd] + [memory.slots[i].fd for i in present]  # type: ignore[union-attr]
            return {"ok": True, "present": present, **self.memory.describe(rank)}, fds
        if op == "alloc":
            buffer = self.memory.allocate(int(request["rank"]), int(request["slot"]), int(request["nbytes"]))
            return {"ok": True}, [buffer.fd]
        if op == "commit":
            if "pid" in request:
                self.control.report_step(int(request["pid"]), int(request["step"]))
            self.memory.commit(
                int(request["rank"]),
                int(request["step"]),
                int(request["slot"]),
                int(request["nbytes"]),
                request.get("values"),
            )
            copy_s = request.get("copy_s")
            rank, step, nbytes = int(request["rank"]), int(request["step"]), int(request["nbytes"])
            self.telemetry.committed(rank, step, nbytes, None if copy_s is None else float(copy_s))
            return {"ok": True}, []
        if op == "report":
            # A worker's recovery milestone (state restored, collectives rebuilt, first step done).
            self.telemetry.worker_report(int(request["pid"]), request)
            return {"ok": True}, []
        if op == "finished":
            self.control.finished(int(request["pid"]))
            return {"ok": True}, []
        if op == "beat":
            self.control.beat(int(request["pid"]))
            return {"ok": True}, []
        if op == "hello_api":
            self.control.register_api(int(request["pid"]))
            return {"ok": True}, []
        if op == "await_assignment":
            env = self.control.await_assignment(int(request["pid"]), float(request["timeout_s"]))
            return {"ok": True, "env": env}, []
        if op == "await_generation":
            env = self.control.await_generation(int(request["pid"]), int(request["round"]), float(request["timeout_s"]))
            return {"ok": True, "env": env}, []
        if op == "restore_info":
            return {"ok": True, **self.tiers.restore_info(int(request["rank"]), int(request["world_size"]))}, []
        if op == "fetch":
            info = self.tiers.fetch(int(request["rank"]), int(request["step"]), str(request["tier"]))
            return {"ok": True, **info}, []
        raise ValueError(f"unknown op {op!r}")

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def channel_env(channel: AgentChannel) -> dict[str, str]:
    return {"RESILRUN_AGENT_SOCKET": channel.path}
