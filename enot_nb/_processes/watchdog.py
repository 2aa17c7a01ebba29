"""The watchdog: kills what a launch left when the launching process dies, however it dies.

A worker dies with the kernel (Linux's parent-death signal), but its own children do not:
DataLoader workers, a ``subprocess.Popen``, processes a framework forks would be adopted by
init and live on, holding GPU memory. So one small process per launching process (stdlib only,
started once, ~20 ms) watches the kernel through a pidfd. The launcher tells it, on its stdin,
which process groups (one per worker) and folders belong to running launches, one command a
line::

    watch PGID     forget PGID     folder PATH     unfolder PATH

The command words are the constants below, defined here only: this file runs as
``python -I <file>`` (no site, no package), and the kernel's one sender of them,
``watchdog_client.WatchdogClient``, imports this module to read them.

When the kernel's pidfd fires (the kernel exited, was SIGKILLed or restarted), the watchdog
SIGKILLs every group it still watches, removes the folders, and exits. It lives in a session of
its own, so Jupyter's kill of the kernel's process group does not take it down first. A
descendant that leaves its worker's group (``setsid`` and a double fork) is out of its reach.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys

WATCH = "watch"
"""``watch PGID``: a running worker's process group, to kill if the kernel dies."""
FORGET = "forget"
"""``forget PGID``: that worker was reaped (its group id may be reused)."""
FOLDER = "folder"
"""``folder PATH``: a launch's rendezvous folder, to remove if the kernel dies."""
UNFOLDER = "unfolder"
"""``unfolder PATH``: that folder was removed."""


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Jupyter's interrupt is not for us
    kernel = int(sys.argv[1])
    try:
        kernel_fd = os.pidfd_open(kernel)
    except ProcessLookupError:
        return
    state = _Watched()
    commands = sys.stdin.fileno()
    os.set_blocking(commands, False)
    poller = select.poll()
    poller.register(kernel_fd, select.POLLIN)
    poller.register(commands, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if commands in ready and not state.read(commands):
            poller.unregister(commands)  # the kernel closed its end: the pidfd tells when it exits
        if kernel_fd in ready:
            state.read(commands)  # what the kernel wrote just before it died counts too
            _clean(state.groups, state.folders)
            return


class _Watched:
    """The groups and folders the kernel told about, from its command lines."""

    def __init__(self) -> None:
        self.groups: set[int] = set()
        self.folders: set[str] = set()
        self._buffer = b""

    def read(self, fd: int) -> bool:
        """Take every command waiting on ``fd``; False once the kernel closed it."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not chunk:
                return False
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                self._take(line.decode())

    def _take(self, line: str) -> None:
        verb, _, argument = line.partition(" ")
        if verb == WATCH:
            self.groups.add(int(argument))
        elif verb == FORGET:
            self.groups.discard(int(argument))
        elif verb == FOLDER:
            self.folders.add(argument)
        elif verb == UNFOLDER:
            self.folders.discard(argument)


def _clean(groups: set[int], folders: set[str]) -> None:
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
