"""Supervising one attempt of a launch: start -> supervise -> collect -> close.

The launcher (enot_nb.launcher) validates and plans; this module runs the plan once. Workers
are watched through their pipes (output, messages; see ranks) and their exits (see groups);
the first failure stops every other worker; an interrupt first asks each rank for its stack,
then lets the master alone save its state. Whatever happens, ``close`` kills and reaps every
worker before the attempt returns or raises: the start is a transaction.

One routine stops workers (``Stopper.stop``): each signal of an escalation (SIGINT, SIGTERM, SIGKILL)
goes to the running workers, which then get ``STOP_GRACE`` seconds before the next.
"""

from __future__ import annotations

import functools
import os
import pickle
import selectors
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from typing_extensions import assert_never

from enot_nb._launch import collective_table, relay
from enot_nb._launch.hang_watch import HangWatch
from enot_nb._launch.ranks import Rank, RankIO, close_pipes, make_ranks
from enot_nb._launch.tracebacks import as_in_the_notebook
from enot_nb._log import log
from enot_nb._processes import forkserver_client, oom, watchdog_client
from enot_nb._processes import rendezvous as _rendezvous
from enot_nb._processes.framing import LaunchFds
from enot_nb._processes.groups import ForkedGroup, ServerGroup, WorkerGroup, cpu_seconds
from enot_nb._processes.interrupts import finish, interrupts_deferred
from enot_nb._processes.protocol import ErrorReport, FrontEndMessage, Inline, InMemfd, Payload, Result
from enot_nb._processes.starts import start_error
from enot_nb._serialize import result_file
from enot_nb._worker import bootstrap, preload, streams
from enot_nb._worker.collectives import Snapshot
from enot_nb.errors import LaunchError, LaunchInterrupted, WorkerFailure, sigkill_cause

if TYPE_CHECKING:
    from collections.abc import Callable

    from enot_nb._launch.plan import LaunchPlan

# Seconds a signal gets to stop the workers before the next, harsher one (SIGINT, SIGTERM, SIGKILL).
STOP_GRACE = float(os.environ.get("ENOT_NB_STOP_GRACE", "1.0"))
# Seconds the workers get to print their stacks after an interrupt.
STACK_DUMP_WAIT = float(os.environ.get("ENOT_NB_STACK_DUMP_WAIT", "1.0"))
# Seconds an interrupted master gets, alone, to send the state it reached (a stopped cell keeps
# it, as a local cell would); with the stack dump and the stop of the others, within 5 s.
INTERRUPT_SAVE_WAIT = float(os.environ.get("ENOT_NB_INTERRUPT_SAVE_WAIT", "2.0"))
# Rendezvous of a one-node launch: "file" (a FileStore in a private temporary folder) or "tcp"
# (a TCP store on loopback). See rendezvous.
RENDEZVOUS = os.environ.get("ENOT_NB_RENDEZVOUS", "file")
_ESCALATION = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
# Times a launch is started again when its ranks fail to connect before any user code ran.
RECONNECTS = 2
# Seconds a wait for the ranks blocks at most: a stop press the kernel gets on another of its
# threads (ipykernel's, a widget's) interrupts no system call of the main thread, whose Python
# handler runs only once its wait returns. Without it a quiet cell's press was lost (a hang).
PRESS_CHECK = 0.25


def rank_environment(plan: LaunchPlan, local_rank: int, address: str, port: int, attempt: int) -> dict[str, str]:
    """The caller's environment plus torchrun's variables for one rank."""
    env = dict(os.environ)
    rank = str(plan.node_rank * plan.nprocs + local_rank)
    env.update(
        WORLD_SIZE=str(plan.world_size),
        RANK=rank,
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(plan.nprocs),
        NODE_RANK=str(plan.node_rank),
        GROUP_RANK=str(plan.node_rank),
        GROUP_WORLD_SIZE=str(plan.nnodes),
        ROLE_NAME="default",
        ROLE_RANK=rank,
        ROLE_WORLD_SIZE=str(plan.world_size),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
        # torchrun's markers: frameworks (Lightning, Accelerate) see an external launcher.
        # Not TORCHELASTIC_USE_AGENT_STORE: the ranks meet through our own store, not an agent's.
        TORCHELASTIC_RUN_ID=plan.run_id,
        TORCHELASTIC_RESTART_COUNT=str(attempt),
        TORCHELASTIC_MAX_RESTARTS=str(plan.max_restarts),
        OMP_NUM_THREADS=str(plan.threads),
    )
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # a kernel started by torchrun has it
    if plan.nnodes == 1:  # the collectives' own sockets stay on loopback too
        env.setdefault("GLOO_SOCKET_IFNAME", _rendezvous.LOOPBACK_INTERFACE)
        env.setdefault("NCCL_SOCKET_IFNAME", _rendezvous.LOOPBACK_INTERFACE)
    return env


