"""The processes of one attempt, behind one interface (as torch elastic's ``PContext``).

Three implementations: workers forked here (from the clean thread), workers forked by the fork
server, and one worker exec'd here (a Ray rank's agent). All keep the same rules, which is what
makes stopping them safe:

* A worker is signalled through its pidfd, never through a bare pid: a pid may be reused once
  the process is reaped, a pidfd never names another process.
* A worker's process group (the worker leads it; its DataLoader workers and subprocesses are in
  it) is signalled only while the worker is not reaped yet: a zombie leader keeps the group id.
  Before a worker is reaped, its group is SIGKILLed, so no descendant outlives it.
* The watchdog (see watchdog) knows every group while it runs: if this process dies, however
  it dies, the groups die too.
* ``close`` works in any state of ``start`` (interrupted before, between or after the forks,
  while the fork server starts or answers): it stops and reaps exactly what was started.
"""

from __future__ import annotations

import concurrent.futures
import enum
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from enot_nb._processes import clean_thread, forkserver_client, watchdog_client
from enot_nb._processes.framing import LaunchFds
from enot_nb._processes.interrupts import interrupts_deferred
from enot_nb._processes.protocol import Exit
from enot_nb._processes.starts import fresh_interpreter_env, hook, start_error
from enot_nb.errors import LaunchError


class WorkerGroup(Protocol):
    """What the supervisor needs from a group of workers."""

    exited: dict[int, int]
    """rank -> exit code of every worker reaped so far (also those whose report from exits()
    a stop press cut off)."""

    def start(self) -> dict[int, int]:
        """Start every worker; each rank's pid. Raises LaunchError (nothing left running)."""

    def sources(self) -> list[Any]:
        """Objects to select on: one becomes readable when a worker exits."""

    def pending(self) -> bool:
        """Exits already received that select cannot see."""

    def exits(self, ready: Any) -> list[tuple[int, int]]:
        """(rank, exit code; -N for signal N) of workers that ended, reaped; ``ready`` is the
        source that fired."""

    def signal(self, rank: int, signum: int) -> None:
        """Signal a running worker (and, for TREE_SIGNALS, its process group where that is
        safe); nothing once it is reaped."""

    def settle(self) -> None:
        """Wait until no start is in flight (what is started is then known)."""

    def close(self) -> None:
        """Kill and reap whatever was started; the group is then empty."""


TREE_SIGNALS = frozenset({signal.SIGTERM, signal.SIGKILL})
"""The signals that stop a worker's whole tree (its process group: DataLoader workers and other
children too). The others (a stack dump, an interrupt) are the rank's own to answer: they go to
the rank alone, by its pidfd, so its children neither dump their stacks nor get interrupted."""


def _exit_code(info: Any) -> int:
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _kill_group(leader: int, signum: int = signal.SIGKILL) -> bool:
    try:
        os.killpg(leader, signum)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _pidfd_signal(pidfd: int, signum: int) -> None:
    try:
        signal.pidfd_send_signal(pidfd, signum)
    except ProcessLookupError:
        pass


class ForkedGroup:
    """Workers forked from this process; exits seen through their pidfds."""

    def __init__(self, children: list[tuple[int, Callable[[], Any]]]) -> None:
        self._children = children
        self._started: list[tuple[int, int, int]] = []  # (rank, pid, pidfd), filled as forked
        self._future: concurrent.futures.Future[None] | None = None
        self.exited: dict[int, int] = {}

    def start(self) -> dict[int, int]:
        with interrupts_deferred():  # the forks are known (settle) once they are asked for
            self._future = clean_thread.fork_all(self._children, self._started)
        try:
            self._future.result()
        except OSError as err:
            raise start_error(err, f"rank {len(self._started)} could not be started") from err
        finally:
            watchdog_client.watch(*(pid for _, pid, _ in self._started))
        return {rank: pid for rank, pid, _ in self._started}

    def sources(self) -> list[int]:
        return [pidfd for rank, _, pidfd in self._started if rank not in self.exited]

    def pending(self) -> bool:
        return False

    def exits(self, ready: Any) -> list[tuple[int, int]]:
        return [self._reap(entry) for entry in self._started if entry[2] == ready]

    def _reap(self, entry: tuple[int, int, int]) -> tuple[int, int]:
        rank, pid, pidfd = entry
        # Called once it exited (or was SIGKILLed): nothing here waits long, so a stop press is
        # held, and the reaping, the record and the pidfd's close are one step.
        with interrupts_deferred():
            _kill_group(pid)  # its descendants: the leader is not reaped yet, so the group is ours
            try:
                code = _exit_code(os.waitid(os.P_PIDFD, pidfd, os.WEXITED))
            except ChildProcessError:  # reaped by the system: the cell set SIGCHLD to SIG_IGN
                code = -signal.SIGKILL
            self.exited[rank] = code
            watchdog_client.forget(pid)
            os.close(pidfd)
        return rank, code

    def signal(self, rank: int, signum: int) -> None:
        for r, pid, pidfd in self._started:
            if r != rank or r in self.exited:
                continue
            if signum not in TREE_SIGNALS or not _kill_group(pid, signum):
                _pidfd_signal(pidfd, signum)

    def settle(self) -> None:
        clean_thread.settle(self._future)

    def close(self) -> None:
        self.settle()  # forks still in flight: know them all first
        for entry in self._started:
            if entry[0] not in self.exited:
                _pidfd_signal(entry[2], signal.SIGKILL)
                self._reap(entry)


