"""The kernel's end of the fork server (see enot_nb._worker.forkserver): start it, ask it for a
launch's workers, read its answers; one server per process, replaced when out of step.

Why a fork server: a forked child cannot use CUDA once the caller initialized it, so then the
workers are forked by a fresh interpreter that never touches CUDA (see clean_thread).
"""

from __future__ import annotations

import enum
import os
import socket
import subprocess
import sys
import time
from typing import Any

from enot_nb._processes import framing
from enot_nb._processes.clean_thread import on_clean_thread
from enot_nb._processes.framing import LaunchFds
from enot_nb._processes.interrupts import interrupts_deferred
from enot_nb._processes.protocol import Launch, Preload, ServerMessage, Started, StartFailed
from enot_nb._processes.starts import fresh_interpreter_env, hook, start_error
from enot_nb.errors import LaunchError

# Seconds to wait for a new fork server to import torch and say it is ready.
SERVER_START_TIMEOUT = float(os.environ.get("ENOT_NB_SERVER_START_TIMEOUT", "120"))
# Seconds a stopped launch gets to bring the fork server back in step before it is replaced.
SERVER_RECOVERY_TIMEOUT = 5.0


class StartRefused(LaunchError):
    """The fork server could not start a launch's workers, and left none running."""


class ServerState(enum.Enum):
    """Where this process's conversation with one fork server stands::

        STARTING --Ready--> IN_STEP --send_launch--> SENDING --all sent--> IN_STEP
                            IN_STEP --wait_started: Started--> ANSWERING --take_pidfds--> IN_STEP
        SENDING, ANSWERING --cut short (a stop press, an error)--> stay there
        any --EOF, no answer in time, no pidfds--> LOST
        any --close--> CLOSED

    Only IN_STEP is usable: the next bytes on the socket are the start of a message for the
    next reader. In SENDING a request went out in part; in ANSWERING an answer's descriptors are
    still on the socket: either way the next launch would read the wrong bytes, so the server is
    replaced (its workers die with it: parent-death signal). IN_STEP includes a launch waiting
    for its "started" and its workers' exits: those messages are whole, taken one at a time."""

    STARTING = "starting"
    IN_STEP = "in step"
    SENDING = "sending"
    ANSWERING = "answering"
    LOST = "lost"
    CLOSED = "closed"

    def is_usable(self) -> bool:
        return self in _USABLE


_USABLE = frozenset({ServerState.IN_STEP})


