"""Whether memory changed: digests of storages and arrays, and pages a worker wrote (pagemap).

Before the cell the master records, for each CPU storage and NumPy array, either which of its
pages this process already owns and a digest of just those (where pagemap works: after a fork
or a spawn nothing else has been written yet), or a digest of all of its bytes. After the cell,
an area changed if the process owns a page it did not own before, or the owned pages' digest
differs (see pagemap: a write gives the writer its own copy of the page). GPU storages are
digested whole.
"""

from __future__ import annotations

import ctypes
import pickle
import sys
import zlib
from typing import Any, NamedTuple

from enot_nb._memory import written
from enot_nb._serialize.tensors import storage_array

Area = tuple[int, int]
"""A memory area: (address, length)."""


class AreaDigest(NamedTuple):
    """A digest of all of an area's bytes."""

    start: int
    size: int
    digest: tuple[int, int]


class PagesDigest(NamedTuple):
    """The pages of an area this process owned (``mask``), and a digest of just their bytes."""

    start: int
    size: int
    mask: Any  # a NumPy bool array, a page each
    digest: tuple[int, int]
    epoch: int | None = None
    """Where writes are tracked (see writes): the area's reset; what it wrote since is told by
    the kernel, not by the pages it owns (``mask`` then holds its first and last pages only)."""


class DeviceDigest(NamedTuple):
    """A storage off the CPU: where it is, and a digest of all of its bytes."""

    address: int
    nbytes: int
    digest: tuple[int, int]


StorageDigest = AreaDigest | PagesDigest | DeviceDigest


def digested_size(before: StorageDigest) -> int:
    """The bytes a storage had when it was digested."""
    return before.nbytes if isinstance(before, DeviceDigest) else before.size


