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


class PressHold:
    """Presses held from ``start`` to ``release``, over a span no single ``with`` block covers
    (a session command: from the moment every rank answered until the notebook applied the
    answer; a press in between would leave the notebook half updated, or its record of the
    ranks' state out of step with it). A press meanwhile goes to the previous handler at release
    (KeyboardInterrupt, for Python's default)."""

    def __init__(self) -> None:
        self.pressed: list[Any] = []  # the frame each press interrupted
        self._previous: Any = None
        self._holding = False

    def start(self) -> None:
        """Hold presses from here (once; a no-op where handlers cannot be set)."""
        if (
            self._holding
            or threading.current_thread() is not threading.main_thread()  # only it sets handlers
            or signal.getsignal(signal.SIGINT) in (None, signal.SIG_IGN)  # set from C, or ignored
        ):
            return
        self._previous = signal.signal(signal.SIGINT, lambda signum, frame: self.pressed.append(frame))
        self._holding = True

    def release(self, deliver: bool = True) -> None:
        """Stop holding; a press meanwhile is handled now (``deliver``) or dropped (an exception
        is already on its way up, or the press was already answered)."""
        if not self._holding:
            return
        signal.signal(signal.SIGINT, self._previous)
        self._holding = False
        if not self.pressed or not deliver:
            return
        frame, self.pressed = self.pressed[0], []
        if callable(self._previous):
            self._previous(signal.SIGINT, frame)
        elif self._previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT while the block runs; a press meanwhile goes to the previous handler after
    it (KeyboardInterrupt, for Python's default)."""
    hold = PressHold()
    hold.start()
    try:
        yield
    except BaseException:
        hold.release(deliver=False)
        raise
    hold.release()


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
