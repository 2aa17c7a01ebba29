"""Length-prefixed pickle messages over pipes and sockets between the launcher and its workers.

Only processes that inherited the descriptors can write to them, so everything unpickled here
comes from the launcher's own workers or fork server, never from a network socket.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
from collections import deque
from typing import Any

_HEADER = struct.Struct("<Q")


def encode(message: Any) -> bytes:
    """Frame ``message`` (pickled with protocol 5) with its length."""
    body = pickle.dumps(message, protocol=5)
    return _HEADER.pack(len(body)) + body


def write_message(fd: int, message: Any) -> None:
    """Write one framed message to a blocking file descriptor, all of it."""
    data = memoryview(encode(message))
    while data:
        data = data[os.write(fd, data) :]


def send_message(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    """Send one framed message on a Unix socket, with ``fds`` attached to its first byte."""
    data = encode(message)
    if fds:
        sent = socket.send_fds(sock, [data[:1]], fds)
        data = data[sent:]
    sock.sendall(data)


class MessageReader:
    """Reassembles framed messages from the chunks read off a non-blocking descriptor."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.pending: deque[Any] = deque()  # complete messages not yet taken by recv_message

    def feed(self, chunk: bytes) -> list[Any]:
        """Add bytes just read; return every message now complete."""
        self._buffer += chunk
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            messages.append(pickle.loads(memoryview(self._buffer)[_HEADER.size : end]))
            del self._buffer[:end]
        return messages


def recv_message(sock: socket.socket, reader: MessageReader, maxfds: int = 0) -> tuple[Any, list[int]]:
    """Block until one whole message is available on ``sock``; return it and any attached fds.

    Raises:
        EOFError: the peer closed the socket.
    """
    fds: list[int] = []
    while not reader.pending:
        if maxfds:
            chunk, new_fds, _, _ = socket.recv_fds(sock, 1 << 20, maxfds)
            fds += new_fds
        else:
            chunk = sock.recv(1 << 20)
        if not chunk:
            raise EOFError("the peer closed the connection")
        reader.pending.extend(reader.feed(chunk))
    return reader.pending.popleft(), fds
