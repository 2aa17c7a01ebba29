"""``input()``, ``getpass()`` and the debugger on a rank: the line comes from the notebook's front
end, as a local cell's ``input()`` reads it.

A session rank asks the kernel (``InputRequest`` on its message socket) and waits for the reply
(``InputReply``) on the same socket, where its commands arrive: the kernel asks its front end
(ipykernel's stdin channel) with a prompt that names the rank, and answers. ``breakpoint()``,
``pdb.set_trace()`` and a post-mortem open ``RankPdb``, whose output travels with its next
prompt, so that it shows whatever ``--output`` says. A one-off cell's workers have no way back
from the kernel: there ``input()`` and the debugger raise an error that says to use a session.
"""

from __future__ import annotations

import bdb
import builtins
import getpass
import io
import os
import pdb
import sys
from collections.abc import Callable
from typing import IO, Any, NoReturn, cast

from IPython.core.debugger import Pdb

from enot_nb._processes.protocol import InputReply, InputRequest

ONE_OFF = (
    "input(), getpass() and the debugger need a way back from the notebook to the rank, which a "
    "one-off cell's workers do not have: start a session (%enot_session start -n N) and run the cell "
    "there, or read the value in an ordinary cell before this one and use the variable"
)

_ask: Callable[[InputRequest], InputReply] | None = None
"""The session's way to ask the kernel (see connect); None in a one-off cell's worker."""


def install() -> None:
    """This rank's ``input``, ``getpass``, ``sys.stdin``, ``breakpoint()`` and
    ``pdb.set_trace``: through the notebook (a session), or the error that says to use one."""
    builtins.input = _input
    getpass.getpass = _getpass
    sys.stdin = _Stdin()
    sys.breakpointhook = _breakpoint
    pdb.set_trace = _set_trace


def connect(ask: Callable[[InputRequest], InputReply]) -> None:
    """A session rank: lines come from the notebook through ``ask``."""
    global _ask
    _ask = ask


def post_mortem(tb: Any) -> None:
    """The debugger on ``tb`` (a failed cell's traceback), in the notebook."""
    debugger = RankPdb()
    debugger.reset()
    debugger.interaction(None, tb)


def read_line(prompt: str, shown: str = "", password: bool = False) -> str:
    """A line from the notebook's front end (without its newline): StdinNotImplementedError
    where it has no stdin (nbclient, papermill) or in a one-off cell's worker."""
    from IPython.core.error import StdinNotImplementedError

    if _ask is None:
        raise StdinNotImplementedError(ONE_OFF)
    reply = _ask(InputRequest(prompt, shown, password))
    if reply.interrupted:
        raise KeyboardInterrupt
    if reply.line is None:
        raise StdinNotImplementedError(reply.error)
    return reply.line


def _input(prompt: object = "") -> str:
    sys.stdout.flush()
    return read_line(str(prompt))


def _getpass(prompt: str = "Password: ", stream: object = None) -> str:
    return read_line(prompt, password=True)


class _Stdin(io.TextIOBase):
    """``sys.stdin``: a line read asks the notebook (with no prompt); its file descriptor is
    ``/dev/null``'s, as a worker's stdin was (for libraries that ask for one)."""

    def __init__(self) -> None:
        self._null = os.open(os.devnull, os.O_RDONLY)

    def fileno(self) -> int:
        return self._null

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        return read_line("") + "\n"

    def read(self, size: int | None = -1) -> NoReturn:
        raise OSError("a rank's stdin is read line by line (input(), sys.stdin.readline())")


class _DebuggerOut(io.StringIO):
    """The debugger's output, held until its next prompt: it goes to the notebook with it."""


class _DebuggerIn(io.TextIOBase):
    """The debugger's input: its output so far, up to its prompt, goes with the request."""

    def __init__(self, out: _DebuggerOut) -> None:
        self.out = out

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        text = self.out.getvalue()
        self.out.seek(0)
        self.out.truncate()
        shown, _, prompt = text.rpartition("\n")
        try:
            return read_line(prompt, shown + "\n" if shown else "") + "\n"
        except KeyboardInterrupt:  # a stop, a peer's failure: the debugger closes (it would ask again)
            raise bdb.BdbQuit from None


class RankPdb(Pdb):
    """IPython's debugger (``ipdb>``, as ``breakpoint()`` in a local cell of a kernel) on a rank:
    it reads the notebook's front end and shows what it prints there."""

    def __init__(self, **kwargs: Any) -> None:
        out = _DebuggerOut()
        super().__init__(stdin=cast(IO[str], _DebuggerIn(out)), stdout=out, **kwargs)
        self.use_rawinput = False


def _breakpoint(*args: Any, **kwargs: Any) -> None:
    RankPdb().set_trace(sys._getframe().f_back)


def _set_trace(*, header: str | None = None, **kwargs: Any) -> None:
    debugger = RankPdb()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(sys._getframe().f_back)
