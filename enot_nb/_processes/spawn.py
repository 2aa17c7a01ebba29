"""Starting worker processes safely: the clean fork thread, and the client of the fork server.

Two traps make forking a Jupyter kernel hang or fail, and each has its own way out here:

* GNU OpenMP (torch's CPU build): after the caller ran one parallel op, a child forked from
  that thread hangs forever in its first parallel op with 2+ threads, because libgomp keeps the
  (now missing) thread pool in the forking thread's thread-local state. Measured here: forking
  instead from a thread that never ran OpenMP gives a child with a fresh pool, full speed. So
  every fork happens on one long-lived "clean" thread (long-lived, because Linux's parent-death
  signal fires when the *thread* that forked exits).
* CUDA: a forked child cannot use CUDA once the caller initialized it. Then workers are forked
  by the fork server (see forkserver), a fresh interpreter that never touches CUDA.

A start is a transaction: every process is recorded (pid and pidfd) the moment it exists, so
whatever interrupts the start (the stop button, a failed fork) the caller can stop and reap
exactly what was started, and nothing else.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from enot_nb._processes import protocol as _protocol
from enot_nb._processes.interrupts import interrupts_deferred
from enot_nb._processes.protocol import Launch, LaunchFds, Started, StartFailed
from enot_nb.errors import LaunchError

T = TypeVar("T")

# Seconds to wait for a new fork server to import torch and say it is ready.
SERVER_START_TIMEOUT = float(os.environ.get("ENOT_NB_SERVER_START_TIMEOUT", "120"))
# Seconds a stopped launch gets to bring the fork server back in step before it is replaced.
SERVER_RECOVERY_TIMEOUT = 5.0

TEST_HOOKS: dict[str, Callable[..., None]] = {}
"""Fault injection for the reliability tests: named points of a start call these, if set
("before_forks", "between_forks", "after_forks", "fork" (with the rank); "server_starting",
"before_launch", "launch_sent", "started")."""


def hook(name: str, *args: Any) -> None:
    if TEST_HOOKS:
        function = TEST_HOOKS.get(name)
        if function is not None:
            function(*args)


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
            # Not held until the next request: a launch's closure holds its job (a cell's
            # registry of every notebook object), which must be freed with the launch.
            del fn, future

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put((fn, future))
        return future


_clean_thread: _CleanThread | None = None
_clean_thread_lock = threading.Lock()


def _submit(fn: Callable[[], T]) -> concurrent.futures.Future:
    global _clean_thread
    with interrupts_deferred(), _clean_thread_lock:
        if _clean_thread is None:
            _clean_thread = _CleanThread()
    return _clean_thread.submit(fn)


def on_clean_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` on the clean process-starting thread and return its result."""
    return _submit(fn).result()


def settle(future: concurrent.futures.Future | None) -> None:
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
) -> concurrent.futures.Future:
    """Fork one process per (rank, child) on the clean thread; each child leads its own process
    group. ``(rank, pid, pidfd)`` is appended to ``started`` the moment a child exists."""

    def run() -> None:
        hook("before_forks")
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
        hook("after_forks")

    return _submit(run)


def start_error(err: OSError, what: str) -> LaunchError:
    """A resource error at start, as one clear LaunchError naming the limit and the fix."""
    if err.errno == errno.EMFILE or err.errno == errno.ENFILE:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return LaunchError(
            f"{what}: too many open files (the limit is {soft}; each worker needs 3 pipes, the "
            "launcher a few more). Lower nprocs, or raise the limit: `ulimit -n 65536` before "
            "starting Jupyter, or resource.setrlimit(resource.RLIMIT_NOFILE, ...)"
        )
    if err.errno in (errno.EAGAIN, errno.ENOMEM):
        return LaunchError(
            f"{what}: the system refused a new process ({os.strerror(err.errno)}): the limit on "
            "processes per user (`ulimit -u`, RLIMIT_NPROC) or memory is reached. Lower nprocs, "
            "or raise the limit"
        )
    return LaunchError(f"{what}: {type(err).__name__}: {err}")


class StartRefused(LaunchError):
    """The fork server could not start a launch's workers, and left none running."""


