"""A session's ranks as processes of this machine: the one implementation of RankHost (see
rank_host for the interface).

One ``Attempt`` starts them (the same start as a one-off launch: pipes, rendezvous, the
multiprocessing folder, the watchdog, pidfds; a spawn session's own fork server) with the
session loop as their job, and closes them. Commands go to every rank on its message socket (a
socket pair: the worker reads its commands there too); a task lies in a memfd every rank maps
(the task file); a rank is signalled by its pidfd (its DataLoader workers are left alone).
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Callable, Sequence
from typing import Any

from enot_nb._launch import attempt as _attempt
from enot_nb._launch.attempt import Attempt, load_payload
from enot_nb._launch.plan import LaunchPlan
from enot_nb._launch.ranks import Rank
from enot_nb._processes import forkserver_client, framing, sockets
from enot_nb._processes import rendezvous as _rendezvous
from enot_nb._processes.groups import cpu_seconds, resident_mib
from enot_nb._processes.interrupts import interrupts_deferred
from enot_nb._processes.protocol import Payload, SessionCommand, StopWorker
from enot_nb._processes.sockets import End
from enot_nb._serialize import picklers, result_file
from enot_nb._worker import bootstrap
from enot_nb.errors import LaunchError, WorkerFailedError, WorkerFailure, signal_name_of

WRITE_WAIT = 30.0
"""Seconds an idle rank gets to take in a command (it reads it at once: it is idle)."""


class LocalRanks:
    """A session's ranks as processes of this machine (see the module's docstring)."""

    def __init__(self, plan: LaunchPlan, on_message: Any = None) -> None:
        self.plan = plan
        self.on_message = on_message
        self.attempt: Attempt | None = None
        self.server: forkserver_client.ForkServer | None = None
        self.task_fd: int | None = None
        """The task file (a memfd every rank maps): what a command carries beyond its record."""
        self.generation = 0  # world groups made again: each meets at a store of its own

    @property
    def ranks(self) -> list[Rank]:
        return self.attempt.ranks if self.attempt is not None else []

    @property
    def failures(self) -> list[WorkerFailure]:
        assert self.attempt is not None
        return self.attempt.failures

    @failures.setter
    def failures(self, failures: list[WorkerFailure]) -> None:
        assert self.attempt is not None
        self.attempt.failures = failures

    def start(self, serve: Callable[..., Any]) -> None:
        """Start the ranks, each running ``serve(task_fd, backend, timeout)``, and wait until every
        one is connected; ranks that failed to connect are started again (RECONNECTS times);
        WorkerFailedError if they still fail."""
        for tries in range(1 + _attempt.RECONNECTS):
            try:
                self._start_once(serve)
                return
            except _Reconnect as again:
                self.close()
                if tries == _attempt.RECONNECTS:
                    raise WorkerFailedError(again.failures) from None
                print(
                    f"enot_nb: the ranks could not connect ({again.failures[0].summary()}); starting them again",
                    flush=True,
                )

    def _start_once(self, serve: Callable[..., Any]) -> None:
        plan = self.plan
        with interrupts_deferred():
            self.task_fd = result_file.result_fd()
        if self.task_fd is None:
            raise LaunchError("a session needs memfd_create (Linux)")
        timeout = plan.init_kwargs["timeout"]
        if plan.start_method == "spawn":
            with interrupts_deferred():
                self.server = _own_server()
            job = bootstrap.Job(serve, (None, plan.init_kwargs["backend"], timeout), gather_shards=False)
            shipped: tuple[bytes, list[int]] | None = (picklers.dumps(job, []), [self.task_fd])
        else:
            job = bootstrap.Job(serve, (self.task_fd, plan.init_kwargs["backend"], timeout), gather_shards=False)
            shipped = None
        self.attempt = Attempt(plan, job, shipped, 0, self.on_message, session=True, session_server=self.server)
        self.attempt.start()
        attempt = self.attempt
        while not all(r.connected for r in attempt.ranks):
            if attempt.failures or any(not r.running for r in attempt.ranks):
                attempt.stopper.wait(2.0, force_show=False, until=lambda: False)  # the others' ends
                failures = attempt.failures or [
                    WorkerFailure.died(r.rank, r.exitcode or -9, 0, r.sinks["err"].tail(), r.signal_cause)
                    for r in attempt.ranks
                    if not r.running
                ]
                failures.sort(key=WorkerFailure.caused_by_a_lost_peer)
                if all(f.connecting for f in failures):
                    raise _Reconnect(failures)
                self.close()
                raise WorkerFailedError(failures)
            attempt.handle(attempt.select(None))

    def close(self) -> None:
        """Stop every rank (StopWorker, then the one escalation) and release everything."""
        attempt = self.attempt  # kept until it is closed: a press here leaves it for the next close
        try:
            if attempt is not None:
                try:
                    live = [r for r in attempt.ranks if r.running]
                    if live and attempt.group is not None:
                        self.send(StopWorker(), live)
                        attempt.stopper.wait(
                            _attempt.STOP_GRACE, force_show=False, until=lambda: not any(r.running for r in live)
                        )
                        self.stop([r for r in attempt.ranks if r.running])
                finally:
                    try:
                        attempt.close()
                    finally:
                        attempt.close()  # a no-op, unless a press landed on the line above
        finally:
            with interrupts_deferred():
                self.attempt = None
                fd, self.task_fd = self.task_fd, None
                server, self.server = self.server, None
                if fd is not None:
                    os.close(fd)
                if server is not None:
                    server.close()

    def put_task(self, main: bytes, buffers: Sequence[Any]) -> int:
        assert self.task_fd is not None
        return result_file.write_result(self.task_fd, main, list(buffers))

    def send(self, command: SessionCommand, ranks: list[Rank]) -> None:
        """The command to each running rank, as one step (a press cannot send it to only some)."""
        data = framing.encode(command)
        with interrupts_deferred():
            for r in ranks:
                if r.running:
                    _write_all(r.pipes["msg"][0], data)

    def poll(self, timeout: float | None) -> None:
        assert self.attempt is not None
        self.attempt.handle(self.attempt.select(timeout))

    def wait(self, seconds: float, until: Callable[[], bool]) -> None:
        assert self.attempt is not None
        self.attempt.stopper.wait(seconds, force_show=False, until=until)

    def dump_stacks(self, ranks: list[Rank]) -> dict[int, str]:
        """Each rank's dump (SIGUSR1 by its pidfd: the worker prints its stack and its
        collectives between fences on stderr), read for STACK_DUMP_WAIT seconds at most."""
        assert self.attempt is not None
        return self.attempt.stopper.dump_stacks(ranks)

    def interrupt(self, ranks: list[Rank]) -> None:
        attempt = self.attempt
        assert attempt is not None and attempt.group is not None
        for r in ranks:
            if r.running:
                attempt.group.signal(r.rank, signal.SIGINT)

    def stop(self, ranks: list[Rank]) -> None:
        assert self.attempt is not None
        self.attempt.stopper.stop(ranks, (signal.SIGTERM, signal.SIGKILL))

    def peers(self) -> tuple[End, ...]:
        """The ends of the ranks' TCP sockets, from /proc (see _processes/sockets)."""
        return sockets.ends_of(r.pid for r in self.ranks if r.pid is not None and r.running)

    def meeting_point(self) -> str:
        """Where the ranks meet to make the world group again: a fresh store each time."""
        attempt = self.attempt
        assert attempt is not None
        self.generation += 1
        if attempt.rendezvous_dir is not None:
            return f"file://{attempt.rendezvous_dir}/store-{self.generation}"
        address = _rendezvous.loopback_for(self.plan.master_addr)
        return _rendezvous.url(address, _rendezvous.free_port(address))

    def load(self, payload: Payload) -> Any:
        assert self.attempt is not None
        return load_payload(self.attempt.result_fd, payload)

    def resident_mib(self, rank: Rank) -> float | None:
        """The rank's resident memory, from /proc."""
        if rank.pid is None:
            return None
        return resident_mib(rank.pid)

    def cpu_seconds(self, rank: Rank) -> float | None:
        """The rank's CPU time so far, from /proc (its progress while it does not answer)."""
        return cpu_seconds(rank.pid) if rank.pid is not None and rank.running else None

    def why_ended(self, rank: Rank) -> str:
        """How a rank's process ended: the signal that killed it, or its exit code."""
        exitcode = rank.exitcode
        return signal_name_of(exitcode) if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"

    def location(self, rank: Rank) -> tuple[str, str] | None:
        return None  # this machine

    def device(self, rank: Rank) -> str | None:
        return None  # the plan's: LOCAL_RANK's GPU under nccl, else the CPU

    def show(self, output: str) -> None:
        for r in self.ranks:
            shown = output == "all" or (output == "master" and r.rank == 0)
            for sink in r.sinks.values():
                sink.show, sink.prefix = shown, f"[rank {r.rank}] " if output == "all" else ""


class _Reconnect(Exception):
    def __init__(self, failures: list[WorkerFailure]) -> None:
        self.failures = failures


def _own_server() -> forkserver_client.ForkServer:
    return forkserver_client.ForkServer()


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a non-blocking socket; a rank that takes none of it within
    WRITE_WAIT is not reading (not idle): it stops being sent to, and its end is seen later."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            if not select.select([], [fd], [], WRITE_WAIT)[1]:
                return
        except (BrokenPipeError, ConnectionResetError):
            return  # the rank is gone: its exit is seen through its pidfd
