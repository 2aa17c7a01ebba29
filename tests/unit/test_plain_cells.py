"""What the plain cells run since a session's last sync can reach (_session/kernel/plain_cells):
all the next push compares. In a real IPython shell, in this process."""

from __future__ import annotations

import threading

import pytest
from IPython.core.interactiveshell import InteractiveShell

from enot_nb._session.kernel.plain_cells import THREAD_STARTS, PlainCells


@pytest.fixture
def shell():
    shell = InteractiveShell.instance()
    shell.run_cell("big = list(range(10))\nsmall = [1]\ndef bump():\n    small.append(2)\n")
    yield shell
    shell.run_cell("%reset -f")


def test_only_what_the_plain_cells_reach_is_compared(shell):
    sync = [0]
    cells = PlainCells(shell, lambda: sync[0])
    try:
        ns = shell.user_ns
        shell.run_cell("y = 2")
        reached = cells.reached(ns, shell.user_ns_hidden)
        assert reached is not None and reached.find(ns["big"]) is None and reached.find(ns["small"]) is None
        shell.run_cell("bump()")  # through a notebook function's globals
        reached = cells.reached(ns, shell.user_ns_hidden)
        assert reached.find(ns["small"]) is not None and reached.find(ns["big"]) is None
        shell.run_cell("%%enot_distributed\nbig.append(1)")  # a session cell: in the record (it fails here: no magic)
        assert cells.reached(ns, shell.user_ns_hidden).find(ns["big"]) is None
        shell.run_cell("globals()['big'].append(3)")  # reads the namespace by name: everything
        assert cells.reached(ns, shell.user_ns_hidden) is None
        sync[0] += 1  # a session task synced: the cells before it are in the record
        assert cells.reached(ns, shell.user_ns_hidden).objects[1:] == []
    finally:
        cells.close()


def test_a_cell_that_ran_a_session_task_counts_after_its_sync(shell):
    """``s.run(...)`` in a plain cell, then a change in the same cell: the change comes after the
    task's sync, so the cell still counts."""
    sync = [0]
    cells = PlainCells(shell, lambda: sync[0])
    shell.user_ns["synced"] = lambda: sync.__setitem__(0, sync[0] + 1)
    try:
        shell.run_cell("synced()\nsmall.append(5)")
        reached = cells.reached(shell.user_ns, shell.user_ns_hidden)
        assert reached is not None and reached.find(shell.user_ns["small"]) is not None
    finally:
        cells.close()


def test_a_fresh_cell_is_compared_as_a_plain_one_and_only_its_magic_line_says_so(shell):
    """``%%enot_distributed --fresh`` is a one-off launch whose changes come back into the
    notebook: it counts as a plain cell does (a magic reads the namespace by name: everything is
    compared); a session cell that only mentions ``--fresh`` in its body is still a session
    cell (in the record)."""
    sync = [0]
    cells = PlainCells(shell, lambda: sync[0])
    try:
        ns = shell.user_ns
        shell.run_cell("%%enot_distributed\nprint('--fresh')\nbig.append(1)")  # fails here: no magic
        assert cells.reached(ns, shell.user_ns_hidden).find(ns["big"]) is None
        shell.run_cell("%%enot_distributed -n 2 --fresh\nsmall.append(1)")
        assert cells.reached(ns, shell.user_ns_hidden) is None
    finally:
        cells.close()


def test_a_second_tracker_leaves_threads_running_and_counted(shell):
    """Each session's tracker installs the hook that counts threads started; a second one must
    not chain the hook to itself (every later thread would die of recursion), and the last one
    closed puts back what was there."""
    before_hook = threading._profile_hook
    first, second = PlainCells(shell, lambda: 0), PlainCells(shell, lambda: 0)
    try:
        counted, ran = THREAD_STARTS.count, []
        thread = threading.Thread(target=ran.append, args=(1,))
        thread.start()
        thread.join()
        assert ran == [1] and THREAD_STARTS.count == counted + 1
        assert first.outside() is not None  # a thread started since its last sample
    finally:
        second.close()
        first.close()
    assert threading._profile_hook is before_hook
