"""One rank's agent on a Ray node: the Ray actor that starts the rank's session worker as a local
child process and relays its traffic to the kernel (see ray_ranks for the kernel's side)::

    kernel (RayRanks)                      node: RankAgent (a Ray actor)       its worker
      read(timeout)   --io group-->        select on the rank's pipes   <--   stdout, stderr,
                      <-- Batch --         and the worker's exit (pidfd)      messages
      command(bytes, task) --control-->    task -> the task memfd, then the command
                                           -> the message socket        -->   session loop
      signal(SIGINT / SIGUSR1 / ...)       pidfd_send_signal            -->   the worker
      result(size)    <-- object store --  the result memfd (rank 0), for a result over
                                           INLINE_RESULT (a smaller one is in its message)

The worker is a fresh interpreter the agent starts once (``groups.ExecGroup``: fork and exec, as
``subprocess`` does, never a fork of the actor itself, whose Ray threads hold locks): two
processes per rank, the actor and its worker. So pidfds, signals, ``/proc`` and shared memory
stay on the node that owns the process, and the worker dies with the agent (its parent-death
signal). Ray runs one call of an actor at a time on its main thread and cannot interrupt it:
``read`` runs in the ``io`` concurrency group, ``command`` in ``command``, signals and the rest in
``control`` (threads of their own), so a signal or a command reaches the rank while a read waits.
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from enot_nb._processes import rendezvous as _rendezvous
from enot_nb._processes import sockets
from enot_nb._processes.groups import ExecGroup, cpu_seconds, resident_mib
from enot_nb._serialize import result_file
from enot_nb._worker import bootstrap

CONCURRENCY_GROUPS = {"io": 1, "command": 1, "control": 4}
"""The agent's concurrency groups (threads): ``read`` alone in ``io``; ``command`` alone in
``command`` (one thread: commands reach the rank in the order sent); signals and the rest in
``control``, so that a signal never waits behind a read or a command."""
READ_CHUNK = 1 << 20
"""Bytes read per stream and call at most: the relay moves output and messages in pieces."""
INLINE_RESULT = 64 * 1024
"""Bytes of rank 0's result that travel in its answer, in the read that brings the answer: a
trivial cell needs no Ray call of its own for its result."""


@dataclass
class AgentLaunch:
    """What the agent needs to start its rank (plain data: it crosses Ray)."""

    rank: int
    env: dict[str, str]
    """The rank's variables (torchrun's), set over the node's environment."""
    env_defaults: dict[str, str]
    """Variables set only where the node's environment has none (GLOO_SOCKET_IFNAME, ...)."""
    init_kwargs: dict[str, Any]
    threads: int
    job_bytes: bytes
    front_end: bool
    kernel_parent: dict | None
    output_setup: bytes | None


@dataclass
class Batch:
    """What a rank sent since the last read: bytes per stream, the streams at their end, and
    the worker's exit code once it is reaped."""

    out: bytes = b""
    err: bytes = b""
    msg: bytes = b""
    ended: tuple[str, ...] = ()
    exitcode: int | None = None


