"""Shared memory for pickles: the one memfd of a launch's shipped tensors, private mappings.

To spawned workers, a CPU storage of ``SHM_MIN_BYTES`` or more is copied once into one
anonymous shared-memory file (memfd) per launch, at a page-aligned offset, instead of into the
pickle; the one descriptor travels beside the pickle (to the fork server, then inherited by the
workers) and each worker maps its part copy-on-write: one memory copy in all, however many
workers read it and however many tensors there are, and nothing large goes through a pipe.

Mappings are made with libc's mmap, which (unlike Python's mmap module) keeps no descriptor
open: a kept result or a shipped tensor pins memory, never a file descriptor.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from typing import Any

from enot_nb._processes.interrupts import interrupts_deferred

SHM_MIN_BYTES = int(float(os.environ.get("ENOT_NB_SHM_MIN_MB", "1")) * 2**20)

SHARED_FD: list[int] = []
"""In a spawned worker: the memfd of the shipped tensors, if any came."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_private(fd: int, length: int, offset: int = 0) -> Any:
    """A private, writable (copy-on-write) mapping of ``fd``; unmapped when no longer referenced,
    and holding no descriptor (Python's mmap keeps a duplicate of the fd open). A ctypes char
    array (or an empty bytearray): a writable buffer either way."""
    if length == 0:
        return bytearray()
    address = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    if address in (None, _MAP_FAILED):
        errno_ = ctypes.get_errno()
        raise OSError(errno_, f"mmap of {length} bytes failed: {os.strerror(errno_)}")
    area = (ctypes.c_char * length).from_address(address)
    weakref.finalize(area, _libc.munmap, address, length)
    return area


class SharedFile:
    """The one memfd of a launch's shipped tensors, filled as the pickler meets them."""

    def __init__(self, owned: list[int]) -> None:
        self.size = 0
        with interrupts_deferred():  # made and recorded for its owner as one step
            self.fd = os.memfd_create("enot_nb-tensor", os.MFD_CLOEXEC)
            owned.append(self.fd)

    def add(self, data: Any) -> int:
        """Copy ``data`` (a buffer) in at the next page boundary; returns its offset."""
        offset = -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE
        self.size = offset + data.nbytes
        os.ftruncate(self.fd, self.size)
        # The one copy; pwrite lets the kernel fill the pages (measured ~10% faster than a mapping).
        pwrite_all(self.fd, data, offset)
        return offset


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of the buffer ``data`` at ``offset`` (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def release_later(fds: list[int]) -> None:
    """Close shared-memory descriptors off the caller's path: freeing 2 GiB of memfd pages
    takes about 0.25 s here, which the notebook need not wait for."""
    if fds:
        threading.Thread(target=close_all, args=(fds,), name="enot_nb-release", daemon=True).start()
