"""Which collective each rank is in: the table a stop press, a hang (``--hang-after``) and a
collective's timeout show, in a real kernel under fork and spawn; and what the table concludes
from the ranks' numbers (unit cases, no process)."""

from __future__ import annotations

import re

import pytest

from enot_nb._launch.collective_table import findings, table
from enot_nb._worker.cell import CELL_FILENAME
from enot_nb._worker.collectives import Collective, Snapshot, decoded, encoded
from tests.kernel import Kernel, running_kernel

pytestmark = pytest.mark.timeout(240)

MISMATCH = re.compile(
    r"rank 1 waits in all_reduce #(\d+) on WORLD, float32\[1024\]; rank 0 is in broadcast #\1 on WORLD, float32\[8\]"
)
NEVER_REACHED = re.compile(
    r"rank 0 never reached all_reduce #\d+ on WORLD, float32\[4\]: it is at Cell In\[\d+\], line 4"
)
# Rank 0 sleeps (no CPU time) before the all_reduce rank 1 already waits in: a hang until it wakes.
LATE_MASTER = (
    "import time, torch, torch.distributed as dist\n"
    "if dist.get_rank() == 0:\n"
    "    time.sleep({sleep})\n"
    "dist.all_reduce(torch.ones(4))\n"
)


def _session(k, start_method: str, extra: str = "") -> None:
    k.ok(f"%enot_session start -n 2 --backend gloo --start-method {start_method} {extra}")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_mismatched_collective_is_named_when_the_ranks_hang_and_on_the_stop_press(start_method):
    with running_kernel("%load_ext enot_nb") as k:
        _session(k, start_method)
        k.ok("%%enot_distributed\nimport torch, torch.distributed as dist\ndist.all_reduce(torch.ones(4))")
        pressed = []

        def press(run) -> None:
            if "no rank has made progress" in run.stderr and not pressed:
                pressed.append(True)
                k.manager.interrupt_kernel()

        run = k.run(
            "%%enot_distributed --hang-after 2\n"
            "if dist.get_rank() == 0:\n"
            "    dist.broadcast(torch.ones(8), 0)\n"
            "else:\n"
            "    dist.all_reduce(torch.ones(1024))\n",
            timeout=180,
            on_output=press,
        )
        assert pressed and run.error is not None and run.error["ename"] == "KeyboardInterrupt", run.stderr
        hang, _, after_press = run.stderr.partition("interrupted; where each of the 2 running rank(s) is")
        assert "the cell goes on: press stop to stop it (the session stays)" in hang
        for report in (hang, after_press):  # the hang's table, then the press's
            assert MISMATCH.search(report), run.stderr
            assert re.search(
                r"rank 0: broadcast #\d+ on WORLD, float32\[8\], waiting in it, at Cell In\[\d+\], line 3", report
            )
        assert (
            k.ok("%%enot_distributed\nx = dist.get_world_size()\nx").result["text/plain"] == "2"
        )  # the session goes on


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_hang_is_found_by_hang_after_and_the_cell_goes_on_in_a_session_and_a_one_off_cell(start_method):
    with running_kernel("%load_ext enot_nb") as k:
        one_off = k.ok(
            f"%%enot_distributed -n 2 --backend gloo --start-method {start_method} --hang-after 2\n"
            + LATE_MASTER.format(sleep=8)
        )
        assert "no rank has made progress (used CPU time) for 2 s; the launch goes on" in one_off.stderr
        assert NEVER_REACHED.search(one_off.stderr), one_off.stderr
        _session(k, start_method)
        quiet = k.ok("%%enot_distributed\n" + LATE_MASTER.format(sleep=3))  # the session's 300 s: no report
        assert "no rank has made progress" not in quiet.stderr
        cell = k.ok("%%enot_distributed --hang-after 2\n" + LATE_MASTER.format(sleep=8) + "done = True")
        assert cell.stderr.count("no rank has made progress") == 1, cell.stderr  # once per hang
        assert NEVER_REACHED.search(cell.stderr), cell.stderr
        assert k.ok("done").result["text/plain"] == "True"  # the cell ran to its end
        busy = k.ok(  # rank 0 computes while rank 1 waits: progress, no hang
            "%%enot_distributed --hang-after 2\nimport time, torch, torch.distributed as dist\n"
            "if dist.get_rank() == 0:\n    end = time.monotonic() + 5\n"
            "    while time.monotonic() < end:\n        sum(range(10_000))\n"
            "dist.all_reduce(torch.ones(4))\n"
        )
        assert "no rank has made progress" not in busy.stderr, busy.stderr
        k.ok("%enot_session restart --hang-after 2")
        again = k.ok("%%enot_distributed\n" + LATE_MASTER.format(sleep=8))
        assert NEVER_REACHED.search(again.stderr), again.stderr
        off = k.ok("%%enot_distributed --hang-after 0\n" + LATE_MASTER.format(sleep=5))  # the session's 2 s: off
        assert "no rank has made progress" not in off.stderr, off.stderr