@dataclass
class Outcome:
    ok: bool
    result: Any = None
    failures: list[WorkerFailure] = field(default_factory=list)
    partial: Any = None
    reconnectable: bool = False
    """Every failure happened while the ranks connected and no rank got past it (nothing of the
    user's ran anywhere): the launch may simply start again."""


class Stopper:
    """How an attempt stops its workers: the one escalation, and the interrupt (stack dumps,
    the master alone saving its state, then everyone stopped). Owned by its Attempt: it signals
    the attempt's group, and handles the attempt's events while it waits (``wait``)."""

    def __init__(self, attempt: Attempt) -> None:
        self.attempt = attempt
        self.stopping = False
        """Deaths from here on are our doing (after the first failure, or an interrupt)."""

    def signal_running(self, signum: int, ranks: list[Rank] | None = None) -> None:
        group = self.attempt.group
        assert group is not None
        for r in ranks if ranks is not None else self.attempt.ranks:
            if r.running:
                if signum != signal.SIGUSR1:  # a stack dump stops nothing
                    r.stop_signals.add(signum)
                group.signal(r.rank, signum)

    def after_failure(self) -> None:
        """The first failure stops everyone else: SIGTERM, then SIGKILL."""
        self.stopping = True
        timed_out = collective_table.timed_out(self.attempt.ranks)
        if timed_out:
            self.show_collectives(collective_table.TIMED_OUT, timed_out)
        first = self.attempt.failures[0]
        log.debug("attempt %d: first failure, rank %d (exit code %s)", self.attempt.attempt, first.rank, first.exitcode)
        self.stop([r for r in self.attempt.ranks if r.running], _ESCALATION[1:])

    def stop(self, ranks: list[Rank], signals: tuple[int, ...] = _ESCALATION) -> None:
        """The one escalation (after a failure, SIGTERM then SIGKILL; after an interrupt, SIGINT
        first): each signal to the ranks still running, then STOP_GRACE seconds at most."""
        for signum in signals:
            if not any(r.running for r in ranks):
                return
            log.debug(
                "attempt %d: %s to ranks %s",
                self.attempt.attempt,
                signal.Signals(signum).name,
                [r.rank for r in ranks if r.running],
            )
            self.signal_running(signum, ranks)
            self.wait(STOP_GRACE, force_show=False, until=lambda: not any(r.running for r in ranks))

    def interrupt(self) -> None:
        """Show where every rank is; let the master, alone, send the state it reached; then stop
        everyone."""
        self.stopping = True
        attempt = self.attempt
        log.debug("attempt %d: interrupted", attempt.attempt)
        running = [r for r in attempt.ranks if r.running]
        if running and attempt.io is not None:
            print(
                f"\nenot_nb: interrupted; where each of the {len(running)} running rank(s) is:",
                file=sys.stderr,
                flush=True,
            )
            print(where_ranks_are(self.dump_stacks(running)), file=sys.stderr, flush=True)
        master = next((r for r in attempt.ranks if r.rank == 0 and r.running), None)
        if master is not None and attempt.group is not None:
            self.signal_running(signal.SIGINT, [master])
            self.wait(
                INTERRUPT_SAVE_WAIT, force_show=False, until=lambda: master.partial is not None or not master.running
            )
        self.stop(attempt.ranks)

    def show_hang(self) -> None:
        """No rank has made progress for the hang watch's seconds: where each is and its last
        collective, once; the launch goes on (the user chooses to stop)."""
        after = self.attempt.hang.after
        self.show_collectives(
            f"no rank has made progress (used CPU time) for {after:g} s; the launch goes on: press stop to stop it"
        )

    def show_collectives(self, why: str, known: dict[int, Snapshot] | None = None) -> None:
        """``why``, then the ranks' collectives side by side: ``known`` (those sent with a
        timeout's error) and the running ranks' (each asked for its dump); their stacks where
        no rank issued a collective."""
        attempt = self.attempt
        running = [r for r in attempt.ranks if r.running and r.rank not in (known or {})]
        dumps = self.dump_stacks(running) if running and attempt.io is not None else {}
        print(f"\nenot_nb: {why}\n{collectives_or_stacks(dumps, known)}", file=sys.stderr, flush=True)

    def dump_stacks(self, ranks: list[Rank]) -> dict[int, str]:
        """Each rank's dump (SIGUSR1: its stack and its collectives, printed between fences on
        its stderr), read for STACK_DUMP_WAIT seconds at most."""
        io = self.attempt.io
        assert io is not None
        for r in ranks:
            r.stack_text = ""  # (a dump taken before)
        self.signal_running(signal.SIGUSR1, ranks)
        io.capturing_stacks = True
        try:
            self.wait(STACK_DUMP_WAIT, force_show=True)
        finally:
            io.capturing_stacks = False
        return {r.rank: r.stack_text for r in ranks}

    def wait(self, seconds: float, force_show: bool, until: Callable[[], bool] | None = None) -> None:
        """Read output and exits for up to ``seconds``, or until all is quiet (``force_show``),
        or until ``until()`` holds (the events of a stop)."""
        deadline = time.monotonic() + seconds
        quiet_after_output = 0.2
        attempt = self.attempt
        while attempt.group is not None and any(r.running for r in attempt.ranks):
            if until is not None and until():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            events = attempt.select(min(left, quiet_after_output) if force_show else left)
            if not events and force_show:
                return
            attempt.handle(events, force_show)


