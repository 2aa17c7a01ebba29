"""Which pages of a memory area a worker wrote, from Linux's /proc/self/pagemap (no hashing).

After a fork, the worker's anonymous pages are shared with the kernel until one side writes:
the write gives the writer a private copy, which pagemap reports as "exclusively mapped"
(bit 56, Linux 4.2+). A spawned worker maps large shipped tensors from a memfd, privately:
an unwritten page is a file page (bit 61), a written one an anonymous copy. So a page was
written by this process iff it is present, anonymous and exclusive; an area where some page
already is, before the cell, is left to the content digest instead (see _objgraph.Snapshot).
Reading the flags of 2 GiB takes 4 MB of /proc reads, instead of hashing 2 GiB twice.
"""

from __future__ import annotations

import mmap
import os
import sys

PAGE = mmap.PAGESIZE
_PRESENT, _SWAPPED, _FILE, _EXCLUSIVE = 1 << 63, 1 << 62, 1 << 61, 1 << 56
_supported: bool | None = None


def _entries(address: int, nbytes: int) -> list[int] | None:
    first, last = address // PAGE, (address + nbytes - 1) // PAGE
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.pread(fd, (last - first + 1) * 8, first * 8)
    except OSError:
        return None
    finally:
        os.close(fd)
    import numpy

    return numpy.frombuffer(data, dtype=numpy.uint64)


def written_pages(address: int, nbytes: int) -> int | None:
    """How many pages of the area this process has its own written copy of (or has swapped
    out: unknown, so counted); None where pagemap cannot tell."""
    if not supported() or nbytes <= 0:
        return None
    entries = _entries(address, nbytes)
    if entries is None:
        return None
    import numpy

    own = (entries & numpy.uint64(_PRESENT | _FILE | _EXCLUSIVE)) == numpy.uint64(_PRESENT | _EXCLUSIVE)
    swapped = (entries & numpy.uint64(_SWAPPED)) != 0
    return int(numpy.count_nonzero(own | swapped))


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
