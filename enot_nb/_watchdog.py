"""The watchdog: kills what a launch left when the launching process dies, however it dies.

A worker dies with the kernel (Linux's parent-death signal), but its own children do not:
DataLoader workers, a ``subprocess.Popen``, processes a framework forks would be adopted by
init and live on, holding GPU memory. So one small process per launching process (stdlib only,
started once, ~20 ms) watches the kernel through a pidfd. The launcher tells it, on its stdin,
which process groups (one per worker) and folders belong to running launches::

    watch PGID     forget PGID     folder PATH     unfolder PATH

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


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Jupyter's interrupt is not for us
    kernel = int(sys.argv[1])
    try:
        kernel_fd = os.pidfd_open(kernel)
    except ProcessLookupError:
        return
    groups: set[int] = set()
    folders: set[str] = set()
    buffer = b""
    commands = sys.stdin.fileno()
    os.set_blocking(commands, False)
    poller = select.poll()
    poller.register(kernel_fd, select.POLLIN)
    poller.register(commands, select.POLLIN)
    stdin_open = True
    while True:
        for fd, _ in poller.poll():
            if fd == kernel_fd:
                _clean(groups, folders)
                return
            chunk = os.read(commands, 65536) if stdin_open else b""
            if not chunk:  # the kernel closed its end: it is exiting; the pidfd tells when
                poller.unregister(commands)
                stdin_open = False
                continue
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                verb, _, argument = line.decode().partition(" ")
                if verb == "watch":
                    groups.add(int(argument))
                elif verb == "forget":
                    groups.discard(int(argument))
                elif verb == "folder":
                    folders.add(argument)
                elif verb == "unfolder":
                    folders.discard(argument)


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