class Attempt:
    """One start of the whole group: start -> supervise -> collect -> close."""

    def __init__(
        self,
        plan: LaunchPlan,
        job: bootstrap.Job,
        shipped: tuple[bytes, list[int]] | None,
        attempt: int,
        on_message: Callable[[FrontEndMessage], None] | None = None,
        session: bool = False,
        session_server: forkserver_client.ForkServer | None = None,
    ):
        self.plan, self.job, self.shipped, self.attempt = plan, job, shipped, attempt
        self.on_message = on_message
        self.duplex = session  # a session's: each message pipe is a socket pair, for commands too
        self.session_server = session_server  # a spawn session's own fork server; None: the shared one
        self.ranks: list[Rank] = []
        self.io: RankIO | None = None
        self.group: WorkerGroup | None = None
        self.failures: list[WorkerFailure] = []
        self.result_fd: int | None = None
        self.rendezvous_dir: str | None = None
        self.multiprocessing_dir: str | None = None  # DataLoader workers' sockets; removed at close
        self.stopper = Stopper(self)
        self.hang = HangWatch(
            None if session else plan.hang_after,  # a session watches its own cells (see _session/kernel/workers)
            lambda: {r.rank: cpu_seconds(r.pid) for r in self.ranks if r.pid is not None and r.running},
        )
        self.oom_kills: int | None = None
        """The OOM kills the kernel had counted in this cgroup by the last death seen (or the start)."""

    def run(self) -> Outcome:
        try:
            self.start()
            self._supervise()
            return outcome_of(self.plan, self.ranks, self.failures, self.result_fd)
        except KeyboardInterrupt:
            self.stopper.interrupt()
            raise LaunchInterrupted(partial_state(self.ranks, self.result_fd)) from None
        finally:
            try:
                self.close()
            finally:
                self.close()  # a no-op, unless a press landed on the line above
                keep_imports(self.ranks)

    # ------------------------------------------------------------------------- start

    def close(self) -> None:
        """Kill and reap every rank, release every resource, presses held; it can run again, and
        callers do, in a ``finally`` (see run): a press may land on the line that calls it."""
        finish(self._close)

    def start(self) -> None:
        """Start every rank (a session's runs until told to stop); ``close`` undoes it."""
        try:
            self._start_now()
        except OSError as err:  # EMFILE, EAGAIN, ENOMEM: one clear error (close cleans up)
            raise start_error(err, "the launch could not start") from err

    def _start_now(self) -> None:
        # A stop press may land between any two lines: each resource is made and recorded here
        # (for _close) with presses held, so none is made and then lost.
        self.oom_kills = oom.oom_kills()
        with interrupts_deferred():
            ranks = make_ranks(self.plan.nprocs, self.plan.node_rank, self.plan.output, self.duplex)
            try:
                self.io = RankIO(ranks, self.on_message, self._record_error)  # owns the pipes
            except OSError:  # EMFILE for the selector itself
                close_pipes(ranks)
                raise
            self.ranks = ranks
        try:
            with interrupts_deferred():
                if self.plan.node_rank == 0:  # global rank 0 runs here
                    self.result_fd = result_file.result_fd()
                self.rendezvous_dir = rendezvous_folder(self.plan)  # made and recorded: one step
                self.multiprocessing_dir = tempfile.mkdtemp(prefix="pymp-enot_nb-")
            for folder in (self.rendezvous_dir, self.multiprocessing_dir):  # then the watchdog told
                if folder is not None:  # (it may fail to start: the folders are recorded)
                    watchdog_client.folder(folder)
            self.group = make_group(self)
            log.debug("attempt %d: starting %d rank(s) by %s", self.attempt, self.plan.nprocs, self.plan.start_method)
            for rank, pid in self.group.start().items():
                self._rank(rank).pid = pid
            log.debug("attempt %d: started, pids %s", self.attempt, {r.rank: r.pid for r in self.ranks})
        finally:
            if self.group is not None:
                self.group.settle()  # no fork in flight may inherit a descriptor closed here
            finish(self.io.close_write_ends)  # our copies: EOF comes when the workers exit
        for source in self.group.sources():
            self.io.selector.register(source, selectors.EVENT_READ, None)

    def _rank(self, rank: int) -> Rank:
        return next(r for r in self.ranks if r.rank == rank)

    # ------------------------------------------------------------------------- supervise

    def _supervise(self) -> None:
        self.hang.start()
        while any(r.exitcode is None for r in self.ranks):
            if self.failures and not self.stopper.stopping:
                self.stopper.after_failure()
                continue
            self.handle(self.select(self.hang.due()))
            if not self.failures and self.hang.found():
                self.stopper.show_hang()

    def select(self, timeout: float | None) -> list:
        """Wait for events; exits the group already holds are handled first, without waiting."""
        assert self.group is not None and self.io is not None
        if self.group.pending():
            self._on_exits(self.group.exits(None))
            timeout = 0
        # Exits the group recorded whose report a stop press cut off on the way here.
        self._on_exits(
            [
                (r.rank, self.group.exited[r.rank])
                for r in self.ranks
                if r.exitcode is None and r.rank in self.group.exited
            ]
        )
        return self.io.selector.select(PRESS_CHECK if timeout is None else min(timeout, PRESS_CHECK))

    def handle(self, events: list, force_show: bool = False) -> None:
        assert self.group is not None and self.io is not None
        for key, _ in events:
            if key.data is None:
                pidfd = key.fd if isinstance(key.fileobj, int) else None
                if pidfd is not None:  # fires once; the group closes it
                    self.io.selector.unregister(pidfd)
                self._on_exits(self.group.exits(pidfd))
            elif key.fd in self.io.selector.get_map():  # not ended by an exit handled just before
                r, name = key.data
                self.io.read(r, name, force_show=force_show and name == "err")

    def _on_exits(self, ended: list[tuple[int, int]]) -> None:
        assert self.io is not None
        for rank, exitcode in ended:
            r = self._rank(rank)
            r.exitcode = exitcode
            # Not ours: a SIGTERM we sent after a peer failed does not make the SIGKILL ours.
            if exitcode == -signal.SIGKILL and signal.SIGKILL not in r.stop_signals:
                counted = oom.oom_kills()
                r.signal_cause, self.oom_kills = sigkill_cause(self.oom_kills, counted), counted
            self.io.drain(r)
            if r.outcome is not None:
                continue  # finished (a crash in teardown does not matter), or already recorded
            if exitcode != 0 and r.stopped_by_us(exitcode):
                continue  # stopped by us after another rank failed, or interrupted
            self.failures.append(
                WorkerFailure.died(r.rank, exitcode, self.attempt, r.sinks["err"].tail(), r.signal_cause)
            )

    def _record_error(self, r: Rank, info: ErrorReport) -> None:
        info = info._replace(traceback=as_in_the_notebook(info.traceback))
        self.failures.append(WorkerFailure.raised(r.rank, info, self.attempt, r.sinks["err"].tail()))

    # ------------------------------------------------------------------------- collect, close

    def _close(self) -> None:
        """Everything the attempt holds, released: each once, however often this runs (see
        run), and all of them even if one fails (the first error is raised after)."""
        released, errors = release_each(
            self,
            group=lambda group: group.close(),  # killed and reaped
            io=lambda io: io.close(),
            result_fd=os.close,  # a loaded result keeps its pages mapped
            rendezvous_dir=remove_folder,
            multiprocessing_dir=remove_folder,
        )
        if released:
            log.debug("attempt %d: closed, exit codes %s", self.attempt, {r.rank: r.exitcode for r in self.ranks})
        if errors:
            raise errors[0]


