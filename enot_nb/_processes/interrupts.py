"""Stop presses (SIGINT, KeyboardInterrupt in the main thread) held over short steps.

A press may land between any two lines of the launcher. Where a step makes a resource and
records it for the cleanup (a pipe, a lock, a memfd), or the cleanup itself runs, a press in
the middle would lose the resource or half the cleanup; such steps run with presses held, and
a press meanwhile is handled as it would have been, right after the step.

A press can also land before a cleanup gets to hold presses (on the ``finally:`` line that calls
it). So a cleanup is written to be run twice (each step marks itself done), and ``finish`` runs
it again after such a press: any single press leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT while the block runs; a press meanwhile goes to the previous handler after
    it (KeyboardInterrupt, for Python's default)."""
    if (
        threading.current_thread() is not threading.main_thread()  # only it sets handlers
        or signal.getsignal(signal.SIGINT) in (None, signal.SIG_IGN)
    ):  # set from C, or ignored
        yield
        return
    pressed: list[Any] = []  # the frame each press interrupted
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if not pressed:
        return
    if callable(previous):
        previous(signal.SIGINT, pressed[0])
    elif previous == signal.SIG_DFL:
        signal.raise_signal(signal.SIGINT)


def finish(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (safe to run twice) with presses held, to its end: if a press lands before
    the holding starts, it runs again; the press is then raised."""
    press: KeyboardInterrupt | None = None
    for _ in range(2):
        try:
            with interrupts_deferred():
                cleanup()
            break
        except KeyboardInterrupt as err:  # before the hold, or held and raised after it
            press = err
    if press is not None:
        raise press
