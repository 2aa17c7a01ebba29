"""Which pages of a memory area a worker wrote, from Linux's /proc/self/pagemap (no hashing).

After a fork, the worker's anonymous pages are shared with the kernel until one side writes:
the write gives the writer a private copy, which pagemap reports as "exclusively mapped"
(bit 56, Linux 4.2+). A spawned worker maps large shipped tensors from a memfd, privately:
an unwritten page is a file page (bit 61), a written one an anonymous copy. So a page was
written by this process iff it is present, anonymous and exclusive. Pages that already are
before the cell (a small tensor shares its first and last page with malloc's bookkeeping) are
compared by a digest of their bytes instead (see digests).
Reading the flags of 2 GiB takes 4 MB of /proc reads, instead of hashing 2 GiB twice.
"""

from __future__ import annotations

import mmap
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy

PAGE = mmap.PAGESIZE
_PRESENT, _SWAPPED, _FILE, _EXCLUSIVE = 1 << 63, 1 << 62, 1 << 61, 1 << 56
_supported: bool | None = None


_fd: tuple[int, int] | None = None  # (pid, descriptor): /proc/self is the opener's, not a fork's


def _pagemap_fd() -> int | None:
    global _fd
    if _fd is None or _fd[0] != os.getpid():
        try:
            _fd = (os.getpid(), os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            return None
    return _fd[1]


def _entries(address: int, nbytes: int) -> numpy.ndarray | None:
    """The pagemap entries (a uint64 each) of the pages of an area, or None."""
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    fd = _pagemap_fd()
    if fd is None:
        return None
    try:
        data = os.pread(fd, (last - first + 1) * 8, first * 8)
    except OSError:
        return None
    import numpy

    return numpy.frombuffer(data, dtype=numpy.uint64)


def supported() -> bool:
    """Whether this kernel reports exclusively mapped pages (probed once per process)."""
    global _supported
    if _supported is None:
        _supported = sys.platform.startswith("linux") and _probe()
    return _supported


def _probe() -> bool:
    import ctypes

    area = mmap.mmap(-1, PAGE)
    try:
        area[0] = 1
        address = ctypes.addressof(ctypes.c_char.from_buffer(area))
        entries = _entries(address, PAGE)
        return entries is not None and int(entries[0]) & (_PRESENT | _EXCLUSIVE) == (_PRESENT | _EXCLUSIVE)
    except (OSError, ValueError, TypeError):
        return False
    finally:
        try:
            area.close()
        except BufferError:  # the ctypes view still refers to it; freed with the process
            pass


def own_pages(areas: list[tuple[int, int]]) -> list[Any] | None:
    """For each (address, nbytes) area, a boolean per page: this process has its own written
    copy of it (or it is swapped out: unknown, so counted). None where pagemap cannot tell.
    Neighbouring areas are read in one span of pagemap: thousands of small tensors cost a few
    reads, not thousands."""
    if not supported():
        return None
    import bisect

    import numpy

    spans: list[list[int]] = []  # [first page, last page], merged when close
    for first, last in sorted((a // PAGE, (a + n - 1) // PAGE) for a, n in areas if n > 0):
        if spans and first <= spans[-1][1] + 64:
            spans[-1][1] = max(spans[-1][1], last)
        else:
            spans.append([first, last])
    masks, starts = {}, []
    for first, last in spans:
        entries = _entries(first * PAGE, (last - first + 1) * PAGE)
        if entries is None:
            return None
        own = (entries & numpy.uint64(_PRESENT | _FILE | _EXCLUSIVE)) == numpy.uint64(_PRESENT | _EXCLUSIVE)
        masks[first] = own | ((entries & numpy.uint64(_SWAPPED)) != 0)
        starts.append(first)
    result = []
    for address, nbytes in areas:
        if nbytes <= 0:
            result.append(numpy.zeros(0, dtype=bool))
            continue
        first, last = address // PAGE, (address + nbytes - 1) // PAGE
        span = starts[bisect.bisect_right(starts, first) - 1]
        result.append(masks[span][first - span : last - span + 1])
    return result