def test_after_the_group_is_made_again_the_table_counts_on_the_new_group():
    """A collective left half done makes the world group again in the same processes: its
    numbers start again, and the old group's (higher) ones must not pass for the ranks' last."""
    with running_kernel("%load_ext enot_nb") as k:
        k.ok("%enot_session start -n 2 --backend gloo")
        k.ok(
            "%%enot_distributed\nimport time, torch, torch.distributed as dist\n"
            "for _ in range(50):\n    dist.all_reduce(torch.ones(4))"
        )
        failed = k.run(
            "%%enot_distributed\nif dist.get_rank() == 1:\n    raise ValueError('x')\ndist.all_reduce(torch.ones(4))"
        )
        assert failed.error is not None and "made again" in failed.stdout + failed.stderr, failed.stdout
        hang = k.ok("%%enot_distributed --hang-after 2\n" + LATE_MASTER.format(sleep=8))
        assert NEVER_REACHED.search(hang.stderr), hang.stderr
        waited = int(re.search(r"rank 1: all_reduce #(\d+) on WORLD", hang.stderr).group(1))
        assert waited < 50, hang.stderr  # the new group's number


def test_a_collective_that_times_out_shows_where_each_rank_stood(start_method):
    with running_kernel("%load_ext enot_nb") as k:
        _session(k, start_method, "--timeout 3 --hang-after 0")
        run = k.run("%%enot_distributed\n" + LATE_MASTER.format(sleep=8), timeout=120)
        assert run.error is not None and "Timed out" in run.error["evalue"], run.error
        assert "a collective timed out (the process group's --timeout); where each rank stood:" in run.stderr
        assert NEVER_REACHED.search(run.stderr), run.stderr
        assert re.search(
            r"rank 1: all_reduce #\d+ on WORLD, float32\[4\], waiting in it, at Cell In\[\d+\], line 5", run.stderr
        )
        assert k.ok("%%enot_distributed\nx = 1\nx").result["text/plain"] == "1"
        k.ok("%enot_session stop")
        one_off = k.run(
            f"%%enot_distributed -n 2 --backend gloo --start-method {start_method} --timeout 3\n"
            + LATE_MASTER.format(sleep=8),
            timeout=120,
        )
        assert one_off.error is not None and "a collective timed out" in one_off.stderr, one_off.stderr
        assert NEVER_REACHED.search(one_off.stderr), one_off.stderr


def test_without_the_recorder_the_groups_numbers_say_which_rank_is_behind():
    kernel = Kernel(extra_env={"ENOT_NB_COLLECTIVES_KEPT": "0"})  # TORCH_FR_BUFFER_SIZE=0 in the ranks
    try:
        kernel.ok("%load_ext enot_nb")
        kernel.ok("%enot_session start -n 2 --backend gloo --hang-after 2")
        kernel.ok("%%enot_distributed\nimport torch, torch.distributed as dist\ndist.all_reduce(torch.ones(4))")
        hang = kernel.ok("%%enot_distributed\n" + LATE_MASTER.format(sleep=8))
        assert "torch keeps no record of the ops here" in hang.stderr, hang.stderr
        behind = r"rank 0 ran (\d+) collective\(s\) on WORLD, rank 1 (\d+): rank 0 never reached the next one: "
        found = re.search(behind + r"it is at Cell In\[\d+\], line 4", hang.stderr)
        assert found and int(found.group(2)) == int(found.group(1)) + 1, hang.stderr
    finally:
        kernel.shutdown()


