"""A session's workers, from the kernel: started once, sent commands, supervised per command.

The ranks sit behind a RankHost (_launch/rank_host: processes of this machine today, see
_launch/local_ranks), started with the session loop as their job (see _session/worker/loop)
and closed with the session. In between, each command goes to every rank, and the kernel
receives output and messages until every rank has answered (its outcome), or one died::

    task ok                      -> rank 0's result
    a rank raised                -> the others get FAIL_GRACE seconds to answer; those that do
                                    not are waiting in a collective: the idle ranks abort their
                                    groups, which releases them (a peer's abort ends gloo's and
                                    NCCL's waits), then every rank makes its world group again,
                                    unless all agree on the group's sequence number (Groups)
    a rank died                  -> the caller restarts the session
    stop press                   -> stacks, then KeyboardInterrupt in each running rank (not in
                                    its DataLoader workers), INTERRUPT_SAVE_WAIT to answer, the
                                    stuck ones released as above
    not back within the deadline -> the caller restarts the session (one line says so)

Once every rank has answered, a press is held until the caller has applied the outcome (the
master's changes in the notebook, the mirror's record of the ranks): the cell is over by then,
and a press in the middle would leave the notebook and its record out of step.
"""

from __future__ import annotations

import enum
import getpass
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from enot_nb._launch import attempt as _attempt
from enot_nb._launch import collective_table, relay
from enot_nb._launch.hang_watch import HangWatch, soonest
from enot_nb._launch.local_ranks import LocalRanks
from enot_nb._launch.plan import LaunchPlan
from enot_nb._launch.rank_host import RankHost
from enot_nb._launch.ranks import Rank
from enot_nb._processes.interrupts import PressHold
from enot_nb._processes.protocol import (
    AbortGroups,
    ErrorReport,
    InputReply,
    Proceed,
    Regroup,
    Repair,
    ReportGroups,
    Result,
    RunTask,
    SessionCommand,
    payload_size,
)
from enot_nb._session.mirror.mirror import PickledTask
from enot_nb._session.worker import loop as session_loop
from enot_nb._worker.collectives import Snapshot
from enot_nb.errors import WorkerFailure

# Seconds the other ranks get to answer once one rank's cell failed, before the kernel takes
# them for waiting in a collective with it (and releases them).
FAIL_GRACE = float(os.environ.get("ENOT_NB_SESSION_FAIL_GRACE", "1.0"))
# Seconds released ranks get to get back to idle (and to make their group again).
RELEASE_WAIT = float(os.environ.get("ENOT_NB_SESSION_RELEASE_WAIT", "10.0"))
# Seconds more that released ranks get at most while their CPU time grows (see
# _wait_working), judged over PROGRESS_WINDOW seconds at a time.
PROGRESS_WAIT = float(os.environ.get("ENOT_NB_SESSION_PROGRESS_WAIT", "50.0"))
PROGRESS_WINDOW = 1.0


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

    _enot_nb_stays_in_the_kernel = True  # its processes are this kernel's: never sent to a rank (registry)

    def __init__(self, plan: LaunchPlan, on_message: Any = None, host: RankHost | None = None) -> None:
        self.plan = plan
        self.host: RankHost = host if host is not None else LocalRanks(plan, on_message)
        """Where the ranks run (processes of this machine unless another host is given)."""
        self.started_at = 0.0
        self.tasks = 0  # tasks sent: each one's number
        self.cells = 0  # cells run (counted by the session: pushes and pulls are tasks too)
        self.last: CommandOutcome | None = None  # the last task's end

    def start(self) -> None:
        """Start the ranks and wait until every one is connected; WorkerFailedError if not."""
        self.host.start(session_loop.serve)
        self.started_at = time.monotonic()

    def close(self) -> None:
        """Stop every rank and release everything."""
        self.host.close()

    def run_task(
        self,
        task: PickledTask,
        output: str,
        apply: Callable[[CommandOutcome], Any],
        hang_after: float | None = None,
        peers_wait: bool = True,
    ) -> Any:
        """Lay the task out for the ranks, send it to every rank, supervise it (``hang_after``:
        see hang_watch; ``peers_wait``: the ranks may wait for each other in collectives, and a
        rank's prompt shows the time left); ``apply``'s value. From the moment every rank
        answered until ``apply`` (the notebook taking the answer) has returned, presses are
        held; one then is raised after it. The outcome is ``last`` (also if ``apply`` or a press
        raised)."""
        self.last = None  # until this task's end: an error before it must not pass for it
        size = self.host.put_task(task.main, task.buffers)
        self.host.show(output)
        parent, self.tasks = relay.kernel_parent(), self.tasks + 1
        command = RunTask(size, tuple(task.specs), task.objects, task.storages, parent, task.has_push, self.tasks)
        hold = PressHold()
        try:
            timeout = self.plan.init_kwargs.get("timeout")
            seconds = timeout.total_seconds() if timeout is not None and peers_wait else None
            self.last = outcome = CommandRound(self.host, hold, hang_after, seconds).run(command)
            outcome.task_bytes = size
            if outcome.restart is None and outcome.regrouped:
                print(
                    "enot_nb: the ranks' process group was made again (a collective was left half done); "
                    "DDP wrappers are moved onto it, other objects made with the old one (subgroups, FSDP "
                    "meshes) must be made again",
                )
            value = apply(outcome)
            hold.release(deliver=not outcome.interrupted)  # an interrupted task raises its own
        finally:
            hold.release(deliver=False)  # an error on its way up (else released above)
        return value

    def deaths(self) -> str | None:
        """Why the session must restart before its next task (ranks died since, seen without
        waiting: their ends are taken in now), or None."""
        self.host.poll(0)
        ranks = self.host.ranks
        dead = [r.rank for r in ranks if not r.running]
        if not dead:
            return None
        if len(dead) == len(ranks):
            return "all its workers were dead"
        return f"rank(s) {', '.join(map(str, dead))} had died"


