"""Shared fixtures: every test must leave no child process behind."""

from __future__ import annotations

import os
import time

import pytest


def descendants(pid: int | None = None) -> list[int]:
    """Pids of every living descendant of ``pid`` (this process by default), from /proc."""
    pid = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves a descendant process running (checked for up to 5 s)."""
    from enot_nb import _spawn

    before = set(descendants())
    yield
    if _spawn.server_pid() is not None:  # the fork server lives as long as this process
        before.add(_spawn.server_pid())
    deadline = time.monotonic() + 5
    while True:
        left = set(descendants()) - before
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"processes left behind: {sorted(left)}"
