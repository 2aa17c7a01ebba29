"""Where a rank is, on request: SIGUSR1 (sent by the launcher when the stop button is pressed,
or when no rank makes progress) prints every thread's Python stack to stderr, in faulthandler's
format, and the rank's last collectives (see collectives), from a helper thread that holds the GIL.

faulthandler's own dump (``faulthandler.register``) walks every thread's frames from inside the
signal handler, without the GIL, while the threads change them: a rank stopped in the middle of
a collective died of SIGSEGV, about one stop press in twenty under load
(tests/session/test_work_kept.py's twenty presses). Here the C-level handler only writes the
signal's number into the wakeup pipe (``signal.set_wakeup_fd``); the helper thread wakes, takes
the GIL (a rank blocked in gloo or NCCL has released it) and reads ``sys._current_frames()``,
which no thread changes meanwhile.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from typing import Any

from enot_nb._worker import collectives


def install() -> None:
    """Answer SIGUSR1 with every thread's stack (main thread only: signal handlers are set there)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the signal handler must never block on it
    signal.signal(signal.SIGUSR1, _woken)  # a Python handler: the C handler then writes the pipe
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_serve, args=(read_fd,), name="enot_nb-stacks", daemon=True).start()


def _woken(signum: int, frame: Any) -> None:
    """Nothing: the helper thread answers (this only makes the signal reach the wakeup pipe)."""


def _serve(fd: int) -> None:
    while True:
        try:
            woken = os.read(fd, 64)  # each byte: a signal's number (SIGINT's too: passed over)
        except OSError:
            return
        if not woken:
            return
        if signal.SIGUSR1 in woken:
            _dump()


def _dump() -> None:
    me = threading.get_ident()
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        lines.append(f"Thread 0x{ident:016x} (most recent call first):")
        for entry in traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False):
            lines.append(f'  File "{entry.filename}", line {entry.lineno} in {entry.name}')
        lines.append("")
    try:
        taken = collectives.snapshot()
    except Exception:  # noqa: BLE001 - the stack matters more than the collectives
        taken = None
    try:
        os.write(2, ("\n".join(lines) + "\n" + collectives.encoded(taken)).encode("utf-8", "backslashreplace"))
    except OSError:
        pass
