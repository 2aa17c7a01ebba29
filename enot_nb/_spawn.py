"""Starting worker processes safely: the clean fork thread, and the client of the fork server.

Two traps make forking a Jupyter kernel hang or fail, and each has its own way out here:

* GNU OpenMP (torch's CPU build): after the caller ran one parallel op, a child forked from
  that thread hangs forever in its first parallel op with 2+ threads, because libgomp keeps the
  (now missing) thread pool in the forking thread's thread-local state. Measured here: forking
  instead from a thread that never ran OpenMP gives a child with a fresh pool, full speed. So
  every fork happens on one long-lived "clean" thread (long-lived, because Linux's parent-death
  signal fires when the *thread* that forked exits).
* CUDA: a forked child cannot use CUDA once the caller initialized it. Then workers are forked
  by the fork server (see _forkserver), a fresh interpreter that never touches CUDA.
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from enot_nb import _channel
from enot_nb.errors import LaunchError

T = TypeVar("T")

# Seconds to wait for a new fork server to import torch and say it is ready.
SERVER_START_TIMEOUT = float(os.environ.get("ENOT_NB_SERVER_START_TIMEOUT", "120"))


class _CleanThread:
    """A daemon thread that runs the calls that create processes, and nothing else."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="enot_nb-process-starter", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, future = self._requests.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def call(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put((fn, future))
        return future.result()


_clean_thread: _CleanThread | None = None
_clean_thread_lock = threading.Lock()


def on_clean_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on the clean process-starting thread and return its result."""
    global _clean_thread
    with _clean_thread_lock:
        if _clean_thread is None:
            _clean_thread = _CleanThread()
    return _clean_thread.call(fn)


def fork(child: Callable[[], Any]) -> int:
    """Fork from the clean thread; the child runs ``child`` (which must not return)."""

    def do_fork() -> int:
        with warnings.catch_warnings():  # Python 3.12+ warns about forking with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                child()
            finally:
                os._exit(70)  # only reached if child() returned or raised before reporting
        return pid

    return on_clean_thread(do_fork)


class ForkServer:
    """The launching process's end of one fork server (see _forkserver)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The server must import enot_nb from wherever this process did.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)

        def start() -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-m", "enot_nb._forkserver", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
            )

        self.process = on_clean_thread(start)
        theirs.close()
        self.sock = ours
        self.reader = _channel.MessageReader()
        self._launch_id = 0
        self.sock.settimeout(SERVER_START_TIMEOUT)
        try:
            message, _ = _channel.recv_message(self.sock, self.reader)
        except (OSError, EOFError) as err:
            self.close()
            raise LaunchError(
                f"the enot_nb fork server did not start ({err}); check that `{sys.executable} -c "
                "'import torch, enot_nb'` works"
            ) from err
        self.sock.settimeout(None)
        self.pid = message[1]

    def alive(self) -> bool:
        return self.process.poll() is None

    def launch(self, specs: list[Any], fds: list[int], job_bytes: bytes,
               result_fds: int) -> tuple[int, dict[int, int]]:
        """Ask for one worker per spec; returns the launch id and each rank's pid.

        ``fds``: 3 pipes per rank, then ``result_fds`` (0 or 1) result memfd, then shared memory.
        """
        self._launch_id += 1
        _channel.send_message(self.sock, ("launch", self._launch_id, specs, job_bytes, result_fds), fds)
        while True:
            message = self.next_message()
            if message[0] == "started" and message[1] == self._launch_id:
                return self._launch_id, message[2]

    def next_message(self) -> tuple:
        """Block for the next message from the server."""
        try:
            message, _ = _channel.recv_message(self.sock, self.reader)
        except EOFError as err:
            raise LaunchError("the enot_nb fork server died; the next launch starts a new one") from err
        return message

    def close(self) -> None:
        self.sock.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


_server: ForkServer | None = None


def fork_server() -> ForkServer:
    """The running fork server of this process, started on first use."""
    global _server
    if _server is None or not _server.alive():
        if _server is not None:
            _server.close()
        _server = ForkServer()
    return _server


def server_pid() -> int | None:
    """Pid of the fork server if one runs (it lives as long as this process)."""
    return _server.process.pid if _server is not None and _server.alive() else None


def shutdown_server() -> None:
    """Stop the fork server (a new one starts on the next launch that needs it)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None
