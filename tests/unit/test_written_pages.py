"""Which pages were written since the mark (_memory/written.py, _memory/writes.py)."""

from __future__ import annotations

import os

import pytest
import torch


def test_the_kernel_tells_which_pages_were_written_since_a_reset_and_only_those():
    """writes.WRITES: one element written after a reset is one page; a second reset makes the
    first epoch unusable (None: the caller takes everything as written); a forked child's
    writes are its own; a fresh reset sees nothing written. The first and last pages are left
    out: they hold the allocator's neighbours too (digests compares their bytes instead)."""

    import torch

    from enot_nb._memory.writes import PAGE, WRITES

    if not WRITES.available():
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    t = torch.zeros(2**22)  # 16 MiB
    storage = t.untyped_storage()
    area = (storage.data_ptr(), storage.nbytes())
    (epoch,) = WRITES.reset([area])
    assert epoch is not None and not WRITES.written(area, epoch)[1:-1].any()
    t[2**21] = 1.0
    pid = os.fork()
    if pid == 0:
        t[7] = 2.0  # the child's page
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    interior = WRITES.written(area, epoch)[1:-1]
    offset = (storage.data_ptr() % PAGE + 2**21 * 4) // PAGE
    assert (interior.nonzero()[0] + 1).tolist() == [offset]
    (again,) = WRITES.reset([area])
    assert WRITES.written(area, epoch) is None and not WRITES.written(area, again)[1:-1].any()


def test_storages_whose_writes_are_not_told_are_digested_whole(monkeypatch):
    """A long-lived snapshot digests whole what the kernel cannot track for it: a storage in
    memory shared with other processes (their writes go through their own page tables: a
    forked child's write into its interior is seen), and one past the tracker's registrations
    (MAX_REGISTRATIONS)."""
    import mmap

    from enot_nb._memory import digests, writes

    if not writes.WRITES.available():
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    maps = [mmap.mmap(-1, 2**18) for _ in range(2)]  # pages that no registration covers yet
    shared = torch.zeros(2**16).share_memory_()  # 256 KiB: tracked, if it were not shared
    plain, capped = (torch.frombuffer(m, dtype=torch.float32) for m in maps)
    storages = [shared.untyped_storage(), plain.untyped_storage()]
    before = digests.storage_digests(storages, scan_large=True)
    assert [type(d).__name__ for d in before] == ["AreaDigest", "PagesDigest"]
    pid = os.fork()
    if pid == 0:
        shared[2**15] = 1.0  # the child's write, into shared memory
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert digests.changed_storages(storages, before) == [0]
    monkeypatch.setattr(writes, "MAX_REGISTRATIONS", writes.WRITES._registered)  # no room for another
    (digest,) = digests.storage_digests([capped.untyped_storage()], scan_large=True)
    assert type(digest).__name__ == "AreaDigest"
    capped[2**15] = 1.0
    assert digests.changed_storages([capped.untyped_storage()], [digest]) == [0]
    del plain, capped, storages
    for m in maps:
        m.close()