def test_the_session_defaults_to_a_documented_hang_after_and_takes_another():
    from enot_nb._defaults import SESSION_HANG_AFTER
    from enot_nb.sessions import Session

    assert SESSION_HANG_AFTER == 300.0
    with Session(nprocs=2, backend="gloo", quiet=True, namespace={}) as s:
        assert s.options.hang_after == SESSION_HANG_AFTER
    with Session(nprocs=2, backend="gloo", quiet=True, namespace={}, hang_after=0) as s:
        assert s.options.hang_after is None


# ----------------------------------------------------------------------------- the table alone


def _c(op, seq, waiting, tensors="float32[4]", group="WORLD", line=None):
    return Collective(op, group, seq, tensors, waiting, line)


def test_the_table_names_a_rank_that_never_reached_a_collective_and_where_it_is():
    snapshots = {
        0: Snapshot(True, [_c("all_reduce", 11, False)], (CELL_FILENAME, 7)),
        1: Snapshot(True, [_c("all_reduce", 12, True, line=(CELL_FILENAME, 9))], (CELL_FILENAME, 9)),
    }
    assert findings(snapshots) == [
        "rank 0 never reached all_reduce #12 on WORLD, float32[4]: it is at the cell, line 7"
    ]
    shown = table(snapshots)
    assert (
        shown is not None
        and "  rank 1: all_reduce #12 on WORLD, float32[4], waiting in it, at the cell, line 9" in shown
    )


def test_a_rank_with_no_collective_yet_never_reached_the_first():
    snapshots = {
        0: Snapshot(True, [], (CELL_FILENAME, 2)),
        1: Snapshot(True, [_c("all_reduce", 1, True, line=(CELL_FILENAME, 4))], (CELL_FILENAME, 4)),
    }
    assert findings(snapshots) == ["rank 0 never reached all_reduce #1 on WORLD, float32[4]: it is at the cell, line 2"]
    shown = table(snapshots) or ""
    assert "  rank 0: no collective yet, at the cell, line 2" in shown and "no record of the ops" not in shown


def test_the_table_names_different_collectives_and_one_past_the_others():
    mismatch = {
        0: Snapshot(True, [_c("broadcast", 813, True)], None),
        1: Snapshot(True, [_c("all_reduce", 812, True, "float32[1024]")], None),
    }
    assert findings(mismatch) == [
        "rank 1 waits in all_reduce #812 on WORLD, float32[1024]; rank 0 is in broadcast #813 on WORLD, float32[4]"
    ]
    issued_other = {
        0: Snapshot(True, [_c("broadcast", 5, False)], None),
        1: Snapshot(True, [_c("all_reduce", 5, True)], None),
    }
    assert findings(issued_other) == [
        "rank 0 issued broadcast #5 on WORLD, float32[4] (done there); "
        "rank 1 waits in all_reduce #5 on WORLD, float32[4]"
    ]
    every = {r: Snapshot(True, [_c("all_reduce", 3, True)], None) for r in (0, 1)}
    assert findings(every) == [
        "every rank waits in all_reduce #3 on WORLD, float32[4]: none is missing, one may be slow"
    ]
    assert findings({r: Snapshot(True, [_c("all_reduce", 3, False)], None) for r in (0, 1)}) == []


def test_without_the_recorder_the_sequence_numbers_say_who_is_behind():
    snapshots = {
        0: Snapshot(False, [_c("?", 4, False, "")], ("/work/train.py", 31)),
        1: Snapshot(False, [_c("?", 5, False, "")], None),
    }
    assert findings(snapshots) == [
        "rank 0 ran 4 collective(s) on WORLD, rank 1 5: rank 0 never reached the next one: it is at "
        '"/work/train.py", line 31'
    ]
    assert "torch keeps no record of the ops here" in (table(snapshots) or "")


def test_a_snapshot_travels_as_one_line_of_a_dump():
    taken = Snapshot(True, [_c("all_reduce", 2, True, line=(CELL_FILENAME, 3))], (CELL_FILENAME, 3))
    text, found = decoded('Thread 0x1 (most recent call first):\n  File "x", line 1 in f\n' + encoded(taken))
    assert found == taken and text == 'Thread 0x1 (most recent call first):\n  File "x", line 1 in f\n'
    assert decoded("no snapshot here\n") == ("no snapshot here\n", None)