def keep_imports(ranks: list[Rank]) -> None:
    """What the master imported, whether the cell failed or not: the fork server imports it now;
    this process once the caller is done with the launch (preload.start_pending: loading the
    result imports too, and two threads importing at once can deadlock)."""
    modules = [m for r in ranks if r.rank == 0 for m in r.imported]
    if modules:
        preload.PRELOADER.add_pending(modules)
        forkserver_client.preload(modules)


def release_each(holder: object, **releases: Callable[[Any], object]) -> tuple[bool, list[Exception]]:
    """Release each attribute of ``holder`` that is not None with its function, after setting it
    to None (so a second run releases nothing twice); every one is tried. Returns whether
    anything was held, and the errors."""
    released, errors = False, []
    for name, release in releases.items():
        held = getattr(holder, name)
        if held is not None:
            setattr(holder, name, None)
            released = True
            try:
                release(held)
            except Exception as err:  # noqa: BLE001 - returned, after the others were released
                errors.append(err)
    return released, errors


def outcome_of(plan: LaunchPlan, ranks: list[Rank], failures: list[WorkerFailure], result_fd: int | None) -> Outcome:
    """The attempt's outcome once every rank has ended: the failures, root cause first, or rank
    0's result (from the result memfd or its message)."""
    if failures:
        failures.sort(key=WorkerFailure.caused_by_a_lost_peer)
        reconnectable = plan.nnodes == 1 and all(f.connecting for f in failures) and not any(r.connected for r in ranks)
        return Outcome(
            ok=False, failures=failures, partial=partial_state(ranks, result_fd), reconnectable=reconnectable
        )
    master = next((r for r in ranks if r.rank == 0), None)
    if master is None:
        return Outcome(ok=True, result=None)  # not node 0: rank 0 runs elsewhere
    assert master.payload is not None  # no failure: rank 0 sent its Result
    return Outcome(ok=True, result=load_payload(result_fd, master.payload))


