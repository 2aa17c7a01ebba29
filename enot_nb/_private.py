"""The notebook's shared-memory tensors become private in a forked worker.

A tensor put in shared memory (``share_memory_()``) stays shared across a fork: every rank
would write the notebook's own memory, so a successful cell would leave the sum of all ranks'
writes instead of the master's, and a failed one partial writes. A spawned worker already gets
private copies; here, each such storage's pages are replaced, at the same addresses, by private
pages holding the same bytes (one copy, then ``mremap`` over the shared ones), so every
pointer and view stays valid and the master's changes come back as any other tensor's.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

_PAGE = mmap.PAGESIZE
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                         ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_FAILED = ctypes.c_void_p(-1).value


def make_private(storages: list[Any]) -> int:
    """Give each shared CPU storage private pages; returns how many were."""
    shared = _shared_mappings()
    made = 0
    for storage in storages:
        if storage.device.type != "cpu" or not storage.nbytes() or not storage.is_shared():
            continue
        start = storage.data_ptr() // _PAGE * _PAGE
        end = -(-(storage.data_ptr() + storage.nbytes()) // _PAGE) * _PAGE
        if any(first <= start and end <= last for first, last in shared):  # only a shared mapping
            _remap_private(start, end - start)
            made += 1
    return made


def _shared_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's shared, writable mappings (/proc/self/maps)."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            if perms.startswith("rw") and perms[3] == "s":
                first, last = span.split("-")
                found.append((int(first, 16), int(last, 16)))
    return found


def _remap_private(address: int, length: int) -> None:
    fresh = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE,
                       mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if fresh in (None, _FAILED):
        raise MemoryError(f"could not map {length} bytes for a private copy of a shared tensor")
    ctypes.memmove(fresh, address, length)
    moved = _libc.mremap(fresh, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
    if moved != address:
        _libc.munmap(fresh, length)
        raise OSError(ctypes.get_errno(), "mremap over a shared tensor failed")
