"""A persistent session: N supervised torchrun workers that live across cells, the notebook
mirroring the master (the magics' use of it, and an example: enot_nb/sessions.py).

The workers are a ``SessionWorkers`` (_session/kernel/workers: start, commands, failures); what
the ranks hold of the notebook and what changed since is a ``Mirror`` (_session/mirror/mirror); the
rank's side is _session/worker/loop.
"""

from __future__ import annotations

import atexit
import bdb
import dataclasses
import datetime
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from enot_nb._defaults import DEFAULT_TIMEOUT, SESSION_HANG_AFTER
from enot_nb._launch import relay
from enot_nb._launch.bring_back import CellInterrupted
from enot_nb._launch.options import EngineOptions, LaunchOptions, as_hang_after
from enot_nb._launch.plan import LaunchPlan, plan_launch
from enot_nb._log import unwarned
from enot_nb._session.kernel.flow import MIRRORS, CellRun, NamespaceFlow, PreparedTask
from enot_nb._session.kernel.status import RankStatus, SessionStatus, devices, status_of
from enot_nb._session.kernel.workers import CommandOutcome, SessionWorkers
from enot_nb._session.tasks import CheckTask, DebugTask
from enot_nb._state.kinds import held_still
from enot_nb._worker import cell as _cell
from enot_nb._worker.replica_check import ReplicaReport
from enot_nb.errors import LaunchConfigError, LaunchError, StaleWrapperError, WorkerFailedError

__all__ = ["CellRun", "RankStatus", "Session", "SessionStatus", "session"]


class DebuggerQuit(bdb.BdbQuit):
    """The user quit the debugger on a rank (``q``): the cell ended there, as a local cell's
    ``q`` ends it (BdbQuit); the session stays."""


_live: list[Session] = []


def session() -> Session | None:
    """The live session of this process.

    Returns:
        The Session started here (``%enot_session start`` or ``Session(...)``), or None.

    Example:
        ```python
        live = enot_nb.session()
        if live is not None:
            print(live.status())
        ```
    """
    return _live[0] if _live else None