def rendezvous_folder(plan: LaunchPlan) -> str | None:
    """The folder (mode 0700) one node's ranks meet through, or None if they meet over TCP."""
    if RENDEZVOUS == "file" and plan.nnodes == 1 and plan.master_port is None:
        return tempfile.mkdtemp(prefix="enot_nb-rendezvous-")
    return None


def partial_state(ranks: list[Rank], result_fd: int | None) -> Any:
    """Rank 0's state at an interrupt or failure, loaded; None if it sent none."""
    master = next((r for r in ranks if r.rank == 0), None)
    if master is None:
        return None
    # A master that finished (it caught the interrupt, or was done first) sent all it had.
    payload = master.payload if isinstance(master.outcome, Result) else master.partial
    if payload is None:
        return None
    try:
        return load_payload(result_fd, payload)
    except LaunchError as err:
        print(f"enot_nb: {err}", file=sys.stderr)
        return None


def remove_folder(folder: str) -> None:
    """A folder of the launch's (the rendezvous, the multiprocessing sockets), removed; the
    watchdog need not remove it any more."""
    shutil.rmtree(folder, ignore_errors=True)
    watchdog_client.unfolder(folder)


def make_group(started: Attempt) -> WorkerGroup:
    """Describe each rank of an attempt being started (environment, descriptors, its folders)
    and make its group."""
    plan, job, shipped, ranks, attempt = started.plan, started.job, started.shipped, started.ranks, started.attempt
    result_fd, folder = started.result_fd, started.rendezvous_dir
    init_kwargs = dict(plan.init_kwargs)
    address = plan.master_addr if plan.nnodes > 1 else _rendezvous.loopback_for(plan.master_addr)
    if folder is not None:
        init_kwargs["init_method"] = f"file://{folder}/store"
        port = _rendezvous.free_port(address)  # for code that reads MASTER_PORT
    else:
        port = plan.master_port or _rendezvous.free_port(address)
        init_kwargs["init_method"] = _rendezvous.url(address, port)
    fork = plan.start_method == "fork"
    front_end, parent = relay.in_ipython(), relay.kernel_parent()
    output_setup = None if fork else streams.capture()  # one pickle for every rank
    specs = [
        bootstrap.WorkerSpec(
            rank=r.rank,
            env=rank_environment(plan, r.local_rank, address, port, attempt),
            cwd=os.getcwd(),
            sys_path=[p for p in sys.path if isinstance(p, str)],
            threads=plan.threads,
            init_kwargs=init_kwargs,
            parent_pid=os.getpid(),
            stdout_fd=r.pipes["out"][1],
            stderr_fd=r.pipes["err"][1],
            message_fd=r.pipes["msg"][1],
            close_fds=_not_for(r, ranks) if fork else [],
            result_fd=result_fd,
            front_end=front_end,
            kernel_parent=parent,
            output_setup=output_setup,
            multiprocessing_folder=started.multiprocessing_dir,
        )
        for r in ranks
    ]
    if fork:
        return ForkedGroup([(s.rank, functools.partial(bootstrap.run, s, lambda: job)) for s in specs])
    job_bytes, shared = shipped or (b"", [])
    result = [result_fd] if result_fd is not None else []
    layout = LaunchFds(ranks=len(specs), results=len(result), shared=len(shared))
    fds = [r.pipes[name][1] for r in ranks for name in ("out", "err", "msg")] + result + shared
    return ServerGroup(specs, fds, job_bytes, layout, started.session_server)


