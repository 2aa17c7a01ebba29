"""Is any rank making progress? A launch or a session cell given ``hang_after`` seconds asks each
second: a rank that runs Python, computes or moves a collective along uses CPU time (its
DataLoader workers' included); ranks that all wait (a collective a peer never reached, a
deadlock) use none. Once no rank has used more than a sliver of CPU for ``hang_after`` seconds,
``found`` says so, once, and the caller shows where each rank is (see collective_table); it
says so again only after the ranks moved on and stood still again.

Progress is CPU time, not a heartbeat (a helper thread beats on while the main thread is
blocked), and not sequence numbers alone (a long step between collectives is progress).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

CHECK_EVERY = float(os.environ.get("ENOT_NB_HANG_CHECK_EVERY", "1"))
"""Seconds between two looks at the ranks' CPU time."""

IDLE_SHARE = 0.01
"""A rank that used less than this share of one core since the last progress stands still (a
blocked rank's own threads still use a little)."""


class HangWatch:
    """Whether the ranks stood still for ``after`` seconds (None: never asked)."""

    def __init__(self, after: float | None, cpu: Callable[[], dict[int, float | None]]) -> None:
        self.after = after
        self._cpu = cpu
        self._since = 0.0  # when the ranks last made progress
        self._base: dict[int, float | None] = {}  # their CPU time then
        self._next = 0.0
        self._said = False

    def start(self) -> None:
        """The cell starts: its ranks are moving."""
        if self.after is None:
            return
        now = time.monotonic()
        self._since, self._base, self._said = now, self._cpu(), False
        self._next = now + min(CHECK_EVERY, self.after)

    def due(self) -> float | None:
        """Seconds until the next look (0: now); None where nothing is watched."""
        return None if self.after is None else max(0.0, self._next - time.monotonic())

    def found(self) -> bool:
        """Look, if due: True the first time the ranks have stood still for ``after`` seconds."""
        if self.after is None or time.monotonic() < self._next:
            return False
        now = time.monotonic()
        self._next = now + min(CHECK_EVERY, self.after)
        cpu = self._cpu()
        allowed = IDLE_SHARE * (now - self._since) + 0.02  # and a tick of the clock /proc counts in
        moved = any(
            used is not None and (before := self._base.get(rank)) is not None and used - before > allowed
            for rank, used in cpu.items()
        )
        if moved:
            self._since, self._base, self._said = now, cpu, False
            return False
        if self._said or now - self._since < self.after:
            return False
        self._said = True
        return True


def soonest(*timeouts: float | None) -> float | None:
    """The shortest of the timeouts given (None: no timeout)."""
    given = [t for t in timeouts if t is not None]
    return min(given) if given else None
