"""The worker side of the agent channel (see resilrun.agent.state.channel for the server)."""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, TypeVar

from resilrun import wire
from resilrun.channel_protocol import DEFAULT_DEADLINE_S, Auth, Refused, Reply, Request, parse_reply
from resilrun.env import agent_token
from resilrun.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError

R = TypeVar("R", bound=Reply)

# The agent's refusals by class name: a restore tells "gone" (plan again) from "refused" (stop).
_ERRORS: dict[str, type[CheckpointError]] = {
    cls.__name__: cls for cls in (CheckpointCorruptError, CheckpointNotFoundError, CheckpointError)
}


class AgentClient:
    """One connection to this node's agent; requests are answered in order."""

    def __init__(self, path: str, token: str | None = None) -> None:
        """Connect and authenticate with ``token`` (default: ``RESILRUN_AGENT_TOKEN``, which the
        agent sets for the workers it spawns).

        Raises:
            CheckpointError: the agent is unreachable or refused the token.
        """
        self.path = path
        self._posted: Request[Any] | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(DEFAULT_DEADLINE_S)
        try:
            self._sock.connect(path)
        except OSError as exc:
            raise CheckpointError(
                f"cannot reach the resilrun agent at {path}: {exc.strerror}",
                hint="resilrun.init() must run under the resilrun launcher for snapshots",
            ) from exc
        token = agent_token() if token is None else token
        try:
            self.call(Auth(token=token))
        except CheckpointError:
            self._sock.close()
            raise

    def call(self, request: Request[R]) -> tuple[R, list[int]]:
        """Send one request and return ``(reply, fds)`` (after the answer to any ``post``), the
        reply of the request's own type, waiting for it up to the request's own deadline
        (``Request.deadline_s``).

        Raises:
            CheckpointError: the agent refused the request (or the posted one), the channel broke,
                or no answer came within the deadline.
        """
        self.collect()
        self._send(request)
        return self._receive(request)

    def post(self, request: Request[Any]) -> None:
        """Send a request without waiting for its answer; ``collect`` (or the next request) reads it.

        Why: a commit's round trip is ~1 ms of training time on a busy node, and nothing in the
        step after it needs the answer.
        """
        self.collect()
        self._send(request)
        self._posted = request

    def collect(self) -> Reply | None:
        """The answer to the posted request, if one is outstanding.

        Raises:
            CheckpointError: the agent refused the posted request or the channel broke.
        """
        posted, self._posted = self._posted, None
        if posted is None:
            return None
        reply, fds = self._receive(posted)
        for fd in fds:
            os.close(fd)
        return reply

    def _send(self, request: Request[Any]) -> None:
        try:
            wire.send(self._sock, request.to_message())
        except OSError as exc:
            raise CheckpointError(f"the agent channel failed during '{request.op}': {exc}") from exc

    def _receive(self, request: Request[R]) -> tuple[R, list[int]]:
        try:
            self._sock.settimeout(request.deadline_s)
            message, fds = wire.receive(self._sock)
            reply = parse_reply(request, message)
        except (OSError, wire.ChannelError, ValueError, TypeError) as exc:
            raise CheckpointError(f"the agent channel failed during '{request.op}': {exc}") from exc
        if isinstance(reply, Refused):
            for fd in fds:
                os.close(fd)
            raise _ERRORS.get(str(reply.code), CheckpointError)(reply.error, hint=reply.hint)
        return reply, fds

    def interrupt(self) -> None:
        """Make a request blocked in another thread fail now (a plain close would not wake it)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._sock.close()
