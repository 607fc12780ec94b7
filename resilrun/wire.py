"""Framing of the worker<->agent channel: length-prefixed JSON messages, file descriptors alongside.

One request, one response, in order, over a Unix socket. Every receive has a deadline (the
socket timeout), so a wedged peer turns into an error instead of a hang.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

_LEN = struct.Struct("<I")
MAX_MESSAGE = 64 * 1024 * 1024  # values trees are KBs; refuse anything absurd
MAX_FDS = 16


class ChannelError(ConnectionError):
    """The peer closed the channel or sent something that is not a message."""


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    body = json.dumps(message, separators=(",", ":")).encode()
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it."""
    head, fds, _, _ = socket.recv_fds(sock, _LEN.size, MAX_FDS)
    if not head:
        raise ChannelError("channel closed")
    head += _recv_exact(sock, _LEN.size - len(head))
    (length,) = _LEN.unpack(head)
    if length > MAX_MESSAGE:
        raise ChannelError(f"message of {length} bytes refused")
    try:
        message = json.loads(_recv_exact(sock, length))
    except ValueError as exc:
        raise ChannelError(f"malformed message: {exc}") from None
    if not isinstance(message, dict):
        raise ChannelError("malformed message: not an object")
    return message, list(fds)


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks = []
    while count > 0:
        chunk = sock.recv(min(count, 1 << 20))
        if not chunk:
            raise ChannelError("channel closed mid-message")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)