class ForkServer:
    """The launching process's end of one fork server (see forkserver)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The server must import enot_nb from wherever this process did.
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)

        def start() -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-m", "enot_nb._worker.forkserver", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
            )

        self.sock = ours
        self.reader = _protocol.MessageReader()
        self._launch_id = 0
        self.broken = False
        """The protocol lost step (a send or receive cut short): replace the server."""
        self.process: subprocess.Popen | None = None
        try:
            with interrupts_deferred():  # a server started is known before a press lands
                self.process = on_clean_thread(start)
            theirs.close()
            hook("server_starting")
            self.sock.settimeout(SERVER_START_TIMEOUT)
            _protocol.recv_message(self.sock, self.reader)
        except (OSError, EOFError) as err:
            self.close()
            if self.process is None:
                raise  # it could not be started (EAGAIN, ...): start_error says why
            raise LaunchError(
                f"the enot_nb fork server did not start ({err}); check that `{sys.executable} -c "
                "'import torch, enot_nb'` works"
            ) from err
        except BaseException:  # an interrupt while the server imports torch: leave nothing
            self.close()
            raise
        finally:
            theirs.close()
        self.sock.settimeout(None)

    def alive(self) -> bool:
        return not self.broken and self.process is not None and self.process.poll() is None

    def next_launch_id(self) -> int:
        self._launch_id += 1
        return self._launch_id

    def send_launch(
        self, launch_id: int, specs: list[Any], fds: list[int], job_bytes: bytes, layout: LaunchFds
    ) -> None:
        """Ask for one worker per spec (see wait_started)."""
        self.broken = True  # until the whole request is out
        _protocol.send_message(self.sock, Launch(launch_id, specs, job_bytes, layout), fds)
        self.broken = False

    def wait_started(self, launch_id: int, timeout: float | None = None) -> dict[int, int]:
        """Each rank's pid once the server forked them; LaunchError if it could not. The server
        is out of step (``broken``) until take_pidfds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.fill(deadline)
            with interrupts_deferred():  # taken off the queue and marked as one step
                message = self.reader.pending.popleft()
                if isinstance(message, Started) and message.launch_id == launch_id:
                    self.broken = True
                    return message.pids
            if isinstance(message, StartFailed) and message.launch_id == launch_id:
                raise StartRefused(
                    str(
                        start_error(
                            OSError(message.errno, message.reason), "the fork server could not start the workers"
                        )
                    )
                )

    def take_pidfds(self, pids: dict[int, int]) -> dict[int, int]:
        """Each rank's pidfd, sent right after "started"; call with stop presses held, so
        that they are received and recorded as one step (so the wait has a deadline)."""
        try:
            self.sock.settimeout(SERVER_RECOVERY_TIMEOUT)
            pidfds = _protocol.recv_fds(self.sock, self.reader, len(pids))
        except (EOFError, TimeoutError) as err:  # still broken: the server is replaced
            raise LaunchError(f"the enot_nb fork server did not send the workers' pidfds ({err})") from err
        finally:
            self.sock.settimeout(None)
        self.broken = False
        return dict(zip(sorted(pids), pidfds))

    def fill(self, deadline: float | None = None) -> None:
        """Block until a message from the server waits in ``reader.pending`` (until
        ``deadline``, a monotonic time); the caller takes it off with presses held."""
        try:
            if deadline is not None:
                self.sock.settimeout(max(0.0, deadline - time.monotonic()))
            _protocol.fill(self.sock, self.reader)
        except EOFError as err:
            self.broken = True
            raise LaunchError("the enot_nb fork server died; the next launch starts a new one") from err
        except TimeoutError as err:
            self.broken = True
            raise LaunchError("the enot_nb fork server did not answer in time") from err
        finally:
            if deadline is not None:
                self.sock.settimeout(None)

    def close(self) -> None:
        self.sock.close()
        for fd in self.reader.fds:
            os.close(fd)
        self.reader.fds = []
        if self.process is not None:
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
            _server = None
        _server = ForkServer()
    return _server


def shutdown_server() -> None:
    """Stop the fork server (a new one starts on the next launch that needs it)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


class Watchdog:
    """The launching process's end of its watchdog (see watchdog), started on first use."""

    def __init__(self) -> None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")

        def start() -> subprocess.Popen:
            return subprocess.Popen(
                [sys.executable, "-I", path, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )

        self.process = on_clean_thread(start)
        assert self.process.stdin is not None
        self.fd = self.process.stdin.fileno()

    def tell(self, *lines: str) -> None:
        try:
            os.write(self.fd, "".join(f"{line}\n" for line in lines).encode())
        except OSError:  # it died: the next launch starts another
            self.process.poll()

    def alive(self) -> bool:
        return self.process.poll() is None


_watchdog: Watchdog | None = None


def watchdog() -> Watchdog:
    """This process's watchdog, started on first use (again if it died)."""
    global _watchdog
    if _watchdog is None or not _watchdog.alive():
        with interrupts_deferred():  # started and known, or not started
            _watchdog = Watchdog()
    return _watchdog