def _not_for(r: Rank, ranks: list[Rank]) -> list[int]:
    """What a forked worker inherits but must close: every read end, the other ranks' write
    ends (or EOF would never come), the watchdog's pipe."""
    fds = [fd for o in ranks for pair in o.pipes.values() for fd in (pair[:1] if o is r else pair)]
    return fds + [watchdog_client.command_fd()]


def load_payload(result_fd: int | None, payload: Payload) -> Any:
    """Rank 0's result (or partial state), from the result memfd or the message itself."""
    try:
        match payload:
            case InMemfd(size):
                assert result_fd is not None  # the worker wrote into it
                return result_file.read_result(result_fd, size)
            case Inline(data, buffers):
                return pickle.loads(data, buffers=buffers)
            case _:
                assert_never(payload)
    except Exception as err:
        raise LaunchError(
            f"rank 0's result could not be loaded in this process "
            f"({type(err).__name__}: {err}); return plain data, tensors or "
            "state dicts"
        ) from err


# Threads that only move data for the user's code (multiprocessing queues' feeders, DataLoader's
# pin-memory thread, a resource sharer, a thread pool's idle workers): left out of a stack
# report, with one line counting them.
_HELPER_THREAD_FILES = (
    "/multiprocessing/queues.py",
    "/multiprocessing/resource_sharer.py",
    "/multiprocessing/connection.py",
    "/torch/utils/data/_utils/pin_memory.py",
    "/concurrent/futures/thread.py",
    "/queue.py",
)


