"""How messages travel: length-prefixed pickles over pipes and sockets, descriptors in batches.

What the messages are is ``enot_nb._processes.protocol``; this module only moves them. Only
processes that inherited the descriptors can write to them, so everything unpickled here comes
from the launcher's own workers or fork server, never from a network socket.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
from collections import deque
from typing import Any, Generic, NamedTuple, TypeVar

from enot_nb._processes.interrupts import interrupts_deferred

_HEADER = struct.Struct("<Q")

M = TypeVar("M")
"""The messages a reader expects (a union of the protocol's records): unpickled, not checked."""


class FdsBatch(NamedTuple):
    """Carries up to MAXFDS_PER_SEND descriptors of the message before it."""

    size: int


# One sendmsg carries at most SCM_MAX_FD (253) descriptors: more travel in batches, each
# attached to an FdsBatch message that follows the message they belong to.
MAXFDS_PER_SEND = 250


def encode(message: object) -> bytes:
    """Frame ``message`` (pickled with protocol 5) with its length."""
    body = pickle.dumps(message, protocol=5)
    return _HEADER.pack(len(body)) + body


def write_message(fd: int, message: object) -> None:
    """Write one framed message to a blocking file descriptor, all of it."""
    data = memoryview(encode(message))
    while data:
        data = data[os.write(fd, data) :]


def send_message(sock: socket.socket, message: object, fds: list[int] | None = None) -> None:
    """Send one framed message on a Unix socket, then ``fds`` in batches (see recv_fds)."""
    sock.sendall(encode(message))
    fds = list(fds or [])
    for start in range(0, len(fds), MAXFDS_PER_SEND):
        batch = fds[start : start + MAXFDS_PER_SEND]
        data = encode(FdsBatch(len(batch)))
        sent = socket.send_fds(sock, [data[:1]], batch)
        sock.sendall(data[sent:])


class MessageReader(Generic[M]):
    """Reassembles framed messages from the chunks read off a non-blocking descriptor."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        # Complete messages not yet taken by recv_message (on a socket, batches among them).
        self.pending: deque[M | FdsBatch] = deque()
        self.fds: list[int] = []  # descriptors received and not yet taken by recv_fds

    def feed(self, chunk: bytes) -> list[M]:
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


def _read_some(sock: socket.socket, reader: MessageReader[Any]) -> None:
    """Wait for data (a stop press may end the wait), then read it and record what it carries
    with presses held: a press between receiving descriptors and recording them would leak
    them, and one inside feed() would lose messages and put the protocol out of step."""
    _wait_readable(sock)
    with interrupts_deferred():
        # Always ready for descriptors: bytes read without them would close the ones they carry.
        chunk, fds, _, _ = socket.recv_fds(sock, 1 << 20, MAXFDS_PER_SEND + 3)
        reader.fds += fds
        if chunk:
            reader.pending.extend(reader.feed(chunk))
    if not chunk:
        raise EOFError("the peer closed the connection")


def _wait_readable(sock: socket.socket) -> None:
    """Block until ``sock`` is readable, or raise TimeoutError after its timeout."""
    timeout = sock.gettimeout()
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(None if timeout is None else timeout * 1000):
        raise TimeoutError("timed out")


def recv_message(sock: socket.socket, reader: MessageReader[M]) -> M:
    """Block until one whole message (not a descriptor batch) is available on ``sock``.

    Raises:
        EOFError: the peer closed the socket.
    """
    while True:
        fill(sock, reader)
        message = reader.pending.popleft()
        if not isinstance(message, FdsBatch):
            return message


def fill(sock: socket.socket, reader: MessageReader[Any]) -> None:
    """Block until a message waits in ``reader.pending``, for the caller to take."""
    while not reader.pending:
        _read_some(sock, reader)


def recv_fds(sock: socket.socket, reader: MessageReader[Any], count: int) -> list[int]:
    """The ``count`` descriptors sent with the message just received, in order: the batches
    that carry them are read whole, so nothing of them is left for the next reader."""
    batches = -(-count // MAXFDS_PER_SEND)
    while batches:
        while not reader.pending:
            _read_some(sock, reader)
        message = reader.pending.popleft()
        if not isinstance(message, FdsBatch):
            raise EOFError(f"expected {count} descriptors, got the message {message[:1]!r}")
        batches -= 1
    taken, reader.fds = reader.fds[:count], reader.fds[count:]
    return taken


class LaunchFds(NamedTuple):
    """How the descriptors of a spawned launch are laid out: 3 per rank (stdout, stderr,
    messages), then ``results`` (0 or 1) result memfd, then ``shared`` (0 or 1) memfd of the
    shipped tensors. Defined once, for both ends (attempt and forkserver)."""

    ranks: int
    results: int
    shared: int

    @property
    def total(self) -> int:
        """How many descriptors follow the Launch message."""
        return 3 * self.ranks + self.results + self.shared

    def split(self, fds: list[int]) -> tuple[list[list[int]], int | None, int | None]:
        """Each rank's (stdout, stderr, messages), the result memfd, the shared memfd."""
        pipes = [fds[3 * i : 3 * i + 3] for i in range(self.ranks)]
        rest = fds[3 * self.ranks :]
        result = rest[0] if self.results else None
        shared = rest[self.results] if self.shared else None
        return pipes, result, shared