class Session:
    """N workers that live across cells, the notebook mirroring the master.

    Args:
        nprocs: processes; None means one per visible GPU (as for ``notebook_launcher``, whose
            options these are: one definition, LaunchOptions).
        backend: "nccl" or "gloo"; None picks nccl when every rank has its own GPU.
        seed: seeds every rank (init_torch).
        cuda_optimize_for_speed: init_torch's flag.
        cuda_reproducible: init_torch's flag.
        start_method: "fork", "spawn", or None (fork unless CUDA is initialized here).
        timeout: the process group's timeout.
        hang_after: when no rank has used CPU time for this many seconds during a cell, the
            notebook shows each rank's last collective and where it waits (the cell goes on);
            None or 0: never. A cell's ``--hang-after`` overrides it.
        mirror: "all" (the notebook mirrors the master; its changes reach every rank before
            the next task) or "none" (nothing flows unless asked: pull, push).
        namespace: what code run here sees and gets back (default: the notebook's; outside
            IPython, a dict of its own).
        output: whose output ``run`` shows by default ("master", "all", "none").
        quiet: no line when the workers start.
        engine: "local" (processes of this machine) or "ray" (one Ray actor per rank on a Ray
            cluster; nprocs is then required; see docs/guide/ray.md).
        address: the Ray cluster ("auto", the head's "HOST:PORT"; None: Ray's default).
        gpus_per_rank: GPUs Ray gives each rank (engine="ray").
        placement: "pack" or "spread": how Ray places the ranks on its nodes (engine="ray").

    Raises:
        LaunchConfigError: a bad option, before any process starts.
        LaunchError: a session already runs in this process.
        WorkerFailedError: the workers could not start.

    Example:
        ```python
        with enot_nb.Session(nprocs=2, backend="gloo") as s:
            s.push(k=21)
            s.run("k2 = k * 2")
            print(s.pull("k2"))  # {'k2': 42}
        ```
    """

    _enot_nb_stays_in_the_kernel = True  # its processes are this kernel's: never sent to a rank (registry)

    def __init__(
        self,
        nprocs: int | None = None,
        *,
        backend: str | None = None,
        seed: int | None = None,
        cuda_optimize_for_speed: bool = False,
        cuda_reproducible: bool = False,
        start_method: str | None = None,
        timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
        hang_after: float | None = SESSION_HANG_AFTER,
        mirror: str = "all",
        namespace: dict[str, Any] | None = None,
        output: str = "master",
        quiet: bool = False,
        engine: str = "local",
        address: str | None = None,
        gpus_per_rank: int = 0,
        placement: str = "pack",
    ) -> None:
        if mirror not in MIRRORS:
            raise LaunchConfigError(f"mirror={mirror!r} must be 'all' or 'none'", parameter="mirror")
        given = locals()  # the launch options, by their one definition's names
        self.options = LaunchOptions(**{name: given[name] for name in LaunchOptions.names() if name in given})
        self.engine = EngineOptions(**{name: given[name] for name in EngineOptions.names()})
        self.plan = plan_session(self.options, self.engine)
        self.mirror_mode = mirror
        self.output = output
        self.namespace = namespace if namespace is not None else _notebook_namespace()
        self.flow = NamespaceFlow(self.namespace, mirror)
        self.workers: SessionWorkers | None = None
        self.last: CommandOutcome | None = None  # the last task's end (its sizes: what moved)
        self.failed_rank: int | None = None  # the rank whose error the last failed task raised (debug)
        self.failed_task: int | None = None  # that task's number
        if _live:
            raise LaunchError(
                "a session is already running in this process; stop it first (`%enot_session stop` "
                "or session.close()), or restart it with other options (`%enot_session restart ...`)"
            )
        self._start(quiet)

    def _start(self, quiet: bool = False) -> None:
        self.workers = start_workers(self.plan, None if quiet else self.mirror_mode, self.engine)
        if self not in _live:
            _live.append(self)
            atexit.register(self.close)

    def close(self) -> None:
        """Stop every worker (and their children); the notebook keeps what it holds.

        Example:
            ```python
            session.close()  # or leave the ``with Session(...)`` block
            ```
        """
        workers, self.workers = self.workers, None
        if self in _live:
            _live.remove(self)
            atexit.unregister(self.close)
        try:
            if workers is not None:
                workers.close()
        finally:
            if self.engine.engine == "ray":
                _end_ray_connection()
        self.flow.mirror.reset()  # its shadow fork too
        self.flow.close()

    def restart(self, why: str | None = None) -> None:
        """New workers, given what the old ones held of the notebook's state (by value; what lived
        on the ranks' GPUs put back there); one line says what was restored, from an older copy,
        and what is gone.

        Args:
            why: said in that line ("asked for", "rank 1 died (SIGKILL)").

        Raises:
            LaunchError: the session is closed.

        Example:
            ```python
            session.restart("asked for")
            ```
        """
        if self.workers is None and self not in _live:
            raise LaunchError("this session is closed; start a new one (`%enot_session start -n N`)")
        mirror = self.flow.mirror
        lost = sorted(mirror.on_workers) if self.flow.mirrored else ["everything (--mirror none)"]
        older = sorted(mirror.stale) if self.flow.mirrored else []
        held = [n for n in mirror.record.synced if n in self.namespace] if self.flow.mirrored else []
        on_device = [n for n in held if n in mirror.on_device]
        if self.workers is not None:
            self.workers.close()
            self.workers = None
        mirror.reset()
        self._start(quiet=True)
        restored = self._restore(held, on_device) if held else []
        print(restart_line(self.plan.nprocs, self.flow.mirrored, why, lost, older, restored, on_device))

    def _restore(self, names: list[str], on_device: list[str]) -> list[str]:
        """The variables the old workers held, pushed to the new ones (``on_device``: then moved
        onto each rank's GPU, where they lived); those restored."""
        assert self.workers is not None
        prepared = self.flow.push_values({n: self.namespace[n] for n in names}, to_device=on_device)
        workers = self.workers
        workers.run_task(self.flow.pickle(prepared), "none", lambda done: self.flow.after_push(prepared, done))
        outcome = workers.last  # refused: the next cell pushes what it uses
        assert outcome is not None
        return [] if outcome.failures or outcome.restart is not None else names

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _ready(self) -> SessionWorkers:
        if self.workers is None:
            raise LaunchError("this session is closed; start a new one (`%enot_session start -n N`)")
        dead = self.workers.deaths()
        if dead is not None:
            self.restart(dead)
        assert self.workers is not None
        return self.workers

    def status(self) -> SessionStatus:
        """The session's table.

        Returns:
            A row per rank: pid, device, state (a rank that died since its last task shows as
            dead), host memory, GPU memory, cells run, uptime; HTML in a notebook.

        Example:
            ```python
            session.status()
            ```
        """
        return status_of(self.workers, self.plan, self.mirror_mode)

    def run(
        self,
        code: str,
        *,
        output: str | None = None,
        returns: list[str] | None = None,
        no_return: bool = False,
        sync: list[str] | None = None,
    ) -> Any:
        """Run ``code`` on every rank, in each rank's namespace; the notebook mirrors the master
        (--mirror all).

        Args:
            code: a cell's Python code.
            output: whose output to show ("master", "all", "none"); default: the session's.
            returns: bring back only these names (in-place changes always come back).
            no_return: bring nothing back.
            sync: models to broadcast from the master first (default: none).

        Returns:
            The value of the cell's last expression, as a cell's Out.

        Raises:
            WorkerFailedError: a rank raised or died (the notebook keeps the master's state at
                the failure; the ranks stay, or the session restarts, saying so).
            SyntaxError: the code does not parse (nothing is sent).

        Example:
            ```python
            session.run("x = dist.get_rank()\\nx")  # 0, the master's
            ```
        """
        return self.run_cell(code, CellRun(output or self.output, returns, no_return, sync))

    def run_cell(self, code: str, run: CellRun) -> Any:
        """A cell with the magic's per-cell options (see ``run``)."""
        compile(code, _cell.CELL_FILENAME, "exec")  # a syntax error before anything is sent
        self._ready().cells += 1
        return self._task(lambda: self.flow.cell(code, run), run.output, self.flow.after_cell, run.hang_after)

    def launch(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on every rank, with the rank's session namespace as its
        globals (``fn`` travels by value, with what it reaches).

        Args:
            fn: the function; what it changes of the notebook's objects comes back, as a cell's.
            *args: its positional arguments.
            **kwargs: its keyword arguments.

        Returns:
            Rank 0's result, as ``notebook_launcher``'s.

        Raises:
            WorkerFailedError: a rank raised or died.

        Example:
            ```python
            session.launch(lambda: __import__("os").environ["RANK"])  # "0"
            ```
        """
        return self._task(lambda: self.flow.call(fn, args, kwargs), self.output, self.flow.after_call)

    def pull(self, *names: str, overwrite: bool = False, keep_notebook: bool = False) -> dict[str, Any]:
        """The master's values of ``names``, bound in the namespace too (in place where an object
        of the same type sits at the same path; a module sharded by FSDP comes whole).

        A name is stale when the master changed it and its value did not come back
        (``--no-return``, ``--return``); if a plain cell changed it here too, the two sides
        conflict and the pull asks which wins.

        Args:
            *names: the variables.
            overwrite: for such a conflict, rank 0's value wins: the notebook's change is dropped.
            keep_notebook: for such a conflict, the notebook's value wins: it is sent to every
                rank (in place, as a plain cell's change; a variable deleted here is deleted
                there) and rank 0's is dropped; nothing is pulled.

        Returns:
            Each name to its value (the notebook's, under ``keep_notebook``; a deleted one left out).

        Raises:
            NotHeldError: the master holds no variable of one of the names (a NameError).
            WorkerFailedError: a rank failed.
            StaleError: a stale name was changed here too, and neither option says which
                side wins (a LaunchError).
            LaunchConfigError: both options given.

        Example:
            ```python
            session.pull("model")["model"]
            session.pull("log", keep_notebook=True)  # the notebook's log goes to the ranks
            ```
        """
        if overwrite and keep_notebook:
            raise LaunchConfigError("pull: overwrite and keep_notebook exclude each other; say which side wins")
        wanted = list(names)
        if keep_notebook:
            self._task(
                lambda: self.flow.keep_notebook(wanted),
                self.output,
                lambda made, done: self.flow.after_keep_notebook(made, done, wanted),
            )
            return {n: self.namespace[n] for n in wanted if n in self.namespace}
        return self._task(
            lambda: self.flow.pull(wanted, overwrite),
            "master",
            lambda made, done: self.flow.after_pull(made, done, wanted),
        )

    def push(self, **values: Any) -> None:
        """Send ``values`` to every rank, bound under their names (under --mirror all, in the
        notebook too: it mirrors the master). A pushed value replaces what a rank held there.

        Args:
            **values: the variables, by name.

        Raises:
            WorkerFailedError: a rank could not take them.

        Example:
            ```python
            session.push(lr=0.01)
            ```
        """
        self._task(lambda: self.flow.push_values(values), self.output, self.flow.after_push)

    def check(self) -> ReplicaReport:
        """Do the ranks' replicas still agree? Every tensor replicated by construction (each DDP
        wrapper's parameters and buffers, the state of an optimizer over them) is compared
        across the ranks, each rank's against the master's; sharded state (ZeRO, FSDP, DTensor
        shards) is named, never compared. Nothing is changed or pushed.

        Returns:
            The report: each tensor and rank that differs, by its max abs difference
            (``differences``; ``agree`` when none does); shown as a short text.

        Raises:
            WorkerFailedError: a rank failed or died during the check.

        Example:
            ```python
            report = session.check()
            assert report.agree, report
            ```
        """
        return self._task(lambda: PreparedTask(task=CheckTask()), self.output, lambda prepared, done: done.result)

    def debug(self, rank: int | None = None) -> None:
        """The debugger on a failed cell's traceback, on the rank where it failed, in the
        notebook (a post-mortem, as ``%debug`` after a local cell): its prompt names the rank;
        ``q`` or ``c`` ends it, and the session keeps its state.

        Args:
            rank: the rank; default: the one whose error the last failed cell raised.

        Raises:
            LaunchError: no cell has failed on a rank of this session's workers.
            WorkerFailedError: the rank holds no failed cell (``LookupError``), or its front end has
                no stdin (``StdinNotImplementedError``).

        Example:
            ```python
            session.debug()  # after a cell that raised on rank 1
            ```
        """
        ranks = self.plan.world_size
        task = self.failed_task if rank is None or rank == self.failed_rank else None
        if rank is None:
            rank = self.failed_rank
        if rank is None:
            raise LaunchError("no cell has failed on this session's ranks: %enot_debug follows a failed cell")
        if not 0 <= rank < ranks:
            raise LaunchError(f"rank {rank} is not one of this session's ranks (0 to {ranks - 1})")
        try:
            self._task(
                lambda: PreparedTask(task=DebugTask(rank, task)),
                "master",
                lambda prepared, done: None,
                0,
                peers_wait=False,
            )
        except DebuggerQuit:
            pass  # q ends a post-mortem as c does

    def _task(
        self,
        make: Callable[[], PreparedTask],
        output: str,
        apply: Callable[[PreparedTask, CommandOutcome], Any],
        hang_after: float | None = None,
        peers_wait: bool = True,
    ) -> Any:
        """A task made (after a restart, if ranks had died), sent, its outcome applied by
        ``apply`` (see SessionWorkers.run_task); then new workers where the old ones must be
        replaced (from the notebook, which now holds what the master reached); its failure
        raised. ``hang_after``: the cell's (0: never), None: the session's; ``peers_wait``: see
        SessionWorkers.run_task."""
        workers = self._ready()
        with held_still() as still, unwarned():  # until the task is sent, nothing changes the notebook's objects
            prepared = make()
            pickled = self.flow.pickle(prepared)
        prepared.still = still

        def applied(done: CommandOutcome) -> Any:
            with unwarned():
                return apply(prepared, done)

        try:
            watch = self.options.hang_after if hang_after is None else hang_after
            value = workers.run_task(pickled, output, applied, as_hang_after(watch), peers_wait)
        finally:
            self.last = workers.last
            if self.last is not None and self.last.restart is not None:
                self.restart(self.last.restart)
        assert self.last is not None
        failed = [f.rank for f in self.last.failures if not f.released and f.error_type != "BdbQuit"]
        if failed and not isinstance(prepared.task, DebugTask):
            self.failed_rank, self.failed_task = failed[0], workers.tasks
        _raise_failure(self.last)
        return value


def _raise_failure(outcome: CommandOutcome) -> None:
    if outcome.interrupted:
        raise CellInterrupted()
    if outcome.failures:
        quit_on = [f.rank for f in outcome.failures if f.error_type == "BdbQuit"]
        others = [f for f in outcome.failures if f.error_type != "BdbQuit" and not f.released]
        if quit_on and not others:  # the user quit the debugger: no error (IPython shows BdbQuit as nothing)
            said = (
                f"the debugger was quit on rank {quit_on[0]}: the cell stopped there, and the ranks waiting "
                "for it were released; the session keeps its state"
            )
            print(f"enot_nb: {said}", file=sys.stderr, flush=True)
            raise DebuggerQuit(said)
        stale = {f.message for f in outcome.failures if f.error_type == StaleWrapperError.__name__}
        if len(stale) == 1 and all(f.message in stale or f.released for f in outcome.failures):
            raise StaleWrapperError(stale.pop())  # every rank raised it alike: once, in our words
        # A debugger closed because of another rank's failure is no failure of its own.
        raise WorkerFailedError([f for f in outcome.failures if f.error_type != "BdbQuit"] or outcome.failures)


def _notebook_namespace() -> dict[str, Any]:
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    shell = get_ipython()
    return shell.user_ns if shell is not None else {}


def plan_session(options: LaunchOptions, engine: EngineOptions) -> LaunchPlan:
    """The session's plan: the launch's; on a Ray cluster with nprocs given, workers spawned
    (from each node's own fork server) and the backend the ranks' (nccl where each has a GPU),
    not this machine's (whose GPUs do not count there)."""
    if engine.engine == "local":
        return plan_launch(options)
    if options.nprocs is None:
        raise LaunchConfigError("engine='ray' needs nprocs=N: the ranks to place on the cluster", parameter="nprocs")
    backend = options.backend or ("nccl" if engine.gpus_per_rank else "gloo")
    plan = plan_launch(dataclasses.replace(options, backend="gloo", start_method="spawn"))
    return dataclasses.replace(plan, backend=backend, init_kwargs=dict(plan.init_kwargs, backend=backend))


def start_workers(plan: Any, mirror: str | None, engine: EngineOptions | None = None) -> SessionWorkers:
    """A session's workers, started; one line says so (unless ``mirror`` is None: quiet)."""
    started = time.monotonic()
    on_message = relay.show if relay.in_ipython() else None
    host = None
    if engine is not None and engine.engine == "ray":
        from enot_nb._launch.ray_ranks import RayRanks  # ray is imported only where it is asked for

        host = RayRanks(plan, on_message, engine.address, engine.gpus_per_rank, engine.placement)
    workers = SessionWorkers(plan, on_message, host)
    try:
        workers.start()
    except BaseException:
        try:
            workers.close()
        finally:
            if host is not None:
                _end_ray_connection()
        raise
    if mirror is not None:
        where = f"{plan.start_method}"
        if host is not None:
            nodes = {host.location(r) for r in host.ranks}
            where = f"on Ray: {len(nodes)} node(s), --placement {engine.placement if engine else 'pack'}"
        print(
            f"enot_nb: session started: {plan.nprocs} rank(s), {plan.backend}, "
            f"{', '.join(sorted(set(devices(plan))))}, {where}, --mirror {mirror}, "
            f"in {time.monotonic() - started:.2f} s",
        )
    return workers


def _end_ray_connection() -> None:
    """The connection to Ray a session made, ended once no live session is on Ray (a session's
    close, or a start that failed)."""
    if not any(s.engine.engine == "ray" for s in _live):
        from enot_nb._launch import ray_ranks  # imported already: a session started on Ray

        ray_ranks.disconnect()


def restart_line(
    nprocs: int,
    mirrored: bool,
    why: str | None,
    lost: list[str],
    older: list[str],
    restored: list[str],
    on_device: Sequence[str] = (),
) -> str:
    """What a restart restored (the notebook's state), from an older copy (the stale variables),
    and what is gone (what lived only on the workers)."""
    reason = f" ({why})" if why else ""
    if not mirrored:
        restored_line = "they hold nothing"
    elif restored:
        on_cpu = [n for n in restored if n not in on_device]
        parts = [f"restored from the notebook (on the CPU): {', '.join(on_cpu)}"] if on_cpu else []
        gpu = [n for n in restored if n in on_device]
        parts += [f"restored onto each rank's GPU, where it lived: {', '.join(gpu)}"] if gpu else []
        restored_line = "; ".join(parts)
    else:
        restored_line = "the notebook's state reaches them as the next cells use it"
    older_line = (
        f"; from the notebook's older copy (the master's newer one is lost): {', '.join(older)}" if older else ""
    )
    gone = f"; gone, as it lived only on the workers: {', '.join(lost)}" if lost else ""
    return f"enot_nb: session restarted{reason}: {nprocs} new worker(s); {restored_line}{older_line}{gone}"
