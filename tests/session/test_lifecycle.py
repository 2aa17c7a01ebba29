"""A session's life: its table, one session at a time, hundreds of cells without growth."""

from __future__ import annotations

import os

import pytest
import torch

import enot_nb
from enot_nb.errors import LaunchError
from tests.session.common import start

pytestmark = pytest.mark.timeout(120)


def test_status_shows_a_row_per_rank():
    with start("fork", namespace={}) as s:
        s.run("x = 1")
        status = s.status()
        assert [r.rank for r in status.rows] == [0, 1]
        assert all(r.state == "idle" and r.rss_mib and r.cells == 1 and r.device == "cpu" for r in status.rows)
        assert "rank" in str(status) and "<table>" in status._repr_html_()


def test_a_second_session_is_refused_and_a_closed_one_says_so():
    with start("fork", namespace={}) as s:
        with pytest.raises(LaunchError, match="already running"):
            start("fork", namespace={})
    with pytest.raises(LaunchError, match="closed"):
        s.run("pass")


class _KernelsOwn:
    """An object only the kernel holds (no cell's variable)."""


def test_a_forked_rank_does_not_collect_the_kernels_objects():
    """Ranks are forked with the kernel's objects frozen, so a rank's collector neither walks
    them (copying the pages they sit on) nor hands them to what searches the collector (the
    repair after a failed cell: a pulled copy of a DDP wrapper or a ZeRO optimizer is not the
    rank's). On Python 3.12.1, which freezes 375 objects of its own at start-up, they were not."""
    held = _KernelsOwn()
    with start("fork", namespace={}) as s:
        seen = s.run("import gc\nsorted({type(o).__qualname__ for o in gc.get_objects()} & {'_KernelsOwn'})")
    assert seen == [] and held is not None


def _counts(pid: int) -> tuple[int, int, float]:
    """Descriptors, threads and resident memory (MiB) of a process, from /proc."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
    return fds, threads, rss


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_five_hundred_cells_grow_no_descriptors_threads_or_memory():
    ns = {"t": torch.zeros(1000), "log": []}
    with start("fork", namespace=ns) as s:
        cell = "t.add_(1)\nlog.append(len(log))\nif len(log) > 10:\n    del log[0]\nx = float(t[0])"
        for _ in range(50):  # warm up: caches, the allocator, lazily made helpers
            s.run(cell)
        pids = [os.getpid(), *(row.pid for row in s.status().rows)]
        before = [_counts(pid) for pid in pids]
        for _ in range(500):
            s.run(cell)
        after = [_counts(pid) for pid in pids]
        assert ns["x"] == 550.0
    for pid, (fds0, threads0, rss0), (fds1, threads1, rss1) in zip(pids, before, after):
        assert (fds1, threads1) == (fds0, threads0), f"pid {pid}: descriptors or threads grew"
        assert rss1 - rss0 < 16, f"pid {pid}: resident memory grew by {rss1 - rss0:.1f} MiB over 500 cells"


def test_a_one_off_spawn_launch_runs_beside_a_spawn_session():
    """A spawn session has its own fork server and holds no launch lock between cells."""
    with start("spawn", namespace={}) as s:
        s.run("x = 1")
        assert enot_nb.notebook_launcher(_rank_plus, args=(10,), nprocs=2, backend="gloo", start_method="spawn") == 10
        assert s.run("x + 1") == 2


def _rank_plus(k: int) -> int:
    return enot_nb.distributed.get_rank() + k


def test_the_device_checksum_sees_every_byte_and_its_place(monkeypatch):
    """GPU storages are checksummed where they are (digests.device_checksum); run here on the
    CPU, with chunks small enough that words, tails and chunk edges are all met."""
    from enot_nb._memory import digests

    monkeypatch.setattr(digests, "_CHECKSUM_CHUNK", 64)
    data = torch.arange(203, dtype=torch.uint8)
    before = digests.device_checksum(data.untyped_storage())
    for at in (0, 7, 63, 64, 200, 202):
        data[at] += 1
        assert digests.device_checksum(data.untyped_storage()) != before, at
        data[at] -= 1
    assert digests.device_checksum(data.untyped_storage()) == before
    swapped = data.clone()
    swapped[0:8], swapped[8:16] = data[8:16].clone(), data[0:8].clone()  # the same words, moved
    assert digests.device_checksum(swapped.untyped_storage()) != before
