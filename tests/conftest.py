"""Shared fixtures: every test must leave no child process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", help="run the 200-launch soak (slow)")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(pid: int | None = None) -> list[int]:
    """Pids of every living descendant of ``pid`` (this process by default), from /proc."""
    pid = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(int(entry))
        if fields is None or fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def is_fork_server_of(pid: int, owners: set[int]) -> bool:
    """The fork server and the watchdog are by-design helpers that live as long as their owner
    (tested apart)."""
    fields = _stat(pid)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    helper = b"enot_nb._forkserver" in cmdline or b"enot_nb/_watchdog.py" in cmdline
    return fields is not None and int(fields[1]) in owners and helper


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves a descendant process running (checked for up to 5 s)."""
    before = set(descendants())
    yield
    owners = before | {os.getpid()}
    deadline = time.monotonic() + 5
    while True:
        left = {p for p in set(descendants()) - before if not is_fork_server_of(p, owners)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for pid in left:  # one failing test must not make every later one fail
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left behind: {sorted(left)}"


@pytest.fixture(params=["fork", "spawn"])
def start_method(request):
    """Each test that takes it runs under both start methods."""
    return request.param