class CommandRound:
    """One command on every rank, supervised until each answered (see the module's docstring):
    its outcome, the stuck ranks released, the group kept or made again."""

    def __init__(
        self, host: RankHost, hold: PressHold, hang_after: float | None = None, group_timeout: float | None = None
    ) -> None:
        self.host, self.hold = host, hold
        self.group_timeout = group_timeout
        """The process group's timeout: how long the other ranks wait for one in the debugger."""
        self.asked_at: dict[int, float] = {}
        """When each rank first asked the notebook for a line in this command (see _answer_input)."""
        self.hang = HangWatch(hang_after, lambda: {r.rank: host.cpu_seconds(r) for r in self._waiting()})
        self.outcome = CommandOutcome()
        self.released: set[int] = set()
        """The ranks released from a collective (see _release_stuck): named so, never failures."""
        self.stopped: set[int] = set()
        """The master, stopped to send its state after a peer died (see _save_the_masters_state)."""
        self.said_dead: set[int] = set()
        """The ranks whose death was shown already (see _say_died)."""
        self.saved: bool | None = None
        """After a wait for the master's state (see _save_the_masters_state): whether it came in
        time; None where there was no wait (run() then reads what the master sent)."""

    def run(self, command: SessionCommand) -> CommandOutcome:
        host, outcome = self.host, self.outcome
        ranks = host.ranks
        for r in ranks:
            r.outcome, r.payload, r.partial, r.groups, r.pushed = None, None, None, None, False
            r.input_request = None  # one an earlier command left unanswered is not this one's
        host.failures = []
        try:  # a press held while the command goes out lands here: the ranks have it
            host.send(command, ranks)
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
        self._say_died(dead)  # where the others answered before the death was seen
        master = next(r for r in ranks if r.rank == 0)
        if dead and outcome.restart is None:
            r = dead[0]
            # The master may have answered before the death was seen (its wait on the dead peer
            # ended at once): what it sent is the state at the failure all the same.
            saved = self.saved if self.saved is not None else (_sent_state(master) if master.running else False)
            outcome.restart = f"rank {r.rank} died ({host.why_ended(r)}){_state_kept(saved, r.rank)}"
        outcome.failures = list(host.failures)
        for r in dead:
            if not any(f.rank == r.rank for f in outcome.failures) and r.exitcode is not None and r.exitcode != 0:
                outcome.failures.append(WorkerFailure.died(r.rank, r.exitcode, 0, r.err_tail(), r.signal_cause))
        outcome.failures = _named_released(outcome.failures, self.released, self.stopped)
        outcome.failures.sort(key=WorkerFailure.caused_by_a_lost_peer)
        if isinstance(master.outcome, Result) and master.payload is not None:
            outcome.result = host.load(master.payload)
            outcome.result_bytes = payload_size(master.payload)
        elif master.partial is not None:
            outcome.partial = host.load(master.partial)
        if outcome.restart is None and (outcome.failures or outcome.interrupted):
            self._keep_or_regroup()  # a press is held (bounded by RELEASE_WAIT)
            if outcome.restart is None:
                self._repair()
        return outcome

    def _confirm_push(self, task: int) -> None:
        """Every rank applies the push first; the task runs only if all could (a rank that
        could not has answered with its error: the others skip the task)."""
        host = self.host
        while any(r.running and r.outcome is None and not r.pushed for r in host.ranks):
            if any(not r.running for r in host.ranks):
                return  # a rank died: the caller restarts the session
            host.poll(None)
        go = not host.failures
        self.outcome.refused = not go
        host.send(Proceed(go, task), [r for r in host.ranks if r.pushed and r.outcome is None])

    def _waiting(self) -> list:
        return [r for r in self.host.ranks if r.running and r.outcome is None]

    def _supervise(self) -> None:
        host = self.host
        failed_at: float | None = None
        self.hang.start()
        while self._waiting():
            dead = [r for r in host.ranks if not r.running]
            if dead:
                self._say_died(dead)
                self._save_the_masters_state()
                return  # a rank died: the caller restarts the session
            if host.failures and failed_at is None:
                failed_at = time.monotonic()
                timed_out = collective_table.timed_out(host.ranks)
                if timed_out:
                    self._show_collectives(collective_table.TIMED_OUT, timed_out)
            timeout = None if failed_at is None else failed_at + FAIL_GRACE - time.monotonic()
            if timeout is not None and timeout <= 0:
                self._release_stuck(RELEASE_WAIT)
                return
            host.poll(soonest(timeout, self.hang.due()))
            self._answer_inputs(closing=bool(host.failures))  # a peer failed: no more prompts
            if failed_at is None and self.hang.found():
                self._show_hang()

    def _answer_inputs(self, closing: bool) -> None:
        """Answer each rank that asks for a line; ``closing`` (the cell is being stopped: a
        press, a peer's failure): without asking, ``interrupted``, so that its debugger closes and
        it gets back to idle instead of asking again."""
        for r in self.host.ranks:
            if r.input_request is None:
                continue
            if closing:
                r.input_request = None
                self.host.send(InputReply(None, interrupted=True), [r])
            else:
                self._answer_input(r)

    def _answer_input(self, r: Rank) -> None:
        """A rank asks for a line (``input()``, the debugger): what its debugger printed, then
        the front end's prompt naming the rank and the time its peers' collectives have left;
        the line, or the front end's StdinNotImplementedError, goes back to the rank (a stop
        pressed at the prompt is the cell's: its KeyboardInterrupt closes the rank's debugger)."""
        from IPython.core.error import StdinNotImplementedError

        request, r.input_request = r.input_request, None
        assert request is not None
        if request.shown:
            print(request.shown, end="", flush=True)
        began = self.asked_at.setdefault(r.rank, time.monotonic())
        left = ""
        if self.group_timeout is not None:
            seconds = max(0, int(self.group_timeout - (time.monotonic() - began)))
            left = f" · {seconds // 60}:{seconds % 60:02d} left"
        prompt = f"[rank {r.rank}{left}] {request.prompt}"
        try:
            line = getpass.getpass(prompt) if request.password else input(prompt)
            reply = InputReply(line)
        except StdinNotImplementedError as err:  # nbclient, papermill: the rank gets it at once
            reply = InputReply(None, str(err))
        except EOFError:
            reply = InputReply(None, "the notebook's stdin is closed")
        self.host.send(reply, [r])
        self.hang.start()  # the time the user took is no hang

    def _show_hang(self) -> None:
        """No rank has made progress for the hang watch's seconds: where each is and its last
        collective, once; the cell goes on (the user chooses to stop)."""
        self._show_collectives(
            f"no rank has made progress (used CPU time) for {self.hang.after:g} s; the cell goes on: press stop "
            "to stop it (the session stays)"
        )

    def _show_collectives(self, why: str, known: dict[int, Snapshot] | None = None) -> None:
        """``why``, then the ranks' collectives side by side: ``known`` (those sent with a
        timeout's error) and the waiting ranks' (each asked for its dump); their stacks where no
        rank issued a collective."""
        waiting = [r for r in self._waiting() if r.rank not in (known or {})]
        dumps = self.host.dump_stacks(waiting) if waiting else {}
        print(f"\nenot_nb: {why}\n{_attempt.collectives_or_stacks(dumps, known)}", file=sys.stderr, flush=True)

    def _say_died(self, dead: list[Rank]) -> None:
        """A death shown at once, before the wait for the master's state and the restart (a
        start on a cluster takes a while): which rank, how it ended, and where."""
        for r in dead:
            if r.rank in self.said_dead:
                continue
            self.said_dead.add(r.rank)
            print(
                f"enot_nb: rank {r.rank} died ({self.host.why_ended(r)}); the session restarts once the "
                "master's state is taken (the error follows)",
                file=sys.stderr,
                flush=True,
            )

    def _save_the_masters_state(self) -> None:
        """A rank died mid-task while the master lives: the master gets INTERRUPT_SAVE_WAIT
        seconds to answer (its wait on the dead peer ends with an error), else is stopped
        (KeyboardInterrupt) and gets as long again; either way it sends the state it reached,
        which the notebook takes before the session restarts from it."""
        host = self.host
        master = next((r for r in host.ranks if r.rank == 0), None)
        if master is None or not master.running or master.outcome is not None:
            return  # nothing to wait for: run() reads what the master sent, or that it died

        def answered() -> bool:
            return master.outcome is not None or not master.running

        self._wait(_attempt.INTERRUPT_SAVE_WAIT, until=answered)
        if not answered() and master.partial is None:
            self.stopped.add(master.rank)
            host.interrupt([master])
            self._wait(_attempt.INTERRUPT_SAVE_WAIT, until=answered)
        self.saved = _sent_state(master) if answered() and master.running else False

    def _release_stuck(self, wait: float) -> None:
        """Ranks that do not answer after a peer failed (or was interrupted) wait in a
        collective: the idle ranks abort their groups, which releases them."""
        host, outcome = self.host, self.outcome
        idle = [r for r in host.ranks if r.running and r.outcome is not None]
        self.released |= {r.rank for r in self._waiting()}
        host.send(AbortGroups(host.peers()), idle)
        outcome.regrouped = True  # the groups are gone: made again below
        self._wait_working(wait, self._waiting)
        stuck = self._waiting()
        if stuck:
            outcome.restart = (
                f"rank(s) {', '.join(str(r.rank) for r in stuck)} did not get back to idle within "
                f"{wait:g} s of being released, and used no CPU time in the last {PROGRESS_WINDOW:g} s "
                "(stuck where Python cannot run)"
            )

    def _wait_all(self, seconds: float) -> None:
        self._wait(seconds, until=lambda: not self._waiting())

    def _wait(self, seconds: float, until: Callable[[], bool]) -> None:
        """``host.wait`` while the cell is being stopped: a rank that asks for a line meanwhile
        (its debugger, after a release) is answered ``interrupted`` at once."""
        deadline = time.monotonic() + seconds

        def asking() -> bool:
            return any(r.input_request is not None for r in self.host.ranks)

        while True:
            self.host.wait(max(0.0, deadline - time.monotonic()), until=lambda: until() or asking())
            self._answer_inputs(closing=True)
            if until() or time.monotonic() >= deadline:
                return

    def _wait_working(self, seconds: float, pending: Callable[[], list[Rank]]) -> None:
        """Until no rank is ``pending``, ``seconds`` at most; then PROGRESS_WINDOW seconds more at
        a time while a pending rank's CPU time grows (a loaded machine slows a rank's way back; a
        rank blocked in a wait uses none), PROGRESS_WAIT seconds more at most."""
        host = self.host
        self._wait(seconds, until=lambda: not pending())
        deadline = time.monotonic() + PROGRESS_WAIT
        before = {r.rank: host.cpu_seconds(r) for r in pending()}
        while pending() and time.monotonic() < deadline:
            self._wait(min(PROGRESS_WINDOW, max(0.0, deadline - time.monotonic())), until=lambda: not pending())
            after = {r.rank: host.cpu_seconds(r) for r in pending()}
            if not any(_grew(before.get(rank), now) for rank, now in after.items()):
                return
            before = after

    def _interrupt(self) -> None:
        """The stop button: each running rank's stack, then KeyboardInterrupt in each; those
        stuck in a collective are released; the ranks stay, with their state."""
        running = self._waiting()
        if not running:
            return
        print(
            f"\nenot_nb: interrupted; where each of the {len(running)} running rank(s) is:", file=sys.stderr, flush=True
        )
        print(_attempt.where_ranks_are(self.host.dump_stacks(running)), file=sys.stderr, flush=True)
        self.host.interrupt(self._waiting())
        self._wait_all(_attempt.INTERRUPT_SAVE_WAIT)
        if self._waiting():
            self._release_stuck(RELEASE_WAIT)

    def _keep_or_regroup(self) -> None:
        """After a failed or interrupted cell: the world group is kept when every rank agrees on
        its sequence number (no collective half done), else made again in the same processes."""
        host, outcome = self.host, self.outcome
        if not outcome.regrouped:
            self._exchange(ReportGroups())
            if _groups_agree([r.groups.sequences if r.groups is not None else None for r in host.ranks]):
                return
        outcome.regrouped = True
        why = self._exchange(Regroup(host.meeting_point()))
        if why is not None:
            outcome.restart = f"the ranks could not make their process group again ({why})"

    def _repair(self) -> None:
        """After a failed or interrupted command, the group kept or made again: every rank
        rebinds its DDP wrappers and takes the master's replicated state where it differs (see
        _session/worker/repair)."""
        why = self._exchange(Repair())
        if why is not None:
            self.outcome.restart = f"the ranks could not rebind their DDP wrappers to their process group ({why})"

    def _exchange(self, command: SessionCommand) -> str | None:
        """A control command to every rank, answered within RELEASE_WAIT; None where every rank
        did without an error, else what went wrong on which rank."""
        host = self.host
        for r in host.ranks:
            r.outcome, r.payload, r.groups = None, None, None
        failures = host.failures
        host.failures = []
        host.send(command, host.ranks)

        def unanswered() -> list[Rank]:
            if any(not r.running for r in host.ranks):
                return []  # one died: the others' answers change nothing
            return [r for r in host.ranks if r.outcome is None and r.groups is None]

        self._wait_working(RELEASE_WAIT, unanswered)
        host.failures = failures
        return _exchange_failed(host.ranks)


