"""A session's workers, from the kernel: started once, sent commands, supervised per command.

One ``Attempt`` starts them (the same start as a one-off launch: pipes, rendezvous, the
multiprocessing folder, the watchdog, pidfds; a spawn session's own fork server) with the
session loop as their job (see _session/worker/loop), and closes them. In between, each command
goes to every rank on its message socket, and the kernel reads output and messages until every
rank has answered (its outcome), or one died::

    task ok                      -> rank 0's result
    a rank raised                -> the others get FAIL_GRACE seconds to answer; those that do
                                    not are waiting in a collective: the idle ranks abort their
                                    groups, which releases them (a peer's abort ends gloo's and
                                    NCCL's waits), then every rank makes its world group again,
                                    unless all agree on the group's sequence number (Groups)
    a rank died                  -> the caller restarts the session
    stop press                   -> stacks, then SIGINT to each running rank by its pidfd (its
                                    DataLoader workers are left alone), INTERRUPT_SAVE_WAIT to
                                    answer, the stuck ones released as above
    not back within the deadline -> the caller restarts the session (one line says so)

Once every rank has answered, a press is held until the caller has applied the outcome (the
master's changes in the notebook, the mirror's record of the ranks): the cell is over by then,
and a press in the middle would leave the notebook and its record out of step.
"""

from __future__ import annotations

import enum
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from enot_nb._launch import attempt as _attempt
from enot_nb._launch import relay
from enot_nb._launch.attempt import Attempt, load_payload, stack_report
from enot_nb._launch.plan import LaunchPlan
from enot_nb._processes import forkserver_client, framing
from enot_nb._processes import rendezvous as _rendezvous
from enot_nb._processes.interrupts import PressHold, interrupts_deferred
from enot_nb._processes.protocol import (
    AbortGroups,
    InMemfd,
    MessageKind,
    Proceed,
    Regroup,
    ReportGroups,
    RunTask,
    SessionCommand,
    StopWorker,
)
from enot_nb._serialize import picklers, result_file
from enot_nb._session.mirror.mirror import PickledTask
from enot_nb._session.worker import loop as session_loop
from enot_nb._worker import bootstrap
from enot_nb.errors import LaunchError, WorkerFailedError, WorkerFailure

# Seconds the other ranks get to answer once one rank's cell failed, before the kernel takes
# them for waiting in a collective with it (and releases them).
FAIL_GRACE = float(os.environ.get("ENOT_NB_SESSION_FAIL_GRACE", "1.0"))
# Seconds released ranks get to get back to idle (and to make their group again).
RELEASE_WAIT = float(os.environ.get("ENOT_NB_SESSION_RELEASE_WAIT", "10.0"))


class RankState(enum.Enum):
    """A session rank between tasks (the status table's "state")."""

    IDLE = "idle"
    DEAD = "dead"


@dataclass
class CommandOutcome:
    """How one command ended on every rank."""

    result: Any = None
    """Rank 0's result, loaded."""
    partial: Any = None
    """Rank 0's state at a failure or interrupt (Partial), loaded."""
    failures: list[WorkerFailure] = field(default_factory=list)
    interrupted: bool = False
    restart: str | None = None
    """Why the workers must be started again (a rank died or stayed stuck); None: they live."""
    regrouped: bool = False
    refused: bool = False
    """A rank could not apply the task's push: the task ran nowhere."""
    task_bytes: int = 0
    """The size of the task sent (the push travels in it)."""
    result_bytes: int = 0
    """The size of rank 0's result (the master's changes travel in it)."""


