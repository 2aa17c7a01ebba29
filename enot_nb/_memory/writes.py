"""Which pages of a memory area this process wrote since a reset, told by the kernel: Linux's
userfaultfd in asynchronous write-protect mode (6.7+), read with the PAGEMAP_SCAN ioctl.

A long-lived process (a session's master, the notebook between session cells) owns every page
it ever wrote, so pagemap's "exclusively mapped" bit no longer tells what a cell wrote; the
fallback is a paused shadow fork (see _memory/shadow), whose first write to each page copies
it. Here instead a reset write-protects an area's pages (no copy, no fork); the first write to a
page after it is resolved by the kernel at once (no handler thread: the "async" mode) and marks
the page written, which one ioctl reports as ranges. Reading which of 2 GiB's pages were written
takes about 1 ms, against 15-20 ms for its 4 MB of pagemap; a reset costs what was written since.

Where the kernel or a sandbox (Docker's default seccomp profile refuses userfaultfd) says no,
``available`` is False and the caller uses the shadow fork. ``ENOT_NB_TRACK_WRITES=0`` turns it
off (to run the fallback). The state is this process's: a fork's child does not inherit the
registrations (the kernel drops them) and probes for itself.

A limit: a reset covers its area's pages, so areas that share interior pages (a NumPy array over
a tensor's memory, both large and both tracked) reset each other's bits there. Their first and
last pages are compared by digest anyway (see digests); a write to the shared interior between
one's reset and the other's comparison is missed. Taking a record resets every area at once, so
this needs a record updated in place for one of them only, while the other was written since.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import sys
from typing import Any

PAGE = mmap.PAGESIZE
_SYSCALL = {"x86_64": 323, "aarch64": 282}  # userfaultfd's number
_USER_MODE_ONLY = 1  # allowed without privilege (vm.unprivileged_userfaultfd=0)
_API = 0xAA
_FEATURE_WP_UNPOPULATED, _FEATURE_WP_ASYNC = 1 << 13, 1 << 15
_REGISTER_MODE_WP = 1 << 1
_SCAN_WP_MATCHING, _SCAN_CHECK_WPASYNC = 1 << 0, 1 << 1
_PAGE_IS_WRITTEN = 1 << 1


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [
        ("start", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("ioctls", ctypes.c_uint64),
    ]


class _Scan(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
            "category_inverted", "category_mask", "category_anyof_mask", "return_mask",
        )
    ]  # fmt: skip


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


def _iowr(kind: int, number: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | number


_UFFDIO_API = _iowr(0xAA, 0x3F, ctypes.sizeof(_Api))
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, ctypes.sizeof(_Register))
_PAGEMAP_SCAN = _iowr(ord("f"), 16, ctypes.sizeof(_Scan))
_REGIONS = 256  # ranges read per ioctl
MAX_REGISTRATIONS = 8192
"""Areas registered per process at most: each may split a memory mapping in three (the heap's,
around a tensor of the allocator's), and none is undone, while a process may hold only
``vm.max_map_count`` mappings (65530 by default). Past it, an area is digested whole."""


def _span(area: tuple[int, int]) -> tuple[int, int]:
    start, nbytes = area
    return start // PAGE * PAGE, (start + nbytes + PAGE - 1) // PAGE * PAGE


class WriteTracker:
    """This process's userfaultfd and the areas reset on it (see the module's docstring)."""

    def __init__(self) -> None:
        self._pid: int | None = None
        self._uffd: int | None = None
        self._pagemap: int | None = None
        self._epochs: dict[tuple[int, int], int] = {}
        self._next = 0
        self._registered = 0

    def available(self) -> bool:
        if os.environ.get("ENOT_NB_TRACK_WRITES", "1") == "0":
            return False
        if self._pid != os.getpid():
            for fd in (self._uffd, self._pagemap):  # a fork's copies of its parent's: no use here
                if fd is not None:
                    os.close(fd)
            self._pid, self._epochs, self._registered = os.getpid(), {}, 0
            self._uffd, self._pagemap = _open()
        return self._uffd is not None

    def reset(self, areas: list[tuple[int, int]]) -> list[int | None]:
        """Write-protect each area's pages; its epoch (what ``written`` takes), or None where
        the area cannot be tracked (the caller digests it whole)."""
        return [self._reset(area) for area in areas]

    def _reset(self, area: tuple[int, int]) -> int | None:
        start, end = _span(area)
        if not self._scan(start, end, _SCAN_WP_MATCHING):
            if self._registered >= MAX_REGISTRATIONS:
                return None
            self._registered += 1
            register = _Register(start, end - start, _REGISTER_MODE_WP, 0)
            try:
                fcntl.ioctl(self._uffd, _UFFDIO_REGISTER, register)  # type: ignore[arg-type]
            except OSError:
                return None
            if not self._scan(start, end, _SCAN_WP_MATCHING):
                return None
        self._next += 1
        self._epochs[area] = self._next
        return self._next

    def written(self, area: tuple[int, int], epoch: int) -> Any:
        """A boolean per page of ``area``: written since its reset ``epoch``; None if it was
        reset again since, or the kernel cannot tell (the caller takes it all as written)."""
        if self._epochs.get(area) != epoch or self._pid != os.getpid():
            return None
        import numpy

        start, end = _span(area)
        mask = numpy.zeros((end - start) // PAGE, dtype=bool)
        return mask if self._scan(start, end, 0, mask) else None

    def _scan(self, start: int, end: int, flags: int, mask: Any = None) -> bool:
        """PAGEMAP_SCAN over [start, end) for written pages, marked in ``mask`` (and protected
        again with _SCAN_WP_MATCHING); False if the kernel refused (an area not registered)."""
        regions = (_Region * _REGIONS)()
        at = start
        while at < end:
            arg = _Scan(ctypes.sizeof(_Scan), flags | _SCAN_CHECK_WPASYNC, at, end, 0, ctypes.addressof(regions))
            arg.vec_len, arg.category_mask, arg.return_mask = _REGIONS, _PAGE_IS_WRITTEN, _PAGE_IS_WRITTEN
            try:
                found = fcntl.ioctl(self._pagemap, _PAGEMAP_SCAN, arg)  # type: ignore[arg-type]
            except OSError:
                return False
            if mask is not None:
                for region in regions[:found]:
                    mask[(region.start - start) // PAGE : (region.end - start) // PAGE] = True
            at = max(arg.walk_end, at + PAGE) if found == _REGIONS else end
        return True


def _open() -> tuple[int | None, int | None]:
    """A userfaultfd with asynchronous write protection, and /proc/self/pagemap; (None, None)
    where this kernel or sandbox does not give both."""
    number = _SYSCALL.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None, None
    uffd = ctypes.CDLL(None, use_errno=True).syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY)
    if uffd < 0:
        return None, None
    try:
        api = _Api(_API, _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED, 0)
        fcntl.ioctl(uffd, _UFFDIO_API, api)
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(uffd)
        return None, None
    if not _works(uffd, pagemap):
        os.close(uffd)
        os.close(pagemap)
        return None, None
    return uffd, pagemap


def _works(uffd: int, pagemap: int) -> bool:
    """One page tracked: a write after the reset is seen, and only it."""
    import numpy

    area = mmap.mmap(-1, 2 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = numpy.frombuffer(area, dtype=numpy.uint8)
    start = view.__array_interface__["data"][0]
    probe = WriteTracker()
    probe._pid, probe._uffd, probe._pagemap = os.getpid(), uffd, pagemap
    try:
        view[:] = 1
        epoch = probe._reset((start, 2 * PAGE))
        if epoch is None:
            return False
        view[PAGE] = 2
        seen = probe.written((start, 2 * PAGE), epoch)
        return seen is not None and seen.tolist() == [False, True]
    finally:
        del view
        area.close()


WRITES = WriteTracker()
"""This process's tracker of written pages (see the module's docstring)."""