def _exchange_failed(ranks: Sequence[Rank]) -> str | None:
    """What went wrong on which rank in a control exchange (see CommandRound._exchange); None:
    nothing did."""
    whys = []
    for r in ranks:
        if not r.running:
            whys.append(f"rank {r.rank} died")
        elif isinstance(r.outcome, ErrorReport):
            whys.append(f"rank {r.rank}: {r.outcome.type or 'sys.exit'}: {r.outcome.message}")
        elif r.outcome is None and r.groups is None:
            whys.append(
                f"rank {r.rank} did not answer within {RELEASE_WAIT:g} s, nor use CPU time for {PROGRESS_WINDOW:g} s"
            )
    return "; ".join(whys) or None


def _named_released(failures: list[WorkerFailure], released: set[int], stopped: set[int]) -> list[WorkerFailure]:
    """The failures, each released rank's error (a transport error from its group's abort) named
    as its release from a collective with the ranks that failed on their own, and a master
    stopped to send its state named so."""
    ours = released | stopped
    causes = sorted({f.rank for f in failures if f.rank not in ours})
    if not causes:
        return failures
    return [
        WorkerFailure.released_from(f.rank, causes, f.attempt, stopped=f.rank in stopped)
        if f.rank in ours and f.error_type
        else f
        for f in failures
    ]


def _sent_state(master: Any) -> bool | None:
    """Whether the master sent a state to take (None: it had none to send, as a --no-return cell)."""
    return True if master.partial is not None or master.payload is not None else None


def _state_kept(saved: bool | None, died: int) -> str:
    """What a restart's line adds about the state the notebook holds after a death mid-task."""
    if saved is None:
        return ""
    if saved:
        return "; the notebook holds the master's state at the failure"
    if died == 0:
        return "; the master itself died: the notebook holds the state from before the cell"
    return (
        f"; the master could not send its state within {2 * _attempt.INTERRUPT_SAVE_WAIT:g} s (a wait Python "
        "cannot interrupt): the notebook holds the state from before the cell"
    )


def _grew(before: float | None, after: float | None) -> bool:
    """CPU time used between two readings (a clock tick or more)."""
    return before is not None and after is not None and after > before


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
