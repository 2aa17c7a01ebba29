"""The fork server: a fresh interpreter that forks clean workers on request.

Why: forking the caller is fastest, but impossible once the caller has initialized CUDA (a
forked child cannot use it). Spawning a fresh interpreter per worker costs about 1.4 s, most of
it importing torch. This server is started once, from a fresh interpreter, imports torch and
never runs a torch op or touches CUDA, then forks workers for each launch: the workers start
clean and quickly. The job arrives pickled (cloudpickle), the workers' pipes arrive as file
descriptors over a Unix socket that only the launching process holds.

Protocol on the socket (the records of protocol, framed pickles, descriptors in batches after
their message: see framing; the kernel's end is forkserver_client)::

    server -> caller  Ready(pid)
    caller -> server  Preload(modules)   what a cell's master imported: imported on a helper
                                         thread, joined before the next fork (see preload)
    caller -> server  Launch(id, [WorkerSpec], job_bytes, LaunchFds)   + the descriptors
    server -> caller  Started(id, {rank: pid})          + a pidfd per rank, in rank order
                   or StartFailed(id, errno, reason)    (nothing of the launch is left)
    server -> caller  Exit(id, rank, exitcode)          once per rank, as each is reaped

A worker's process group is killed (its DataLoader workers, its subprocesses) before the worker
is reaped: while the leader is a zombie, its group id cannot be anybody else's.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys

from enot_nb._processes import framing
from enot_nb._processes.framing import LaunchFds
from enot_nb._processes.protocol import CallerMessage, Exit, Preload, Ready, Started, StartFailed
from enot_nb._serialize import picklers
from enot_nb._worker import bootstrap, preload


def _fork_workers(
    sock: socket.socket, specs: list[bootstrap.WorkerSpec], fds: list[int], job_bytes: bytes, layout: LaunchFds
) -> dict[int, tuple[int, int]]:
    """Fork one worker per spec; {pid: (rank, pidfd)}. On failure nothing is left running."""
    pipes, result_fd, shared_fd = layout.split(fds)
    started: dict[int, tuple[int, int]] = {}
    fail_at = os.environ.get("ENOT_NB_TEST_FORK_FAIL_AT")  # fault injection for the tests
    try:
        for index, spec in enumerate(specs):
            if fail_at is not None and spec.rank == int(fail_at):
                raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
            spec.stdout_fd, spec.stderr_fd, spec.message_fd = pipes[index]
            spec.close_fds = [fd for i, trio in enumerate(pipes) if i != index for fd in trio]
            spec.shared_memory_fd = shared_fd
            spec.result_fd = result_fd
            spec.parent_pid = os.getpid()
            pid = os.fork()
            if pid == 0:
                sock.close()
                bootstrap.run(spec, lambda: _load_job(job_bytes))
            _set_group(pid)
            started[pid] = (spec.rank, -1)
            started[pid] = (spec.rank, os.pidfd_open(pid))
    except BaseException:
        _kill_and_reap(started)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return started


def _load_job(job_bytes: bytes) -> bootstrap.Job:
    return picklers.loads_shipped(job_bytes)


def _set_group(pid: int) -> None:
    try:
        os.setpgid(pid, pid)  # also done by the child; whoever runs first wins
    except OSError:
        pass


def _kill_and_reap(started: dict[int, tuple[int, int]]) -> None:
    for pid, (_, pidfd) in started.items():
        _kill_group(pid)
        os.waitpid(pid, 0)
        if pidfd >= 0:
            os.close(pidfd)


def _kill_group(pid: int) -> None:
    """SIGKILL a worker's group; the worker is ours and not yet reaped, so the group is too."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve(sock: socket.socket) -> None:
    """Answer launch requests until the caller closes the socket."""
    reader: framing.MessageReader[CallerMessage] = framing.MessageReader()
    while True:
        try:
            message = framing.recv_message(sock, reader)
            if isinstance(message, Preload):
                preload.PRELOADER.start(list(message.modules))  # joined by the fork's own hook
                continue
            launch = message
            fds = framing.recv_fds(sock, reader, launch.layout.total)
        except EOFError:
            return
        try:
            started = _fork_workers(sock, launch.specs, fds, launch.job_bytes, launch.layout)
        except OSError as err:
            framing.send_message(sock, StartFailed(launch.launch_id, err.errno, str(err)))
            continue
        by_rank = sorted(started.items(), key=lambda item: item[1][0])
        framing.send_message(
            sock,
            Started(launch.launch_id, {rank: pid for pid, (rank, _) in by_rank}),
            [pidfd for _, (_, pidfd) in by_rank],
        )
        for _, pidfd in started.values():
            os.close(pidfd)  # the caller has its own copies
        while started:
            # See the exit first without reaping: the group is still the worker's to kill.
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            if info is None:
                continue
            _kill_group(info.si_pid)
            _, status = os.waitpid(info.si_pid, 0)
            rank = started.pop(info.si_pid, (None,))[0]
            if rank is not None:
                code = os.waitstatus_to_exitcode(status)
                framing.send_message(sock, Exit(launch.launch_id, rank, code))


def main() -> None:
    # Jupyter interrupts by signalling the kernel's whole process group, this server included:
    # it has nothing to interrupt (its workers reset SIGINT and live in groups of their own).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A mask survives exec: a server started by a thread that blocks signals (a Ray actor's
    # threads block SIGINT and SIGTERM) would pass it on to its workers, and a stop press
    # would never reach them.
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    sock = socket.socket(fileno=int(sys.argv[1]))
    bootstrap._die_with_parent(int(sys.argv[2]))
    import cloudpickle  # noqa: F401 - preloaded for the workers

    # What a distributed cell's worker needs (its display publisher lives on an IPython shell):
    # imported once here instead of in every worker of every cell (~0.15 s each, measured).
    import IPython.core.interactiveshell  # noqa: F401 - preloaded for the workers
    import torch  # noqa: F401 - the expensive import, done once here instead of in every worker

    try:  # a worker launched from a Jupyter kernel makes a ZMQInteractiveShell (~0.2 s to import)
        import ipykernel.zmqshell  # noqa: F401 - preloaded for the workers
    except ImportError:
        pass

    import enot_nb._worker.cell  # noqa: F401 - preloaded for the workers
    import enot_nb.distributed  # noqa: F401 - preloaded for the workers

    framing.send_message(sock, Ready(os.getpid()))
    serve(sock)


if __name__ == "__main__":
    main()