class ForkServer:
    """This process's end of one fork server: its process, its socket and the session's state."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        env = fresh_interpreter_env()

        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [sys.executable, "-m", "enot_nb._worker.forkserver", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
            )

        self.sock = ours
        self.reader: framing.MessageReader[ServerMessage] = framing.MessageReader()
        self._launch_id = 0
        self.state = ServerState.STARTING
        self.process: subprocess.Popen[bytes] | None = None
        try:
            with interrupts_deferred():  # a server started is known before a press lands
                self.process = on_clean_thread(start)
            theirs.close()
            hook("server_starting")
            self.sock.settimeout(SERVER_START_TIMEOUT)
            framing.recv_message(self.sock, self.reader)  # Ready
            self.state = ServerState.IN_STEP
            if _preloads:
                self.preload(list(_preloads))  # what earlier cells imported, for its workers
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
        return self.state.is_usable() and self.process is not None and self.process.poll() is None

    def preload(self, modules: list[str]) -> None:
        """Ask the server to import ``modules`` before its next fork."""
        self.state = ServerState.SENDING  # until the whole request is out
        framing.send_message(self.sock, Preload(tuple(modules)))
        self.state = ServerState.IN_STEP

    def next_launch_id(self) -> int:
        self._launch_id += 1
        return self._launch_id

    def send_launch(
        self, launch_id: int, specs: list[Any], fds: list[int], job_bytes: bytes, layout: LaunchFds
    ) -> None:
        """Ask for one worker per spec (see wait_started)."""
        self.state = ServerState.SENDING  # until the whole request is out
        framing.send_message(self.sock, Launch(launch_id, specs, job_bytes, layout), fds)
        self.state = ServerState.IN_STEP

    def wait_started(self, launch_id: int, timeout: float | None = None) -> dict[int, int]:
        """Each rank's pid once the server forked them; StartRefused if it could not. The
        session is ANSWERING (out of step) until take_pidfds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.fill(deadline)
            with interrupts_deferred():  # taken off the queue and marked as one step
                match self.reader.pending.popleft():
                    case Started(launch_id=answered, pids=pids) if answered == launch_id:
                        self.state = ServerState.ANSWERING
                        return pids
                    case StartFailed(launch_id=answered) as refusal if answered == launch_id:
                        pass  # raised below, presses no longer held
                    case _:  # an earlier launch's late message
                        continue
            raise StartRefused(
                str(start_error(OSError(refusal.errno, refusal.reason), "the fork server could not start the workers"))
            )

    def take_pidfds(self, pids: dict[int, int]) -> dict[int, int]:
        """Each rank's pidfd, sent right after "started"; call with stop presses held, so
        that they are received and recorded as one step (so the wait has a deadline)."""
        try:
            self.sock.settimeout(SERVER_RECOVERY_TIMEOUT)
            pidfds = framing.recv_fds(self.sock, self.reader, len(pids))
        except (EOFError, TimeoutError) as err:
            self.state = ServerState.LOST
            raise LaunchError(f"the enot_nb fork server did not send the workers' pidfds ({err})") from err
        finally:
            self.sock.settimeout(None)
        self.state = ServerState.IN_STEP
        return dict(zip(sorted(pids), pidfds))

    def fill(self, deadline: float | None = None) -> None:
        """Block until a message from the server waits in ``reader.pending`` (until
        ``deadline``, a monotonic time); the caller takes it off with presses held."""
        try:
            if deadline is not None:
                self.sock.settimeout(max(0.0, deadline - time.monotonic()))
            framing.fill(self.sock, self.reader)
        except EOFError as err:
            self.state = ServerState.LOST
            raise LaunchError("the enot_nb fork server died; the next launch starts a new one") from err
        except TimeoutError as err:
            self.state = ServerState.LOST
            raise LaunchError("the enot_nb fork server did not answer in time") from err
        finally:
            if deadline is not None:
                self.sock.settimeout(None)

    def close(self) -> None:
        """Close the socket and what it brought, kill and reap the server (safe to run twice)."""
        self.sock.close()
        for fd in self.reader.fds:
            os.close(fd)
        self.reader.fds = []
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
        self.state = ServerState.CLOSED


class _Servers:
    """This process's fork server: started on first use, replaced once it is not usable."""

    def __init__(self) -> None:
        self.current: ForkServer | None = None

    def get(self) -> ForkServer:
        """The running fork server of this process, started on first use."""
        if self.current is None or not self.current.alive():
            if self.current is not None:
                self.current.close()
                self.current = None
            self.current = ForkServer()
        return self.current

    def shutdown(self) -> None:
        """Stop the fork server (a new one starts on the next launch that needs it)."""
        if self.current is not None:
            self.current.close()
            self.current = None


_servers = _Servers()
fork_server = _servers.get
shutdown_server = _servers.shutdown

_preloads: dict[str, None] = {}
"""Every module a cell's master imported, in order: a new server is asked for them all."""


def preload(modules: list[str]) -> None:
    """Spawned workers get what the cells' masters imported: told to the running server (if it is
    in step; else the next one is told at its start)."""
    _preloads.update(dict.fromkeys(modules))
    server = _servers.current
    if server is not None and server.alive():
        try:
            server.preload(modules)
        except OSError:
            server.state = ServerState.LOST  # replaced at the next launch, which tells its successor