class SessionWorkers:
    """N live workers of a session (see the module's docstring)."""

    def __init__(self, plan: LaunchPlan, on_message: Any = None) -> None:
        self.plan = plan
        self.on_message = on_message
        self.attempt: Attempt | None = None
        self.server: forkserver_client.ForkServer | None = None
        self.task_fd: int | None = None
        """The task file (a memfd every rank maps): what a command carries beyond its record."""
        self.started_at = 0.0
        self.generation = 0
        self.tasks = 0  # tasks sent: each one's number
        self.cells = 0  # cells run (counted by the session: pushes and pulls are tasks too)
        self.last: CommandOutcome | None = None  # the last task's end

    def start(self) -> None:
        """Start the ranks and wait until every one is connected; WorkerFailedError if not."""
        for tries in range(1 + _attempt.RECONNECTS):
            try:
                self._start_once()
                return
            except _Reconnect as again:
                self.close()
                if tries == _attempt.RECONNECTS:
                    raise WorkerFailedError(again.failures) from None
                print(
                    f"enot_nb: the ranks could not connect ({again.failures[0].summary()}); starting them again",
                    file=sys.stderr,
                    flush=True,
                )

    def _start_once(self) -> None:
        plan = self.plan
        with interrupts_deferred():
            self.task_fd = result_file.result_fd()
        if self.task_fd is None:
            raise LaunchError("a session needs memfd_create (Linux)")
        timeout = plan.init_kwargs["timeout"]
        if plan.start_method == "spawn":
            with interrupts_deferred():
                self.server = _own_server()
            job = bootstrap.Job(session_loop.serve, (None, plan.init_kwargs["backend"], timeout), gather_shards=False)
            shipped: tuple[bytes, list[int]] | None = (picklers.dumps(job, []), [self.task_fd])
        else:
            job = bootstrap.Job(
                session_loop.serve, (self.task_fd, plan.init_kwargs["backend"], timeout), gather_shards=False
            )
            shipped = None
        self.attempt = Attempt(plan, job, shipped, 0, self.on_message, session=True, session_server=self.server)
        self.attempt.start()
        self.started_at = time.monotonic()
        attempt = self.attempt
        while not all(r.connected for r in attempt.ranks):
            if attempt.failures or any(not r.running for r in attempt.ranks):
                attempt.stopper.wait(2.0, force_show=False, until=lambda: False)  # the others' ends
                failures = attempt.failures or [
                    WorkerFailure.died(r.rank, r.exitcode or -9, 0, r.sinks["err"].tail())
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
                        send(attempt, StopWorker(), live)
                        attempt.stopper.wait(
                            _attempt.STOP_GRACE, force_show=False, until=lambda: not any(r.running for r in live)
                        )
                        attempt.stopper.stop([r for r in attempt.ranks if r.running], (signal.SIGTERM, signal.SIGKILL))
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

    def run_task(self, task: PickledTask, output: str, apply: Callable[[CommandOutcome], Any]) -> Any:
        """Lay the task out in the task file, send it to every rank, supervise it; ``apply``'s
        value. From the moment every rank answered until ``apply`` (the notebook taking the
        answer) has returned, presses are held; one then is raised after it. The outcome is
        ``last`` (also if ``apply`` or a press raised)."""
        assert self.attempt is not None and self.task_fd is not None
        self.last = None  # until this task's end: an error before it must not pass for it
        size = result_file.write_result(self.task_fd, task.main, task.buffers)
        self._show_output(output)
        parent, self.tasks = relay.kernel_parent(), self.tasks + 1
        command = RunTask(size, tuple(task.specs), task.objects, task.storages, parent, task.has_push, self.tasks)
        hold = PressHold()
        try:
            self.last = outcome = CommandRound(self, self.attempt, hold).run(command)
            outcome.task_bytes = size
            if outcome.restart is None and outcome.regrouped:
                print(
                    "enot_nb: the ranks' process group was made again (a collective was left half done); "
                    "objects made with the old one (DDP wrappers, subgroups, FSDP meshes) must be made again",
                    file=sys.stderr,
                )
            value = apply(outcome)
            hold.release(deliver=not outcome.interrupted)  # an interrupted task raises its own
        finally:
            hold.release(deliver=False)  # an error on its way up (else released above)
        return value

    def deaths(self) -> str | None:
        """Why the session must restart before its next task (ranks died since), or None."""
        assert self.attempt is not None
        dead = [r.rank for r in self.attempt.ranks if not r.running]
        if not dead:
            return None
        if len(dead) == len(self.attempt.ranks):
            return "all its workers were dead"
        return f"rank(s) {', '.join(map(str, dead))} had died"

    def _show_output(self, output: str) -> None:
        assert self.attempt is not None
        for r in self.attempt.ranks:
            show = output == "all" or (output == "master" and r.rank == 0)
            for sink in r.sinks.values():
                sink.show, sink.prefix = show, f"[rank {r.rank}] " if output == "all" else ""

    def _init_method(self) -> str:
        """Where the ranks meet to make the world group again: a fresh store each time."""
        attempt = self.attempt
        assert attempt is not None
        self.generation += 1
        if attempt.rendezvous_dir is not None:
            return f"file://{attempt.rendezvous_dir}/store-{self.generation}"
        address = _rendezvous.loopback_for(self.plan.master_addr)
        return _rendezvous.url(address, _rendezvous.free_port(address))


class CommandRound:
    """One command on every rank, supervised until each answered (see the module's docstring):
    its outcome, the stuck ranks released, the group kept or made again."""

    def __init__(self, workers: SessionWorkers, attempt: Attempt, hold: PressHold) -> None:
        self.workers, self.attempt, self.hold = workers, attempt, hold
        self.outcome = CommandOutcome()

    def run(self, command: SessionCommand) -> CommandOutcome:
        attempt, outcome = self.attempt, self.outcome
        ranks = attempt.ranks
        for r in ranks:
            r.outcome, r.payload, r.partial, r.groups, r.pushed = None, None, None, None, False
        attempt.failures = []
        try:  # a press held while the command goes out lands here: the ranks have it
            send(attempt, command, ranks)
            if isinstance(command, RunTask) and command.confirm:
                self._confirm_push(command.task)
            self._supervise()
            self.hold.start()  # every rank answered: the answer is applied whole (see run_task)
        except KeyboardInterrupt:
            outcome.interrupted = True
            try:
                self._interrupt()
                self.hold.start()
            except KeyboardInterrupt:  # pressed again: no more waiting
                outcome.restart = "the stop button was pressed again while the ranks were being stopped"
                self.hold.start()
        dead = [r for r in ranks if not r.running]
        if dead and outcome.restart is None:
            r = dead[0]
            outcome.restart = f"rank {r.rank} died ({_death(r.exitcode)})"
        outcome.failures = list(attempt.failures)
        for r in dead:
            if not any(f.rank == r.rank for f in outcome.failures) and r.exitcode is not None and r.exitcode != 0:
                outcome.failures.append(WorkerFailure.died(r.rank, r.exitcode, 0, r.sinks["err"].tail()))
        outcome.failures.sort(key=WorkerFailure.caused_by_a_lost_peer)
        master = next(r for r in ranks if r.rank == 0)
        if master.outcome == MessageKind.RESULT and master.payload is not None:
            outcome.result = load_payload(attempt.result_fd, master.payload)
            outcome.result_bytes = (
                master.payload.size if isinstance(master.payload, InMemfd) else len(master.payload.data)
            )
        elif master.partial is not None:
            outcome.partial = load_payload(attempt.result_fd, master.partial)
        if outcome.restart is None and (outcome.failures or outcome.interrupted):
            self._keep_or_regroup()  # a press is held (bounded by RELEASE_WAIT)
        return outcome

    def _confirm_push(self, task: int) -> None:
        """Every rank applies the push first; the task runs only if all could (a rank that
        could not has answered with its error: the others skip the task)."""
        attempt = self.attempt
        while any(r.running and r.outcome is None and not r.pushed for r in attempt.ranks):
            if any(not r.running for r in attempt.ranks):
                return  # a rank died: the caller restarts the session
            attempt.handle(attempt.select(None))
        go = not attempt.failures
        self.outcome.refused = not go
        send(attempt, Proceed(go, task), [r for r in attempt.ranks if r.pushed and r.outcome is None])

    def _waiting(self) -> list:
        return [r for r in self.attempt.ranks if r.running and r.outcome is None]

    def _supervise(self) -> None:
        attempt = self.attempt
        failed_at: float | None = None
        while self._waiting():
            if any(not r.running for r in attempt.ranks):
                return  # a rank died: the caller restarts the session
            if attempt.failures and failed_at is None:
                failed_at = time.monotonic()
            timeout = None if failed_at is None else failed_at + FAIL_GRACE - time.monotonic()
            if timeout is not None and timeout <= 0:
                self._release_stuck(RELEASE_WAIT)
                return
            attempt.handle(attempt.select(timeout))

    def _release_stuck(self, wait: float) -> None:
        """Ranks that do not answer after a peer failed (or was interrupted) wait in a
        collective: the idle ranks abort their groups, which releases them."""
        attempt, outcome = self.attempt, self.outcome
        idle = [r for r in attempt.ranks if r.running and r.outcome is not None]
        peers = tuple(r.pid for r in attempt.ranks if r.pid is not None)
        send(attempt, AbortGroups(peers), idle)
        outcome.regrouped = True  # the groups are gone: made again below
        self._wait_all(wait)
        stuck = self._waiting()
        if stuck:
            outcome.restart = (
                f"rank(s) {', '.join(str(r.rank) for r in stuck)} did not get back to idle within "
                f"{wait:g} s of being released (stuck where Python cannot run)"
            )

    def _wait_all(self, seconds: float) -> None:
        self.attempt.stopper.wait(seconds, force_show=False, until=lambda: not self._waiting())

    def _interrupt(self) -> None:
        """The stop button: each running rank's stack, then KeyboardInterrupt in each (by
        pidfd); those stuck in a collective are released; the ranks stay, with their state."""
        attempt = self.attempt
        assert attempt.group is not None and attempt.io is not None
        running = self._waiting()
        if not running:
            return
        print(
            f"\nenot_nb: interrupted; where each of the {len(running)} running rank(s) is:", file=sys.stderr, flush=True
        )
        for r in running:
            r.stack_text = ""
            attempt.group.signal(r.rank, signal.SIGUSR1)
        attempt.io.capturing_stacks = True
        try:
            attempt.stopper.wait(_attempt.STACK_DUMP_WAIT, force_show=True)
        finally:
            attempt.io.capturing_stacks = False
        for r in running:
            print(stack_report(r.rank, r.stack_text), file=sys.stderr, flush=True)
        for r in self._waiting():
            attempt.group.signal(r.rank, signal.SIGINT)
        self._wait_all(_attempt.INTERRUPT_SAVE_WAIT)
        if self._waiting():
            self._release_stuck(_attempt.INTERRUPT_SAVE_WAIT)

    def _keep_or_regroup(self) -> None:
        """After a failed or interrupted cell: the world group is kept when every rank agrees on
        its sequence number (no collective half done), else made again in the same processes."""
        attempt, outcome = self.attempt, self.outcome
        if not outcome.regrouped:
            self._exchange(ReportGroups())
            if _groups_agree([r.groups.sequences if r.groups is not None else None for r in attempt.ranks]):
                return
        outcome.regrouped = True
        answered = self._exchange(Regroup(self.workers._init_method()))
        if not answered or any(r.outcome == MessageKind.ERROR for r in attempt.ranks):
            outcome.restart = "the ranks could not make their process group again"

    def _exchange(self, command: SessionCommand) -> bool:
        """A control command to every rank, answered within RELEASE_WAIT; whether all did."""
        attempt = self.attempt
        for r in attempt.ranks:
            r.outcome, r.payload, r.groups = None, None, None
        failures = attempt.failures
        attempt.failures = []
        send(attempt, command, attempt.ranks)
        deadline = time.monotonic() + RELEASE_WAIT
        while any(r.running and r.outcome is None and r.groups is None for r in attempt.ranks):
            left = deadline - time.monotonic()
            if left <= 0 or any(not r.running for r in attempt.ranks):
                break
            attempt.handle(attempt.select(left))
        attempt.failures = failures
        return all(r.running and (r.outcome is not None or r.groups is not None) for r in attempt.ranks)


def send(attempt: Attempt, command: SessionCommand, ranks: list) -> None:
    """The command to each running rank, as one step (a press cannot send it to only some)."""
    data = framing.encode(command)
    with interrupts_deferred():
        for r in ranks:
            if r.running:
                _write_all(r.pipes["msg"][0], data)


def _groups_agree(reports: list[dict[str, int] | None]) -> bool:
    """Whether every member of each group began as many collectives (see protocol.Groups)."""
    if any(report is None for report in reports):
        return False
    seen: dict[str, set[int]] = {}
    for report in reports:
        assert report is not None
        for name, sequence in report.items():
            seen.setdefault(name, set()).add(sequence)
    return all(len(sequences) == 1 for sequences in seen.values())


class _Reconnect(Exception):
    def __init__(self, failures: list[WorkerFailure]) -> None:
        self.failures = failures


def _own_server() -> forkserver_client.ForkServer:
    return forkserver_client.ForkServer()


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


WRITE_WAIT = 30.0
"""Seconds an idle rank gets to take in a command (it reads it at once: it is idle)."""


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