LIBRARY_FRAMES_SHOWN = 3
"""Library frames a stop report shows per thread: the innermost ones, above the user's own
(where the rank is blocked: a backward, a collective); the whole dump goes to the debug log."""


def where_ranks_are(dumps: dict[int, str]) -> str:
    """The ranks' dumps for the notebook: each rank's stack (see stack_report), then their
    collectives side by side (see collective_table), where they issued any."""
    texts, snapshots = collective_table.split_dumps(dumps)
    shown = [stack_report(rank, text) for rank, text in sorted(texts.items())]
    collectives = collective_table.table(snapshots)
    return "\n".join(shown + ([collectives] if collectives else []))


def collectives_or_stacks(dumps: dict[int, str], known: dict[int, Snapshot] | None = None) -> str:
    """The ranks' collectives side by side (``known``: those sent with a timeout's error, and
    the ``dumps``'), or their stacks where no rank issued a collective."""
    texts, snapshots = collective_table.split_dumps(dumps)
    return collective_table.table({**(known or {}), **snapshots}) or "\n".join(
        stack_report(rank, text) for rank, text in sorted(texts.items())
    )


def stack_report(rank: int, text: str) -> str:
    """A rank's faulthandler dump, labelled with the rank: the thread running the cell first,
    without enot_nb's own frames, idle threads or helper threads, and with the user's own frames
    (notebook cells, their scripts) and only the innermost few library frames (what the user
    needs is where their code is). ``ENOT_NB_DEBUG=1`` logs the whole dump."""
    from enot_nb._worker.cell import CELL_FILENAME  # here, not at the top: `import enot_nb` needs no cell

    log.debug("rank %d's whole stack dump:\n%s", rank, text)

    threads: list[list[str]] = []
    other = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif line.startswith('  File "'):
            path = line.split('"')[1]
            if not threads:
                threads.append([])
            if not path.startswith(bootstrap.PACKAGE_DIR) and not path.endswith(("/threading.py", "/selectors.py")):
                threads[-1].append(line)
        elif line.strip():
            other.append(line)
    shown = [thread for thread in threads if thread and not _is_helper_thread(thread)]
    helpers = sum(1 for thread in threads if thread and _is_helper_thread(thread))
    shown.sort(key=lambda thread: not any(f'"{CELL_FILENAME}"' in line for line in thread))  # stable
    trimmed = [_users_frames_first(thread) for thread in shown]
    frames = [line for thread, _ in trimmed for line in thread]
    left_out = sum(count for _, count in trimmed)
    label = f"[rank {rank}]"
    lines = [f"{label} where it was (most recent call first):"]
    lines += [f"{label} {line}" for line in frames] or [f"{label}   (no Python frame: in native code)"]
    if left_out:
        lines.append(f"{label}   ({left_out} library frame(s) left out; ENOT_NB_DEBUG=1 logs the whole dump)")
    if helpers:
        lines.append(f"{label}   ({helpers} helper thread(s) left out: queue feeders, DataLoader's pin memory)")
    return "\n".join(other + lines)


def _users_frames_first(frames: list[str]) -> tuple[list[str], int]:
    """A thread's frames (most recent first) with every one of the user's own and the innermost
    LIBRARY_FRAMES_SHOWN library frames above them; and how many library frames were left out."""
    kept, left_out, library_shown, reached_user = [], 0, 0, False
    for line in frames:
        if _users(line.split('"')[1]):
            reached_user = True
            kept.append(line)
        elif not reached_user and library_shown < LIBRARY_FRAMES_SHOWN:
            library_shown += 1
            kept.append(line)
        else:
            left_out += 1
    return kept, left_out


_LIBRARY_ROOTS = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})


def _users(path: str) -> bool:
    """A frame of the user's own code: a notebook cell, a script of theirs; not the standard
    library's or an installed package's."""
    if path.startswith("<"):
        return not path.startswith("<frozen")  # the cell, "<stdin>", "<string>"
    return "/site-packages/" not in path and "/dist-packages/" not in path and not path.startswith(_LIBRARY_ROOTS)


def _is_helper_thread(frames: list[str]) -> bool:
    return all(line.split('"')[1].endswith(_HELPER_THREAD_FILES) for line in frames)