class ExecGroup:
    """One worker started here as a fresh interpreter (``python -m enot_nb._worker.exec_rank``,
    from the clean thread), handed its spec and job on stdin; its exit seen through its pidfd. A
    Ray rank's agent launches its rank once: no fork server stands between them. Its stdout and
    stderr are the rank's pipes from the start, so a failure before it becomes a worker is in
    its report. Not watched by the watchdog: the worker dies with this process (its parent-death
    signal). Reaped under a lock: the agent's reads and its close run on threads of their own."""

    def __init__(self, spec: Any, job_bytes: bytes, fds: list[int]) -> None:
        self._spec, self._job_bytes, self._fds = spec, job_bytes, fds
        self._process: subprocess.Popen[bytes] | None = None
        self._pidfd = -1
        self._lock = threading.Lock()
        self.exited: dict[int, int] = {}

    def start(self) -> dict[int, int]:
        env = fresh_interpreter_env()  # (on a Ray node: the runtime_env's copy of enot_nb)
        spec = self._spec

        def run() -> subprocess.Popen[bytes]:
            command = [sys.executable, "-m", "enot_nb._worker.exec_rank"]
            return subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=spec.stdout_fd,
                stderr=spec.stderr_fd,
                pass_fds=self._fds,
                env=env,
            )

        try:
            with interrupts_deferred():  # the process is known (close) once it exists
                self._process = clean_thread.on_clean_thread(run)
                try:
                    self._pidfd = os.pidfd_open(self._process.pid)
                except OSError:
                    self._process.kill()
                    self._process.wait()
                    raise
        except OSError as err:
            raise start_error(err, f"rank {spec.rank} could not be started") from err
        assert self._process.stdin is not None
        try:
            with self._process.stdin as stdin:
                pickle.dump((spec, self._job_bytes), stdin)
        except BrokenPipeError:
            pass  # it died at once: its exit, and its stderr, say how
        return {spec.rank: self._process.pid}

    def sources(self) -> list[int]:
        return [self._pidfd] if self._pidfd >= 0 and self._spec.rank not in self.exited else []

    def pending(self) -> bool:
        return False

    def exits(self, ready: Any) -> list[tuple[int, int]]:
        if ready != self._pidfd or ready < 0:
            return []
        reaped = self._reap()
        return [reaped] if reaped is not None else []

    def _reap(self) -> tuple[int, int] | None:
        """The worker reaped (its group killed first, as ForkedGroup._reap), once: None where
        another thread did."""
        with self._lock, interrupts_deferred():
            if self._process is None or self._spec.rank in self.exited:
                return None
            _kill_group(self._process.pid)
            try:
                code = _exit_code(os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED))
            except ChildProcessError:  # reaped by the system (SIGCHLD ignored)
                code = -signal.SIGKILL
            self._process.returncode = code
            self.exited[self._spec.rank] = code
            os.close(self._pidfd)
            self._pidfd = -1
        return self._spec.rank, code

    def signal(self, rank: int, signum: int) -> None:
        with self._lock:
            if self._process is None or rank in self.exited:
                return
            if signum not in TREE_SIGNALS or not _kill_group(self._process.pid, signum):
                _pidfd_signal(self._pidfd, signum)

    def settle(self) -> None:
        pass  # start returns once the process exists

    def close(self) -> None:
        self.signal(self._spec.rank, signal.SIGKILL)
        self._reap()


class LaunchPhase(enum.Enum):
    """Where a ServerGroup's launch stands::

        UNSENT --launch id taken--> ASKED --Started, pidfds recorded--> RUNNING
                                    ASKED --StartFailed--------------> REFUSED

    ``close`` does what each needs: nothing (UNSENT); read the answer first (ASKED: a stop press
    came between the request and its answer); then kill what runs and read each worker's exit,
    which keeps the session in step for the next launch (RUNNING; REFUSED left nothing)."""

    UNSENT = "unsent"
    ASKED = "asked"
    RUNNING = "running"
    REFUSED = "refused"


