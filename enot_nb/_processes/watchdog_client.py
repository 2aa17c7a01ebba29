"""The kernel's end of its watchdog (see watchdog): the one sender of the watchdog's commands.

As CPython's ``multiprocessing/resource_tracker.py`` writes its protocol only in ``register``,
``unregister`` and ``_send``, the command words (defined in the watchdog's own file) are written
only by the methods of WatchdogClient; this process's one client is exposed as module functions
(``watchdog_client.watch(pgid)``), started on first use and again if it died.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

from enot_nb._processes import watchdog as _watchdog
from enot_nb._processes.clean_thread import on_clean_thread
from enot_nb._processes.interrupts import interrupts_deferred
from enot_nb._processes.starts import hook

_SCRIPT = os.path.abspath(_watchdog.__file__)


class WatchdogClient:
    """This process's watchdog: its process (started on first use, again if it died) and the
    commands sent on its stdin."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None

    def watch(self, *pgids: int) -> None:
        """Running workers' process groups: killed if this process dies."""
        self._send(*(f"{_watchdog.WATCH} {pgid}" for pgid in pgids))

    def forget(self, *pgids: int) -> None:
        """Workers reaped: their group ids may be reused, never to be killed. (A watchdog that
        is not running knows none: none is started to be told.)"""
        self._send(*(f"{_watchdog.FORGET} {pgid}" for pgid in pgids), start=False)

    def folder(self, path: str) -> None:
        """A rendezvous folder: removed if this process dies."""
        self._send(f"{_watchdog.FOLDER} {path}")

    def unfolder(self, path: str) -> None:
        """A rendezvous folder removed (as forget: never starts a watchdog, so the cleanup of a
        launch whose watchdog could not start does not fail again)."""
        self._send(f"{_watchdog.UNFOLDER} {path}", start=False)

    def command_fd(self) -> int:
        """The write end of the watchdog's stdin, which a forked worker closes (the watchdog is
        started if it is not running)."""
        stdin = self._running().stdin
        assert stdin is not None  # a pipe: see _start
        return stdin.fileno()

    def _running(self) -> subprocess.Popen[bytes]:
        if not self._alive():
            with interrupts_deferred():  # started and known, or not started
                hook("watchdog_starting")
                self._process = on_clean_thread(self._start)
        assert self._process is not None
        return self._process

    def _alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @staticmethod
    def _start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-I", _SCRIPT, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _send(self, *lines: str, start: bool = True) -> None:
        """Write whole command lines, as few writes as fit PIPE_BUF each: such a write is atomic,
        so the watchdog never reads half a command, even from a write cut short. ``start``:
        start the watchdog if it is not running (else such lines are dropped)."""
        if not start and not self._alive():
            return
        fd = self.command_fd()
        chunks, chunk = [], b""
        for line in lines:
            data = f"{line}\n".encode()
            assert len(data) <= select.PIPE_BUF, "a watchdog command must fit one atomic write"
            if len(chunk) + len(data) > select.PIPE_BUF:
                chunks.append(chunk)
                chunk = b""
            chunk += data
        chunks.append(chunk)
        try:
            for data in chunks:
                os.write(fd, data)
        except OSError:  # it died: reaped now, the next command starts another
            assert self._process is not None
            self._process.poll()


_client = WatchdogClient()
watch = _client.watch
forget = _client.forget
folder = _client.folder
unfolder = _client.unfolder
command_fd = _client.command_fd
