"""Shared fixtures: every test must leave no child process behind; the differential suites' pair
of kernels."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests._util import LEAK_GRACE, descendants, ended_within, is_fork_server_of
from tests.kernel import running_kernel


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", help="run the 200-launch soak (slow)")


@pytest.fixture(scope="module")
def kernels():
    """The differential suites' kernels: one runs cells plainly, the other under the magic."""
    with running_kernel() as local, running_kernel("%load_ext enot_nb") as dist:
        yield local, dist


def _fork_servers(owners: set[int]) -> set[int]:
    return {p for p in descendants() if is_fork_server_of(p, owners)}


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves a descendant process running (one that outlives LEAK_GRACE), or
    a session of this process live (its workers would be the next test's leftovers)."""
    before = set(descendants())
    yield
    sessions = sys.modules.get("enot_nb.sessions")
    live = sessions.session() if sessions is not None else None
    if live is not None:
        live.close()
    assert live is None, "a session was left running: close it (or use `with Session(...)`)"
    owners = before | {os.getpid()}
    left = set(ended_within(lambda: sorted(set(descendants()) - before - _fork_servers(owners)), LEAK_GRACE))
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


BUSY_PROCESSES = 4
"""The load of ``cpu_load``: busy processes, twice the cores of a CI machine (2)."""


@pytest.fixture(params=[0, BUSY_PROCESSES], ids=["idle", "loaded"])
def cpu_load(request):
    """The test runs on an idle machine, and again beside BUSY_PROCESSES processes that spin on
    the CPU for its whole length (a long run on a shared machine); they are killed after it."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(request.param)]
    try:
        yield request.param
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait()