class RankAgent:
    """A rank's agent on its node (see the module's docstring); made into an actor by
    ray_ranks with ``ray.remote``."""

    def __init__(self) -> None:
        self.group: ExecGroup | None = None
        self.reads: dict[str, int] = {}  # "out", "err", "msg" -> our end
        self.ended: set[str] = set()
        self.task_fd: int | None = None
        self.result_fd: int | None = None
        self.folder: str | None = None
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.rank = -1

    def where(self, bundle: int) -> tuple[int, str, str, int, tuple[str, ...], str, str]:
        """(bundle, node id, node IP, pid, assigned GPU ids, enot_nb's folder, actor id): where
        this actor landed (see ray_layout.Landing)."""
        import ray

        context = ray.get_runtime_context()
        gpus = tuple(str(g) for g in ray.get_gpu_ids())
        node_ip, actor = str(ray.util.get_node_ip_address()), context.get_actor_id() or ""
        return bundle, context.get_node_id(), node_ip, os.getpid(), gpus, bootstrap.PACKAGE_DIR, actor

    def free_port(self, address: str) -> int:
        """A port free on this node's ``address`` (the master's store binds it next)."""
        return _rendezvous.free_port(address)

    def start(self, launch: AgentLaunch) -> int:
        """Start the rank's worker (session loop), a fresh interpreter; its pid."""
        self.rank = launch.rank
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        ours, theirs = socket.socketpair()
        msg_r, msg_w = ours.detach(), theirs.detach()
        self.reads = {"out": out_r, "err": err_r, "msg": msg_r}
        for fd in self.reads.values():
            os.set_blocking(fd, False)
        self.task_fd = result_file.result_fd()
        self.result_fd = result_file.result_fd() if launch.rank == 0 else None
        assert self.task_fd is not None, "a session needs memfd_create (Linux)"
        self.folder = tempfile.mkdtemp(prefix="pymp-enot_nb-")
        env = dict(os.environ)
        for name, value in launch.env_defaults.items():
            env.setdefault(name, value)
        env.update(launch.env)
        spec = bootstrap.WorkerSpec(
            rank=launch.rank,
            env=env,
            cwd=os.getcwd(),
            sys_path=[p for p in sys.path if isinstance(p, str)],
            threads=launch.threads,
            init_kwargs=launch.init_kwargs,
            parent_pid=os.getpid(),
            stdout_fd=out_w,
            stderr_fd=err_w,
            message_fd=msg_w,
            front_end=launch.front_end,
            kernel_parent=launch.kernel_parent,
            output_setup=launch.output_setup,
            multiprocessing_folder=self.folder,
            result_fd=self.result_fd,
            shared_memory_fd=self.task_fd,  # the session's task file (see loop.serve)
            inline_results_up_to=INLINE_RESULT,
        )
        results = [self.result_fd] if self.result_fd is not None else []
        fds = [out_w, err_w, msg_w, *results, self.task_fd]
        try:
            self.group = ExecGroup(spec, launch.job_bytes, fds)
            self.pid = self.group.start()[launch.rank]
        finally:
            for fd in (out_w, err_w, msg_w):
                os.close(fd)  # the worker holds them: EOF comes when it exits
        return self.pid

    def read(self, timeout: float) -> Batch:
        """What the rank sent, waiting up to ``timeout`` seconds for anything (io group)."""
        try:
            return self._read(timeout)
        except (OSError, ValueError, AttributeError, KeyError):  # closed under us (control group)
            return self._closed()

    def _closed(self) -> Batch:
        return Batch(ended=("err", "msg", "out"), exitcode=self.exitcode if self.exitcode is not None else -9)

    def _read(self, timeout: float) -> Batch:
        batch = Batch()
        if self.group is None:
            return self._closed()
        watched = [fd for name, fd in self.reads.items() if name not in self.ended]
        exits: list[Any] = self.group.sources() if self.exitcode is None else []
        if not self.group.pending():
            select.select(watched + exits, [], [], timeout)
        # Messages first: the output a message was fenced after is in its pipe by then.
        got = {name: self._drain(name) for name in ("msg", "out", "err")}
        if self.exitcode is None and (self.group.pending() or select.select(exits, [], [], 0)[0]):
            for _, code in self.group.exits(exits[0]):
                self.exitcode = code
        if self.exitcode is not None:  # its output to the end: nobody else holds the pipes
            for name in ("msg", "out", "err"):
                got[name] += self._drain(name, until_end=True)
        batch.out, batch.err, batch.msg = got["out"], got["err"], got["msg"]
        batch.ended, batch.exitcode = tuple(sorted(self.ended)), self.exitcode
        return batch

    def _drain(self, name: str, until_end: bool = False) -> bytes:
        if name in self.ended:
            return b""
        fd, chunks, size = self.reads[name], [], 0
        while size < READ_CHUNK:
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                if not until_end or not select.select([fd], [], [], 1.0)[0]:
                    break
                continue
            except ConnectionResetError:
                data = b""
            if not data:
                self.ended.add(name)
                break
            chunks.append(data)
            size += len(data)
        return b"".join(chunks)

    def command(self, data: bytes, task: Any = None) -> None:
        """The task laid out in the task file (if one comes), then the command on the rank's
        message socket (control group)."""
        if task is not None:  # (its pickle, its buffers): laid out as the kernel sized it
            assert self.task_fd is not None
            main, arrays = task
            result_file.write_result(self.task_fd, main, [pickle.PickleBuffer(a) for a in arrays])
        fd = self.reads["msg"]
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                if not select.select([], [fd], [], 30.0)[1]:
                    return  # not reading: not idle; its end is seen by the next read
            except (BrokenPipeError, ConnectionResetError):
                return  # the worker is gone: the next read says how it ended

    def signal(self, signum: int) -> None:
        """``signum`` to the worker (its DataLoader workers are left alone)."""
        if self.group is not None and self.exitcode is None:
            self.group.signal(self.rank, signum)

    def result(self, size: int) -> Any:
        """The first ``size`` bytes of the result file (rank 0), as an array: Ray moves it through
        the object store, not in the call's reply."""
        import mmap

        import numpy

        assert self.result_fd is not None
        # A view of the file: Ray copies it into the store once, after this returns.
        return numpy.frombuffer(mmap.mmap(self.result_fd, size, prot=mmap.PROT_READ), dtype=numpy.uint8)

    def tcp_ends(self) -> tuple[tuple[str, int], ...]:
        """The ends of the worker's TCP sockets (see _processes/sockets): how its peers on other
        nodes find their connections with it."""
        if self.pid is None or self.exitcode is not None:
            return ()
        return sockets.ends_of([self.pid])

    def cpu_seconds(self) -> float | None:
        """The worker's CPU time so far (its progress, while it does not answer)."""
        if self.pid is None or self.exitcode is not None:
            return None
        return cpu_seconds(self.pid)

    def memory(self) -> float | None:
        """The worker's resident memory (MiB), from /proc."""
        if self.pid is None or self.exitcode is not None:
            return None
        return resident_mib(self.pid)

    def close(self) -> int | None:
        """The worker killed (if it still runs) and reaped, everything released; the worker's
        exit code."""
        group, self.group = self.group, None
        try:
            if group is not None:
                group.close()
                self.exitcode = next(iter(group.exited.values()), self.exitcode)
        finally:
            for fd in [*self.reads.values(), self.task_fd, self.result_fd]:
                if fd is not None:
                    os.close(fd)
            self.reads, self.task_fd, self.result_fd = {}, None, None
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder = None
        return self.exitcode
