"""Which pages of these areas were written since the mark: the one question that change
detection asks of memory, answered by whichever mechanism works here, chosen in this module
alone:

* **the kernel's write tracking** (writes: userfaultfd's asynchronous write protection, read
  with ``PAGEMAP_SCAN``): ``mark`` write-protects an area; every page written since is told.
  Where the kernel allows it, a long-lived process (a session's master, the notebook between
  session cells) marks its large storages so.
* **pagemap ownership with a fork watch** (pagemap, forks): a process that was just forked or
  spawned owns only the pages it wrote since; a page owned at one of its forks since the mark
  counts as written. A one-off cell's master, and every area the kernel does not track.
* **a shadow fork** (shadow): where the kernel refuses write tracking, a long-lived process
  makes a paused fork of itself before its snapshot, so that ownership tells again which pages
  it wrote since (``before_long_lived_snapshot``).

digests builds its page digests on these; nothing else in the package asks pagemap, the write
tracker, the fork watch or the shadow directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from enot_nb._memory import pagemap as _pagemap
from enot_nb._memory.forks import FORKS
from enot_nb._memory.shadow import SHADOW
from enot_nb._memory.writes import WRITES

Area = tuple[int, int]
"""A memory area: (address, length)."""

PAGE = _pagemap.PAGE


def kernel_tracks_writes() -> bool:
    """Whether the kernel tells this process's writes page by page (see writes)."""
    return WRITES.available()


def marks_hold() -> bool:
    """Whether marks made earlier still tell every write since (a long-lived process keeps a
    snapshot from one task to the next only then): the kernel tracks writes, and no child that
    no fork of ours made appeared (the fork watch would have missed its pages)."""
    return WRITES.available() and not FORKS.unseen_children()


def mark(areas: list[Area]) -> list[int | None]:
    """Write-protect ``areas`` where the kernel tracks writes: each one's mark (an epoch), or
    None where it is not tracked (page-locked memory, a refused registration, no tracking)."""
    if not areas or not WRITES.available():
        return [None] * len(areas)
    return list(WRITES.reset(areas))


def start_fork_watch() -> None:
    """From now on, record the pages owned at each fork (called as a snapshot begins)."""
    FORKS.reset()


def watch(area: Area) -> None:
    """Count the pages of ``area`` owned at a fork from now as written (see forks)."""
    FORKS.add(area)


def owned_pages(areas: list[Area]) -> list[Any] | None:
    """Which pages of each area this process owns now (a boolean array each), or None where
    pagemap cannot tell."""
    return _pagemap.own_pages(areas) if _pagemap.supported() else None


def pages_written_since(areas: list[Area], marks: list[int | None]) -> list[Any]:
    """For each area, the pages written since its mark: told by the kernel where it was marked
    so (``marks[j]`` an epoch), else the pages this process owns now or owned at a fork since
    the snapshot began; None where nothing can tell (a fork we did not see, a tracking reset
    since)."""
    found: list[Any] = [None] * len(areas)
    owned = [j for j, epoch in enumerate(marks) if epoch is None]
    for j, epoch in enumerate(marks):
        if epoch is not None:
            found[j] = WRITES.written(areas[j], epoch)
    masks = _pagemap.own_pages([areas[j] for j in owned]) if owned and not FORKS.unseen_children() else None
    for j, mask in zip(owned, masks or ()):
        at_forks = FORKS.at_forks(areas[j])
        found[j] = mask if at_forks is None else mask | at_forks
    return found


def before_long_lived_snapshot(owned_share: Callable[[], float]) -> bool:
    """Before a long-lived process's snapshot: whether its large storages are to be marked
    (``scan_large``). Where the kernel tracks writes, they are: True, and no shadow is kept.
    Else the shadow fork is made, or renewed once ``owned_share()`` of the large storages'
    pages is owned again; right after that no page is owned, and they need not be read
    (False)."""
    if WRITES.available():
        SHADOW.end()
        return True
    return SHADOW.before_snapshot(owned_share())


def end_shadow() -> None:
    """New workers hold nothing of the old: the shadow fork, if any, is ended."""
    SHADOW.end()


def fork_watch_holds() -> bool:
    """Whether every child of this process since the fork watch started is one of our forks
    (else pagemap ownership cannot tell what was written)."""
    return not FORKS.unseen_children()
