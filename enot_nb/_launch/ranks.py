"""The launcher's view of each worker: its pipes, what it printed, what it sent.

Each rank has three pipes (stdout, stderr, messages). ``RankIO`` reads whichever is ready,
forwards output to the sinks (shown or not by the output mode), and keeps the rank's outcome
(Result, Done or ErrorReport), its partial state (Partial) and any other message, which goes
to ``on_message`` (display data, ...); each is handled exactly between the output written
before and after it (the worker fences its streams before every message, see output.Fenced).
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from typing_extensions import assert_never

from enot_nb._launch.output import Fenced, StreamSink
from enot_nb._log import log
from enot_nb._processes import starts
from enot_nb._processes.framing import MessageReader
from enot_nb._processes.protocol import (
    ClearOutput,
    CommMessage,
    Connected,
    DeviceMemory,
    Display,
    Done,
    ErrorReport,
    FrontEndMessage,
    Groups,
    Imported,
    InputRequest,
    Partial,
    Payload,
    Pushed,
    RankOutcome,
    Result,
    WorkerMessage,
)

STREAMS = ("out", "err", "msg")


@dataclass
class Rank:
    """One worker, as the launcher sees it."""

    rank: int
    local_rank: int
    pipes: dict[str, tuple[int, int]]  # "out"/"err"/"msg" -> (read end, write end)
    sinks: dict[str, StreamSink]
    messages: MessageReader[WorkerMessage] = field(default_factory=MessageReader)
    pid: int | None = None
    exitcode: int | None = None
    outcome: RankOutcome | None = None  # its last Result, Done or ErrorReport
    payload: Payload | None = None  # rank 0's result (its Result message)
    partial: Payload | None = None  # rank 0's state at an interrupt or failure (Partial)
    imported: tuple[str, ...] = ()  # what a cell's master imported (Imported; see preload)
    groups: Groups | None = None  # a session rank's answer to ReportGroups
    pushed: bool = False  # a session rank applied its task's push (Pushed)
    input_request: InputRequest | None = None  # a session rank asks for a line, unanswered yet
    device_memory: DeviceMemory | None = None  # a session rank's GPU memory after its last task
    signal_cause: str | None = None  # who killed it, where that can be told (see oom)
    stack_text: str = ""
    stop_signals: set[int] = field(default_factory=set)  # the stop signals we sent it
    connected: bool = False  # it got past init_process_group (Connected)
    fenced: dict[str, Fenced] = field(default_factory=lambda: {"out": Fenced(), "err": Fenced()})
    handled: int = 0  # messages handled that the worker fenced its output for (all but outcomes)
    open_reads: set[str] = field(default_factory=lambda: set(STREAMS))

    def err_tail(self) -> str:
        """The last lines it wrote to stderr (for a failure's report)."""
        return self.sinks["err"].tail()

    @property
    def running(self) -> bool:
        return self.pid is not None and self.exitcode is None

    def stopped_by_us(self, exitcode: int) -> bool:
        """Its death is ours, not a failure of its own: killed by a signal we sent, or anything
        after an interrupt. Any other end after SIGTERM/SIGKILL (default actions in a worker) it
        met on its own, in the moment before our signal (``os._exit(7)`` or a SIGKILL while its
        peer's "connection closed" error arrived first): it may be the root cause."""
        return -exitcode in self.stop_signals or signal.SIGINT in self.stop_signals


def make_ranks(nprocs: int, node_rank: int, output: str, duplex: bool = False) -> list[Rank]:
    """A Rank, with its pipes, per local rank; on failure (EMFILE) every pipe made is closed.
    ``duplex``: the message pipe is a Unix socket pair, so that the launcher can also send the
    worker commands on it (a session's worker; see _session/worker/loop)."""
    ranks: list[Rank] = []
    try:
        for local_rank in range(nprocs):
            rank = node_rank * nprocs + local_rank
            show = output == "all" or (output == "master" and rank == 0)
            prefix = f"[rank {rank}] " if output == "all" else ""
            ranks.append(
                Rank(
                    rank=rank,
                    local_rank=local_rank,
                    pipes={},
                    sinks={"out": StreamSink("stdout", show, prefix), "err": StreamSink("stderr", show, prefix)},
                )
            )
            for name in STREAMS:
                ranks[-1].pipes[name] = _socket_pair() if duplex and name == "msg" else os.pipe()
    except OSError as err:
        close_pipes(ranks)
        raise starts.start_error(err, f"the pipes of {nprocs} workers could not be made") from err
    return ranks


def _socket_pair() -> tuple[int, int]:
    """(the launcher's end, the worker's end) of a Unix socket pair, as bare descriptors."""
    ours, theirs = socket.socketpair()
    return ours.detach(), theirs.detach()


def close_pipes(ranks: list[Rank]) -> None:
    """Both ends of every pipe made (before a RankIO owns them)."""
    for r in ranks:
        for pair in r.pipes.values():
            for fd in pair:
                os.close(fd)


class RankIO:
    """Reads every rank's pipes through one selector (which also watches the group's exits)."""

    def __init__(
        self,
        ranks: list[Rank],
        on_message: Callable[[FrontEndMessage], None] | None,
        on_error: Callable[[Rank, ErrorReport], None],
    ) -> None:
        self.ranks, self.on_message, self.on_error = ranks, on_message, on_error
        self.selector = selectors.DefaultSelector()
        self.capturing_stacks = False
        # Every pipe end is ours until closed: the write ends once the workers hold them, the
        # read ends (and what is left) in close().
        self.read_ends = [r.pipes[name][0] for r in ranks for name in STREAMS]
        self.write_ends = [r.pipes[name][1] for r in ranks for name in STREAMS]
        try:
            for r in ranks:
                for name in STREAMS:
                    os.set_blocking(r.pipes[name][0], False)
                    self.selector.register(r.pipes[name][0], selectors.EVENT_READ, (r, name))
        except OSError:  # ENOMEM, ENOSPC (epoll's watch limit): the caller closes the pipes
            self.selector.close()
            raise

    def read(self, r: Rank, name: str, force_show: bool = False) -> bool:
        """Read what is available from one pipe; False once it is at its end or empty.

        A stop press (KeyboardInterrupt) may come between any two steps, and the interrupt's
        handling reads again: so the steps at a pipe's end can all be done twice, the last one
        marks the end, and the read ends are closed in close(), once."""
        fd = r.pipes[name][0]
        try:
            data = os.read(fd, 1 << 20)
        except BlockingIOError:
            return False
        except ConnectionResetError:  # a session worker died with a command unread: its end
            data = b""
        if not data and fd in self.selector.get_map():
            self.selector.unregister(fd)
        return self.received(r, name, data, force_show)

    def received(self, r: Rank, name: str, data: bytes, force_show: bool = False) -> bool:
        """What one of a rank's streams brought: ``data``, or (empty) its end; False at the end."""
        if not data:
            if name != "msg":
                r.fenced[name].add(b"", final=True)
                self._show(r, name, force_show, everything=True)
                r.sinks[name].feed(b"", final=True, force_show=force_show)
            r.open_reads.discard(name)
            return False
        if name == "msg":
            for message in r.messages.feed(data):
                self._message(r, message)
        else:
            r.fenced[name].add(data)
            self._show(r, name, force_show)
        return True

    def _show(self, r: Rank, name: str, force_show: bool = False, everything: bool = False) -> None:
        data = r.fenced[name].release(r.handled, everything)
        if not data:
            return
        if self.capturing_stacks and name == "err":
            r.stack_text += data.decode("utf-8", "backslashreplace")
        else:
            r.sinks[name].feed(data, force_show=force_show)

    def _message(self, r: Rank, message: WorkerMessage) -> None:
        """A message, shown after the output the worker wrote before it (it fences its streams
        before every message, outcomes included: a session's worker goes on printing after
        each cell's outcome)."""
        for name in ("out", "err"):
            while name in r.open_reads and r.fenced[name].fences <= r.handled and self.read(r, name):
                pass
        match message:
            case Result(payload):
                r.outcome, r.payload = message, payload
            case Done():
                r.outcome = message
            case Groups():
                r.groups = message
            case DeviceMemory():
                r.device_memory = message
            case Pushed():
                r.pushed = True
            case InputRequest():
                r.input_request = message
            case ErrorReport():
                r.outcome = message
                self.on_error(r, message)
            case Connected():
                r.connected = True
                log.debug("rank %d: connected (past init_process_group)", r.rank)
            case Partial(payload):
                r.partial = payload
            case Imported(modules):
                r.imported = modules
            case Display() | ClearOutput() | CommMessage():
                if self.on_message and r.sinks["out"].show:
                    self.on_message(message)
            case _:
                assert_never(message)
        r.handled += 1
        for name in ("out", "err"):
            self._show(r, name)

    def drain(self, r: Rank, names: tuple[str, ...] = STREAMS) -> None:
        for name in names:
            while name in r.open_reads and self.read(r, name):
                pass

    def close_write_ends(self) -> None:
        while self.write_ends:
            os.close(self.write_ends.pop())

    def close(self) -> None:
        """Close every pipe end still open (read ends, whether at their end or not) and the
        selector."""
        self.selector.close()
        self.close_write_ends()
        while self.read_ends:
            os.close(self.read_ends.pop())