class ServerGroup:
    """Workers forked by the fork server; exits arrive as its messages."""

    def __init__(
        self,
        specs: list[Any],
        fds: list[int],
        job_bytes: bytes,
        layout: LaunchFds,
        own_server: forkserver_client.ForkServer | None = None,
    ) -> None:
        self._request = (specs, fds, job_bytes, layout)
        self.phase = LaunchPhase.UNSENT
        self.own_server = own_server
        """A session's own fork server (the shared one serves one launch at a time); None: the
        shared one."""
        self.server: forkserver_client.ForkServer | None = None
        self.launch_id = 0
        self.pids: dict[int, int] = {}  # known once RUNNING
        self.pidfds: dict[int, int] = {}
        self.exited: dict[int, int] = {}

    def start(self) -> dict[int, int]:
        self.server = server = self.own_server or forkserver_client.fork_server()
        hook("before_launch")
        self.launch_id, self.phase = server.next_launch_id(), LaunchPhase.ASKED  # before a byte is sent
        server.send_launch(self.launch_id, *self._request)
        hook("launch_sent")
        try:
            pids = server.wait_started(self.launch_id)  # a press after this: the session is out of step
        except forkserver_client.StartRefused:
            self.phase = LaunchPhase.REFUSED  # the server left nothing running, and is in step
            raise
        self._started(pids)
        hook("started")
        return pids

    def _started(self, pids: dict[int, int]) -> None:
        assert self.server is not None
        with interrupts_deferred():  # the workers' pidfds are received and recorded as one step
            self.pidfds = self.server.take_pidfds(pids)
            self.pids, self.phase = pids, LaunchPhase.RUNNING
            watchdog_client.watch(*pids.values())

    def sources(self) -> list[socket.socket]:
        return [self.server.sock] if self.server is not None else []

    def pending(self) -> bool:
        """Messages already read off the socket (behind "started", say) that select cannot see."""
        return self.server is not None and bool(self.server.reader.pending)

    def exits(self, ready: Any, deadline: float | None = None) -> list[tuple[int, int]]:
        """The buffered messages, or else the server's next one (blocking)."""
        assert self.server is not None
        reader = self.server.reader
        if not reader.pending:
            self.server.fill(deadline)
        ended = []
        with interrupts_deferred():  # each exit taken off the queue is recorded
            while reader.pending:
                match reader.pending.popleft():
                    case Exit(launch_id=launch_id, rank=rank, exitcode=code) if launch_id == self.launch_id:
                        self.exited[rank] = code
                        os.close(self.pidfds.pop(rank))
                        watchdog_client.forget(self.pids[rank])
                        ended.append((rank, code))
                    case _:  # an earlier launch's late message
                        pass
        return ended

    def settle(self) -> None:
        pass  # the server answers every request it received (see close)

    def signal(self, rank: int, signum: int) -> None:
        # Only the worker: the server reaps it, so its group is the server's to kill (it does,
        # before reaping).
        if rank in self.pidfds:
            _pidfd_signal(self.pidfds[rank], signum)

    def close(self) -> None:
        if self.phase is LaunchPhase.UNSENT:
            return
        assert self.server is not None
        deadline = time.monotonic() + forkserver_client.SERVER_RECOVERY_TIMEOUT
        try:
            if not self.server.state.is_usable():
                raise LaunchError("the request to the fork server was cut short")
            if self.phase is LaunchPhase.ASKED:  # interrupted between the request and the answer
                self._started(self.server.wait_started(self.launch_id, forkserver_client.SERVER_RECOVERY_TIMEOUT))
            for pidfd in self.pidfds.values():
                _pidfd_signal(pidfd, signal.SIGKILL)
            while len(self.exited) < len(self.pids):
                self.exits(None, deadline)  # keep the protocol in step for the next launch
        except (LaunchError, OSError):
            if self.own_server is not None:
                self.own_server.close()  # its workers die with it (parent-death signal)
            else:
                forkserver_client.shutdown_server()
        finally:
            for pidfd in self.pidfds.values():
                os.close(pidfd)
            self.pidfds = {}
            if self.pids:  # those whose exit was not seen (exits forgot the others)
                watchdog_client.forget(*(pid for rank, pid in self.pids.items() if rank not in self.exited))


def resident_mib(pid: int) -> float | None:
    """A process's resident memory (MiB), from /proc; None where it cannot be read (gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """A process's CPU time so far (user and system, every thread), with its live descendants'
    (a DataLoader's workers do a rank's work), from /proc; None where it cannot be read (gone). A
    rank that does not answer but whose CPU time grows is working."""
    own = _own_cpu_seconds(pid)
    if own is None:
        return None
    return own + sum(_own_cpu_seconds(child) or 0.0 for child in _descendants(pid))


def _own_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _descendants(pid: int) -> list[int]:
    """The live processes under ``pid``, from each thread's ``children`` (Linux 3.5+); none where
    the kernel does not list them."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in threads:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as listed:
                    children = [int(c) for c in listed.read().split()]
            except (OSError, ValueError):
                continue
            found += children
            todo += children
    return found
