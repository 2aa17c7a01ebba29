"""Length-prefixed pickle messages over pipes and sockets between the launcher and its workers.

Only processes that inherited the descriptors can write to them, so everything unpickled here
comes from the launcher's own workers or fork server, never from a network socket.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
from collections import deque
from typing import Any, NamedTuple

from enot_nb._processes.interrupts import interrupts_deferred

_HEADER = struct.Struct("<Q")


class Kind:
    """Every message kind, defined once.

    worker -> launcher, ``(kind, payload)`` on one message pipe per rank: CONNECTED (past
    init_process_group), DISPLAY, CLEAR_OUTPUT, COMM, PARTIAL, then one of RESULT (rank 0),
    DONE, ERROR (an ErrorReport). A RESULT or PARTIAL payload is (MEMFD, size) or (INLINE,
    pickle bytes). The fork server's messages are the
    NamedTuples below (Ready, Launch, Started, StartFailed, Exit).
    """

    DISPLAY = "display"
    CLEAR_OUTPUT = "clear_output"
    COMM = "comm"
    CONNECTED = "connected"
    PARTIAL = "partial"
    RESULT = "result"
    DONE = "done"
    ERROR = "error"
    MEMFD = "memfd"
    INLINE = "inline"
    OUTCOMES = (RESULT, DONE, ERROR)


# Written by a worker into its stdout and stderr pipes just before each message that is not an
# outcome (see bootstrap.send): the launcher shows the output before it, then the message, then
# what follows (output.Fenced), so prints, display data and widgets keep the worker's order.
# An APC escape sequence: a terminal that ever received it would show nothing.
OUTPUT_FENCE = b"\x1b_enot_nb\x1b\\"


class WorkerMessage(NamedTuple):
    """worker -> launcher, on the rank's message pipe: a Kind and its payload."""

    kind: str
    payload: Any


class Display(NamedTuple):
    """A DISPLAY message's payload: what IPython's display publisher was given in the worker."""

    data: dict
    metadata: dict
    transient: dict
    update: bool


class CommMessage(NamedTuple):
    """A COMM message's payload: what a worker's comm (a widget) would publish on iopub."""

    msg_type: str
    """comm_open, comm_msg or comm_close."""
    content: dict
    metadata: dict
    buffers: list[bytes]
    topic: bytes


class ErrorReport(NamedTuple):
    """What a worker that raised tells the launcher (its ERROR message's payload)."""

    type: str | None
    """The exception's class name; None for sys.exit."""
    message: str
    traceback: str | None
    exitcode: int
    connecting: bool = False
    """It failed while the ranks were connecting (gloo's connectFullMesh), before any user code
    ran: the launcher starts the attempt again (see launcher.run_plan)."""


class Ready(NamedTuple):
    """fork server -> launcher: torch is imported, launches may come."""

    pid: int


class Launch(NamedTuple):
    """launcher -> fork server: start one worker per spec (descriptors follow, see LaunchFds)."""

    launch_id: int
    specs: list
    job_bytes: bytes
    layout: LaunchFds


class Started(NamedTuple):
    """fork server -> launcher: every worker runs (a pidfd per rank follows, in rank order)."""

    launch_id: int
    pids: dict[int, int]


class StartFailed(NamedTuple):
    """fork server -> launcher: the workers could not be started; none is left."""

    launch_id: int
    errno: int | None
    reason: str


class Exit(NamedTuple):
    """fork server -> launcher: a worker ended and was reaped (its group killed first)."""

    launch_id: int
    rank: int
    exitcode: int


class FdsBatch(NamedTuple):
    """Carries up to MAXFDS_PER_SEND descriptors of the message before it."""

    count: int


# One sendmsg carries at most SCM_MAX_FD (253) descriptors: more travel in batches, each
# attached to an FdsBatch message that follows the message they belong to.
MAXFDS_PER_SEND = 250


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
    """Send one framed message on a Unix socket, then ``fds`` in batches (see recv_fds)."""
    sock.sendall(encode(message))
    fds = list(fds or [])
    for start in range(0, len(fds), MAXFDS_PER_SEND):
        batch = fds[start : start + MAXFDS_PER_SEND]
        data = encode(FdsBatch(len(batch)))
        sent = socket.send_fds(sock, [data[:1]], batch)
        sock.sendall(data[sent:])


class MessageReader:
    """Reassembles framed messages from the chunks read off a non-blocking descriptor."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.pending: deque[Any] = deque()  # complete messages not yet taken by recv_message
        self.fds: list[int] = []  # descriptors received and not yet taken by recv_fds

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


def _read_some(sock: socket.socket, reader: MessageReader) -> None:
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


def recv_message(sock: socket.socket, reader: MessageReader) -> Any:
    """Block until one whole message (not a descriptor batch) is available on ``sock``.

    Raises:
        EOFError: the peer closed the socket.
    """
    while True:
        fill(sock, reader)
        message = reader.pending.popleft()
        if not _is_batch(message):
            return message


def fill(sock: socket.socket, reader: MessageReader) -> None:
    """Block until a message waits in ``reader.pending``, for the caller to take."""
    while not reader.pending:
        _read_some(sock, reader)


def _is_batch(message: Any) -> bool:
    return isinstance(message, FdsBatch)


def recv_fds(sock: socket.socket, reader: MessageReader, count: int) -> list[int]:
    """The ``count`` descriptors sent with the message just received, in order: the batches
    that carry them are read whole, so nothing of them is left for the next reader."""
    batches = -(-count // MAXFDS_PER_SEND)
    while batches:
        while not reader.pending:
            _read_some(sock, reader)
        message = reader.pending.popleft()
        if not _is_batch(message):
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
    def count(self) -> int:
        return 3 * self.ranks + self.results + self.shared

    def split(self, fds: list[int]) -> tuple[list[list[int]], int | None, int | None]:
        pipes = [fds[3 * i : 3 * i + 3] for i in range(self.ranks)]
        rest = fds[3 * self.ranks :]
        result = rest[0] if self.results else None
        shared = rest[self.results] if self.shared else None
        return pipes, result, shared
