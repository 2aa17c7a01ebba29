"""The fork server: a fresh interpreter that forks clean workers on request.

Why: forking the caller is fastest, but impossible once the caller has initialized CUDA (a
forked child cannot use it). Spawning a fresh interpreter per worker costs about 1.4 s, most of
it importing torch. This server is started once, from a fresh interpreter, imports torch and
never runs a torch op or touches CUDA, then forks workers for each launch: the workers start
clean and quickly. The job arrives pickled (cloudpickle), the workers' pipes arrive as file
descriptors over a Unix socket that only the launching process holds.

Protocol on the socket (framed pickles, see _channel)::

    server -> caller  ("ready", pid)
    caller -> server  ("launch", id, [WorkerSpec], job_bytes, n)  + 3 fds per rank (out, err, msg)
                                                        + n (0 or 1) result memfd + the job's memfds
    server -> caller  ("started", id, [pid per rank])
    server -> caller  ("exit", id, rank, exitcode)               once per rank, as each is reaped
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from enot_nb import _channel, _pickling, _worker


def _load_job(job_bytes: bytes) -> _worker.Job:
    return _pickling.loads_shipped(job_bytes)


def _fork_workers(sock: socket.socket, specs: list[_worker.WorkerSpec], fds: list[int],
                  job_bytes: bytes, result_fds: int) -> dict[int, int]:
    pids: dict[int, int] = {}
    pipes, extra = fds[: 3 * len(specs)], fds[3 * len(specs) :]
    result_fd = extra[0] if result_fds else None
    shared_memory = extra[result_fds:]
    for index, spec in enumerate(specs):
        spec.stdout_fd, spec.stderr_fd, spec.message_fd = pipes[3 * index : 3 * index + 3]
        spec.close_fds = [fd for fd in pipes if fd not in pipes[3 * index : 3 * index + 3]]
        spec.shared_memory_fds = shared_memory
        spec.result_fd = result_fd
        spec.parent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            sock.close()
            _worker.run(spec, lambda: _load_job(job_bytes))
        pids[pid] = spec.rank
    for fd in fds:
        os.close(fd)
    return pids


def serve(sock: socket.socket) -> None:
    """Answer launch requests until the caller closes the socket."""
    reader = _channel.MessageReader()
    while True:
        try:
            message, fds = _channel.recv_message(sock, reader, maxfds=253)
        except EOFError:
            return
        _, launch_id, specs, job_bytes, result_fds = message
        pids = _fork_workers(sock, specs, fds, job_bytes, result_fds)
        _channel.send_message(sock, ("started", launch_id, {rank: pid for pid, rank in pids.items()}))
        while pids:
            pid, status = os.wait()
            rank = pids.pop(pid, None)
            if rank is not None:
                _channel.send_message(sock, ("exit", launch_id, rank, os.waitstatus_to_exitcode(status)))


def main() -> None:
    # Jupyter interrupts by signalling the kernel's whole process group, this server included:
    # it has nothing to interrupt (its workers reset SIGINT and live in groups of their own).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    _worker._die_with_parent(int(sys.argv[2]))
    import cloudpickle  # noqa: F401 - preloaded for the workers
    import torch  # noqa: F401 - the expensive import, done once here instead of in every worker

    import enot_nb.distributed  # noqa: F401
    # What a distributed cell's worker needs (its display publisher lives on an IPython shell):
    # imported once here instead of in every worker of every cell (~0.15 s each, measured).
    import IPython.core.interactiveshell  # noqa: F401

    import enot_nb._cell  # noqa: F401

    _channel.send_message(sock, ("ready", os.getpid()))
    serve(sock)


if __name__ == "__main__":
    main()
