"""A paused fork of this process, so that pagemap tells which pages this process wrote since.

A one-off cell's master is a fresh fork: every page it owns alone it wrote during the cell, so
only those travel back (see _memory/digests). A session's processes live on: the master, and the
notebook between session cells, own every page they ever wrote, and ownership would no longer
tell anything. A fork made just before the snapshot shares every page again; a page this process
writes afterwards is copied, and owned, again: exactly the pages written since the fork, found
by reading pagemap (8 bytes a page), never by digesting the memory. The fork does nothing: it
waits on a pipe until it is killed (``end``), or this process dies (its parent-death signal),
or its process group is killed.

The cost: one fork (the page tables: about 1 ms per GiB mapped), and, while it lives, a copy of
each page written, as with any forked child.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import warnings

from enot_nb._processes.interrupts import interrupts_deferred

_PR_SET_PDEATHSIG = 1
# Looked up here, not in the child: a lookup there could wait on a loader lock that another
# thread of this process held at the fork.
_prctl = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None


class Shadow:
    """This process's shadow fork (at most one at a time)."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self._wake: int | None = None  # the pipe's write end: closing it ends the shadow

    def before_snapshot(self, owned_share: float) -> bool:
        """Make a shadow if there is none or too many pages are owned again; whether the
        snapshot must read the large storages' pages (the shadow is older than some writes)."""
        if self.pid is None or owned_share > RENEW_ABOVE:
            self.renew()
            return self.pid is None  # no shadow could be made (not Linux): read everything
        return True

    def renew(self) -> None:
        """Fork a new shadow, then end the old one: from here on, pages written are owned again.
        The old one is killed first and reaped after the fork, so that its exit (freeing its page
        tables) overlaps the fork instead of adding to it."""
        old = self._kill()
        try:
            self._fork()
        finally:
            self._reap(old)

    def _fork(self) -> None:
        if _prctl is None:
            return
        with interrupts_deferred():  # made and recorded as one step
            read, write = os.pipe()
            parent = os.getpid()
            with warnings.catch_warnings():  # Python 3.12 warns of forking a threaded process;
                warnings.simplefilter("ignore", DeprecationWarning)  # the child takes no lock
                pid = os.fork()
            if pid == 0:  # the shadow: wait to be killed, touch nothing
                try:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Jupyter interrupts the whole group
                    # No descriptor of the parent's stays open here: a peer's connection (gloo's
                    # sockets, which an aborting rank shuts to release its peers), a pipe whose
                    # end of file someone waits for. Only the pipe's read end, which never ends:
                    # the parent holds the write end until it kills this process.
                    os.closerange(0, read)
                    os.closerange(read + 1, os.sysconf("SC_OPEN_MAX"))
                    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                    if os.getppid() == parent:  # else the parent died before prctl: leave
                        os.read(read, 1)
                finally:
                    os._exit(0)
            os.close(read)
            self.pid, self._wake = pid, write

    def end(self) -> None:
        """Kill the shadow and reap it."""
        self._reap(self._kill())

    def _kill(self) -> int | None:
        """Kill the shadow (our unreaped child: its pid names no other process); its pid."""
        with interrupts_deferred():
            pid, wake = self.pid, self._wake
            self.pid = self._wake = None
            if wake is not None:
                os.close(wake)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return pid

    @staticmethod
    def _reap(pid: int | None) -> None:
        if pid is not None:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:  # reaped already (the user ignores SIGCHLD)
                pass


RENEW_ABOVE = 0.25
"""A shadow is renewed once this share of the tracked large storages' pages is owned again:
until then a snapshot digests the owned pages (written since the shadow), which costs less than
a fork while they are few."""

SHADOW = Shadow()
"""The process's one shadow: the notebook's (between session cells) or a session master's."""
