"""The clean fork thread: every process this one starts is started from one long-lived thread.

Two traps make forking a Jupyter kernel hang or fail, and each has its own way out:

* GNU OpenMP (torch's CPU build): after the caller ran one parallel op, a child forked from
  that thread hangs forever in its first parallel op with 2+ threads, because libgomp keeps the
  (now missing) thread pool in the forking thread's thread-local state. Measured here: forking
  instead from a thread that never ran OpenMP gives a child with a fresh pool, full speed. So
  every fork happens on one long-lived "clean" thread (long-lived, because Linux's parent-death
  signal fires when the *thread* that forked exits). The fork server and the watchdog are
  started from it too.
* CUDA: a forked child cannot use CUDA once the caller initialized it. Then workers are forked
  by the fork server (see forkserver_client), a fresh interpreter that never touches CUDA.

A start is a transaction: every process is recorded (pid and pidfd) the moment it exists, so
whatever interrupts the start (the stop button, a failed fork) the caller can stop and reap
exactly what was started, and nothing else.
"""

from __future__ import annotations

import concurrent.futures
import gc
import os
import queue
import signal
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from enot_nb._processes.interrupts import interrupts_deferred
from enot_nb._processes.starts import hook

T = TypeVar("T")

_FROZEN_AT_START = gc.get_freeze_count()
"""What the interpreter froze itself (375 objects at start-up on Python 3.12.1, none on 3.11 or
3.13): more is the user's own gc.freeze(), which stays as it was."""


class _CleanThread:
    """A daemon thread, started on first use, that runs the calls that create processes, and
    nothing else."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _loop(self) -> None:
        while True:
            fn, future = self._requests.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            # Not held until the next request: a launch's closure holds its job (a cell's
            # registry of every notebook object), which must be freed with the launch.
            del fn, future

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        with interrupts_deferred(), self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="enot_nb-process-starter", daemon=True)
                self._thread.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._requests.put((fn, future))
        return future


_clean_thread = _CleanThread()
submit = _clean_thread.submit


def on_clean_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on the clean process-starting thread and return its result."""
    return submit(fn).result()


def settle(future: concurrent.futures.Future[Any] | None) -> None:
    """Wait for a clean-thread call to end, whatever it raised, through repeated interrupts:
    what it started must be known before it is stopped."""
    while future is not None:
        try:
            future.exception()
            return
        except KeyboardInterrupt:
            continue


def fork_all(
    children: list[tuple[int, Callable[[], Any]]], started: list[tuple[int, int, int]]
) -> concurrent.futures.Future[None]:
    """Fork one process per (rank, child) on the clean thread; each child leads its own process
    group. ``(rank, pid, pidfd)`` is appended to ``started`` the moment a child exists."""

    def run() -> None:
        hook("before_forks")
        # A forked child's first collection would walk every object the kernel holds (58 ms
        # over a million) and write to each one's header, copying the pages they sit on: frozen,
        # the child leaves them alone. The kernel unfreezes them at once.
        ours = gc.get_freeze_count() <= _FROZEN_AT_START  # the user's own gc.freeze() stays as it was
        if ours:
            gc.freeze()
        try:
            _fork_each(children, started)
        finally:
            if ours:
                gc.unfreeze()
        hook("after_forks")

    return submit(run)


def _fork_each(children: list[tuple[int, Callable[[], Any]]], started: list[tuple[int, int, int]]) -> None:
    for index, (rank, child) in enumerate(children):
        if index:
            hook("between_forks")
        hook("fork", rank)
        with warnings.catch_warnings():  # Python 3.12+ warns about forking with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                child()
            finally:
                os._exit(70)  # only reached if child() returned or raised before reporting
        try:
            os.setpgid(pid, pid)  # also done by the child; whoever runs first wins
        except OSError:
            pass
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            os.kill(pid, signal.SIGKILL)  # our unreaped child: the pid is still ours
            os.waitpid(pid, 0)
            raise
        started.append((rank, pid, pidfd))
