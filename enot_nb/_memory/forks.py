"""The pages a process owned at each of its forks since a mark (``FORKS``), and whether a child
that no fork of ours made appeared since (then pagemap ownership cannot be trusted).

A fork shares every page with the child (a DataLoader's persistent worker), and pagemap then no
longer calls the pages this process's own, though the cell may have written them before the
fork: they count as written (see written.pages_written_since).
"""

from __future__ import annotations

import os
from typing import Any

from enot_nb._memory import pagemap as _pagemap

Area = tuple[int, int]
"""A memory area: (address, length)."""


class _ForkWatch:
    """The pages of the areas digested by pages that this process owned at each of its forks
    since the snapshot. A fork shares every page with the child (a DataLoader's persistent
    worker), and pagemap then no longer calls the pages this process's own, though the cell may
    have written them before the fork: they count as written. A child that no fork of ours made
    (a C library's fork) leaves every paged area counted as changed."""

    def __init__(self) -> None:
        self.masks: dict[Area, Any] = {}
        self.children_before: set[bytes] | None = set()
        self.seen: set[bytes] = set()

    def reset(self) -> None:
        self.masks.clear()
        self.children_before, self.seen = child_pids(), set()

    def add(self, area: Area) -> None:
        """Watch ``area`` from now (digested now: the forks before do not matter to it)."""
        self.masks[area] = None

    def before_fork(self) -> None:
        areas = list(self.masks)
        found = _pagemap.own_pages(areas) if areas else None
        for area, mask in zip(areas, found or ()):
            was = self.masks[area]
            self.masks[area] = mask.copy() if was is None else was | mask

    def after_fork(self) -> None:
        # Even with no area watched yet: one may be digested before the next reset (a record
        # updated in place, see Snapshot.retake), and this child must not look unseen then.
        self.seen |= child_pids() or set()

    def at_forks(self, area: Area) -> Any:
        """The pages of ``area`` owned at some fork since the snapshot (None: no fork)."""
        return self.masks.get(area)

    def unseen_children(self) -> bool:
        """A child no fork of ours made (or /proc cannot tell): pages cannot be trusted."""
        now = child_pids()
        if now is None or self.children_before is None:
            return True
        return bool(now - self.children_before - self.seen)


def child_pids() -> set[bytes] | None:
    """This process's children (their pids), or None where /proc cannot tell. Read with bare
    descriptors: a kernel has a dozen threads, and this runs at every session cell's compare
    (a file object per thread cost twice as much)."""
    found: set[bytes] = set()
    try:
        for task in os.listdir("/proc/self/task"):
            fd = os.open(f"/proc/self/task/{task}/children", os.O_RDONLY | os.O_CLOEXEC)
            try:
                listed = b""
                while chunk := os.read(fd, 65536):
                    listed += chunk
            finally:
                os.close(fd)
            found.update(listed.split())
    except OSError:
        return None
    return found


FORKS = _ForkWatch()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=FORKS.before_fork, after_in_parent=FORKS.after_fork)