class ArrayDigest(NamedTuple):
    """A NumPy array's view and contents: a digest of its area (one block of memory), of a
    contiguous copy (strided), or the ids of its items (an object array)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: Any
    content: AreaDigest | PagesDigest | tuple[int, ...]


def digest(buffer: Any) -> tuple[int, int]:
    """A content digest of a memory area (crc32 runs at ~4 GB/s here)."""
    view = memoryview(buffer).cast("B")
    return view.nbytes, zlib.crc32(view)


def pickle_digest(obj: Any) -> list[tuple[int, int]]:
    """A digest of an object's pickle, for objects whose state is theirs alone but lives where no
    ``__dict__`` shows it (a pandas DataFrame's blocks): the pickle's own bytes and each
    out-of-band buffer (an array's memory, digested where it lies, not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    main = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    return [digest(main)] + [digest(b.raw()) for b in buffers]


# ----------------------------------------------------------------------------- storages


def _storage_area(storage: Any) -> Area:
    return (storage.data_ptr(), storage.nbytes()) if storage.device.type == "cpu" else (0, 0)


def storage_digests(storages: list[Any], scan_large: bool = False) -> list[StorageDigest]:
    """``scan_large``: the large storages' pages are read too (see SCAN_MAX): this process may own
    some of them (a long-lived one whose shadow fork is older than its last writes)."""
    cpu = [j for j, s in enumerate(storages) if s.device.type == "cpu"]
    areas, owners = [_storage_area(storages[j]) for j in cpu], [storages[j] for j in cpu]
    found = dict(zip(cpu, _area_digests(areas, owners, scan_large)))
    return [found[j] if j in found else _device_digest(s) for j, s in enumerate(storages)]


def _device_digest(storage: Any) -> DeviceDigest:
    return DeviceDigest(storage.data_ptr(), storage.nbytes(), device_checksum(storage))


_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 (the golden ratio's bits), as a signed int64
_MIX2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 (splitmix64's multiplier), as a signed int64
_CHECKSUM_CHUNK = 1 << 26  # bytes hashed per step: the step's temporaries stay small


def device_checksum(storage: Any) -> tuple[int, int]:
    """A checksum of a storage's bytes computed where they are (a GPU's storage is never copied
    to the host): each 8-byte word mixed with its place, summed with wrapping int64 arithmetic,
    one number brought back. (nbytes, checksum), as ``digest`` returns."""
    import torch

    data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    total = torch.zeros((), dtype=torch.int64, device=storage.device)
    for start in range(0, data.numel(), _CHECKSUM_CHUNK):
        part = data[start : start + _CHECKSUM_CHUNK]
        whole = part.numel() // 8 * 8
        words = part[:whole].view(torch.int64)
        place = torch.arange(start // 8 + 1, start // 8 + 1 + words.numel(), dtype=torch.int64, device=data.device)
        total += ((words ^ (place * _MIX)) * _MIX2).sum()
        if whole < part.numel():
            tail = part[whole:].to(torch.int64)
            total += ((tail + 1) * (torch.arange(1, tail.numel() + 1, device=data.device) * _MIX2)).sum()
    return data.numel(), int(total.item())


def changed_storages(storages: list[Any], before: list[StorageDigest]) -> list[int]:
    """The indices of the storages whose bytes changed since ``before`` (storage_digests)."""
    cpu = [j for j, b in enumerate(before) if not isinstance(b, DeviceDigest) and storages[j].device.type == "cpu"]
    flags = dict(
        zip(
            cpu,
            _areas_changed(
                [_storage_area(storages[j]) for j in cpu], [storages[j] for j in cpu], [before[j] for j in cpu]
            ),
        )
    )
    changed = []
    for j, storage in enumerate(storages):
        if isinstance(before[j], DeviceDigest):
            if _device_digest(storage) != before[j]:
                changed.append(j)
        elif flags.get(j, True):
            changed.append(j)
    return changed


# ----------------------------------------------------------------------------- NumPy arrays


def array_digest(array: Any) -> ArrayDigest:
    import numpy

    view = (array.shape, array.strides, array.dtype)
    if array.dtype.hasobject:
        return ArrayDigest(*view, tuple(map(id, array.ravel().tolist())))
    if array.flags.c_contiguous:
        area = (array.__array_interface__["data"][0], array.nbytes)
        return ArrayDigest(*view, _area_digests([area], [array])[0])
    return ArrayDigest(*view, digest(numpy.ascontiguousarray(array).view(numpy.uint8).ravel()))


def array_changed(array: Any, before: ArrayDigest) -> bool:
    """Whether a NumPy array's view or contents changed since ``before`` (array_digest)."""
    if array.dtype.hasobject or not array.flags.c_contiguous:
        return before != array_digest(array)
    area = (array.__array_interface__["data"][0], array.nbytes)
    return (array.shape, array.strides, array.dtype) != (before.shape, before.strides, before.dtype) or _areas_changed(
        [area], [array], [before.content]
    )[0]


def _bytes_of(obj: Any) -> Any:
    """A flat uint8 view of a CPU storage or contiguous array."""
    import numpy

    if isinstance(obj, numpy.ndarray):  # subclasses too (masked arrays, memmaps): their data
        return numpy.asarray(obj).reshape(-1).view(numpy.uint8)
    return storage_array(obj)


def _is_array(obj: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.ndarray)


# ----------------------------------------------------------------------------- areas, pages


# Areas this large are not scanned before the cell: in a forked or spawned worker nothing has
# written their interior pages yet (they are the kernel's, or a memfd's), and assuming so can
# only make an area look changed, never hide a change. Saves reading 4 MB of pagemap per 2 GiB.
SCAN_MAX = 1 << 20

# Torch storages this large are write-tracked by the kernel where it can (see writes): their
# interior pages cost one ioctl at the reset and one at the comparison, and only the two edge
# pages (shared with neighbours) are digested. Below it a crc of every byte (about 15 us for
# 64 KiB here) costs no more than those two ioctls and the edges' digest.
TRACK_MIN = 1 << 16


def owned_share(storages: list[Any], recorded: list[StorageDigest] | None = None) -> float:
    """The share of the large storages' pages (see SCAN_MAX) that this process owns alone: 1.0
    where pagemap cannot tell, 0.0 without large storages. A long-lived process (a session's
    master, the notebook between session cells) makes a shadow fork (see _memory/shadow)
    when it is high: a snapshot then digests, and a change sends, only the pages written since.
    ``recorded``: the digests of other storages, kept from before: the pages they digest (owned
    when they were taken) count as owned, since each comparison digests them again."""
    large = [s for s in storages if s is not None and s.device.type == "cpu" and s.nbytes() >= SCAN_MAX]
    kept = [d.mask[1:-1] for d in recorded or () if isinstance(d, PagesDigest) and d.size >= SCAN_MAX]
    if not large and not kept:
        return 0.0
    masks = written.owned_pages([_storage_area(s) for s in large]) if large else []
    if masks is None or (large and not masks):
        return 1.0
    pages = [mask[1:-1] for mask in masks] + kept
    return sum(int(mask.sum()) for mask in pages) / max(1, sum(len(mask) for mask in pages))


def before_long_lived_snapshot(storages: list[Any], kept: list[StorageDigest] | None = None) -> bool:
    """Before a long-lived process's snapshot of ``storages`` (a session's master, the notebook's
    record of its ranks): its ``scan_large``. Where writes are tracked (see writes), the snapshot
    resets them: True, and no shadow is kept. Else the shadow fork (see _memory/shadow) is
    made, or renewed once too many pages are owned again (``kept``: see owned_share); right after
    that no page is owned, and the large storages' need not be read (False)."""
    return written.before_long_lived_snapshot(lambda: owned_share(storages, kept))


def _area_digests(areas: list[Area], owners: list[Any], scan_large: bool = False) -> list[AreaDigest | PagesDigest]:
    """What tells later whether an area's bytes changed: where pagemap works, the pages this
    process already owns (with a digest of just their bytes); elsewhere a digest of it all.
    ``scan_large`` (a long-lived process) where writes are tracked: the large storages' pages
    are write-protected instead (see writes), and none of them is owned from here."""
    # Only torch storages: a spawned worker's NumPy arrays arrive inside the pickle, already its own.
    large = [area[1] >= SCAN_MAX and not _is_array(owner) for area, owner in zip(areas, owners)]
    epochs: dict[int, int] = {}
    # Memory shared with other processes is written through their page tables, which neither
    # this process's write tracking nor its pagemap sees: a long-lived snapshot digests it whole.
    shared = [scan_large and not _is_array(owner) and _shared(owner) for owner in owners]
    whole = shared  # digested whole: pages owned or written tell nothing more
    if scan_large and written.kernel_tracks_writes():
        tracked = [
            j
            for j, (area, owner) in enumerate(zip(areas, owners))
            if area[1] >= TRACK_MIN and not _is_array(owner) and not shared[j] and not _pinned(owner)
        ]
        epochs = {j: e for j, e in zip(tracked, written.mark([areas[j] for j in tracked])) if e is not None}
        # Every other storage of a process that lives on is its own by now, all of it (a small
        # one: one crc costs less than reading its pages' flags), or its writes are not told
        # (page-locked memory, a reset refused): digested whole.
        whole = [j not in epochs and not _is_array(owner) for j, owner in enumerate(owners)]
    skip = [(is_large and not scan_large) or j in epochs or whole[j] for j, is_large in enumerate(large)]
    scanned = [(0, 0) if skipped else area for area, skipped in zip(areas, skip)]
    masks = written.owned_pages(scanned)
    digests: list[AreaDigest | PagesDigest] = []
    for j, (area, owner) in enumerate(zip(areas, owners)):
        if masks is not None and skip[j]:
            masks[j] = _no_pages(area)
        if masks is None or not area[1] or whole[j]:
            digests.append(AreaDigest(*area, _whole_digest(area, owner)))
        else:
            # The first and last pages may be shared with neighbours, which the cell may write:
            # their bytes are compared, like the pages already this process's own.
            mask = masks[j].copy()
            mask[0] = mask[-1] = True
            digests.append(PagesDigest(*area, mask, _digest_pages(area, owner, mask), epochs.get(j)))
            if j not in epochs:  # a fork does not hide a tracked write
                written.watch(area)
    return digests


def _whole_digest(area: Area, owner: Any) -> tuple[int, int]:
    """A digest of all of an area's bytes; a small one's read as a copy (``string_at``: cheaper
    than setting up a view, for so few bytes)."""
    if not area[1]:
        return (0, 0)
    if area[1] < TRACK_MIN:
        return area[1], zlib.crc32(ctypes.string_at(*area))
    return digest(_bytes_of(owner))


def _shared(storage: Any) -> bool:
    """A storage in memory shared with other processes (``share_memory_()``, a shared file)."""
    try:
        return bool(storage.is_shared())
    except (AttributeError, RuntimeError):
        return False


def _pinned(storage: Any) -> bool:
    """Page-locked host memory, which a device writes without a page fault: the kernel's write
    tracking cannot see those writes (where CUDA was never initialized, there is none)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    try:
        return bool(storage.is_pinned())
    except RuntimeError:
        return True


def _no_pages(area: Area) -> Any:
    import numpy

    first, last = area[0] // written.PAGE, (area[0] + area[1] - 1) // written.PAGE
    return numpy.zeros(last - first + 1, dtype=bool)


def _digest_pages(area: Area, owner: Any, mask: Any) -> tuple[int, int]:
    """A digest of the bytes of an area's marked pages, a run of them at a time (a crc of the
    runs, one after the other, is the crc of their bytes joined). An area on one page (a bias,
    a small tensor of a list of many) is read as a copy: setting up a view costs it more."""
    if len(mask) == 1:
        return (area[1], zlib.crc32(ctypes.string_at(*area))) if mask[0] and area[1] else (0, 0)
    if not mask.any():
        return (0, 0)
    data = _bytes_of(owner)
    crc, total = 0, 0
    for offset, length in [(0, area[1])] if mask.all() else _runs(area, mask):  # all: a small one, owned
        chunk = data[offset : offset + length]
        crc, total = zlib.crc32(chunk, crc), total + chunk.nbytes
    return (total, crc)


def _areas_changed(areas: list[Area], owners: list[Any], before: list[Any]) -> list[bool]:
    """Whether each area changed since ``before`` (its digest; anything else: changed)."""
    paged = [j for j, b in enumerate(before) if isinstance(b, PagesDigest) and (b.start, b.size) == areas[j]]
    masks = written.pages_written_since([areas[j] for j in paged], [before[j].epoch for j in paged]) if paged else []
    changed = [True] * len(areas)
    for j, mask in zip(paged, masks or [None] * len(paged)):
        was = before[j].mask
        if mask is None:
            continue
        elif len(mask) == 1:  # (one page: numpy's operations cost more than the page's own test)
            written_anew = bool(mask[0]) and not was[0]
        else:
            written_anew = bool((mask & ~was).any())
        changed[j] = written_anew or _digest_pages(areas[j], owners[j], was) != before[j].digest
    for j, b in enumerate(before):
        if isinstance(b, AreaDigest):
            changed[j] = (b.start, b.size) != areas[j] or b.digest != _whole_digest(areas[j], owners[j])
    return changed


def written_parts(storages: list[Any], befores: list[StorageDigest]) -> list[list[tuple[int, int]] | None]:
    """For each changed CPU storage, the (offset, length) byte ranges the cell may have written:
    its pages owned now or at a fork since the snapshot, and those owned before it (compared as
    one digest); each a run of whole pages, clipped to the storage. None: all of it (it is small,
    it moved or was resized, it is on a GPU, or pages cannot tell). One read of pagemap for all."""
    areas = [_storage_area(s) for s in storages]
    paged = [
        j
        for j, (area, before) in enumerate(zip(areas, befores))
        if isinstance(before, PagesDigest) and (before.start, before.size) == area and area[1] >= SCAN_MAX
    ]
    found: list[list[tuple[int, int]] | None] = [None] * len(storages)
    masks = written.pages_written_since([areas[j] for j in paged], [befores[j].epoch for j in paged]) if paged else []  # type: ignore[union-attr]
    for j, mask in zip(paged, masks):
        before = befores[j]
        assert isinstance(before, PagesDigest)
        found[j] = None if mask is None else _runs(areas[j], mask | before.mask)
    return found


def _runs(area: Area, pages: Any) -> list[tuple[int, int]]:
    """The runs of marked pages of an area, as (offset, length) within it."""
    import numpy

    base = area[0] // written.PAGE * written.PAGE - area[0]  # the first page's start, <= 0
    if len(pages) > 2 and not pages[1:-1].any():  # its edge pages at most (tracked, unwritten inside)
        last = base + (len(pages) - 1) * written.PAGE
        return [(0, base + written.PAGE)] * bool(pages[0]) + [(last, area[1] - last)] * bool(pages[-1])
    edges = numpy.flatnonzero(numpy.diff(numpy.concatenate(([0], pages.view(numpy.int8), [0]))))
    parts = []
    for first, end in zip(edges[::2].tolist(), edges[1::2].tolist()):
        low, high = max(0, base + first * written.PAGE), min(area[1], base + end * written.PAGE)
        parts.append((low, high - low))
    return parts
