"""A session's worker: a torchrun worker that runs the tasks the notebook sends, one after another,
in a namespace of its own that lives as long as the process.

Life of a session worker (see _session/kernel/workers for the kernel's side)::

    bootstrap.run: isolation, init_torch (once), Connected -> serve():
      idle: read a command from the message socket (a stop press here is one that came late)
      RunTask  -> the task from the task file, its objects found by path (paths.registry_at):
                  the push applied in place (what the notebook changed since the last sync),
                  then the cell / the function / the pull; outcome: Result (rank 0), Done, or
                  ErrorReport (the worker stays: a failed cell is only a failed cell)
      ReportGroups -> Groups(sequence)   AbortGroups -> every group aborted   Regroup -> a new one
      Repair -> DDP wrappers rebound, replicas made equal (repair)
      StopWorker (or the kernel gone) -> leave, as a one-off worker does

Tasks are the records of _session/tasks; the group's repair is _session/worker/groups.
"""

from __future__ import annotations

import builtins
import os
import signal
import socket
import sys
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, NoReturn

from typing_extensions import assert_never

from enot_nb._log import unwarned
from enot_nb._memory.digests import before_long_lived_snapshot
from enot_nb._processes import framing
from enot_nb._processes.protocol import (
    AbortGroups,
    DeviceMemory,
    Done,
    Groups,
    InputReply,
    InputRequest,
    Proceed,
    Pushed,
    Regroup,
    Repair,
    ReportGroups,
    RunTask,
    SessionCommand,
    StopWorker,
)
from enot_nb._serialize import result_file, shm
from enot_nb._session.mirror import paths
from enot_nb._session.mirror.kept import KeptSnapshot
from enot_nb._session.tasks import (
    CallTask,
    CellTask,
    CheckTask,
    DebugTask,
    NotHeld,
    PullTask,
    RegistrySpecs,
    SyncTask,
    Task,
)
from enot_nb._session.worker import devices, groups, repair, wrappers
from enot_nb._state import apply, collect
from enot_nb._state.kinds import held_still
from enot_nb._state.registry import Registry
from enot_nb._worker import bootstrap, collectives, frontend, rank_input, replica_check, sharded
from enot_nb._worker import cell as _cell


@dataclass
class WorkerSession:
    """This worker's session, from ``serve`` on: its namespace, the task file, how it reads its
    commands, and the world group's backend and timeout (for making it again)."""

    namespace: dict[str, Any]
    task_fd: int
    rank: int
    backend: str
    timeout: Any
    sock: socket.socket
    reader: framing.MessageReader[SessionCommand]
    lost_subgroups: list[groups.Subgroup] = field(default_factory=list)
    """The subgroups the user made, recorded before an abort or a regroup destroyed them: the
    next Repair makes them again and puts them back (see repair)."""
    groups_destroyed: bool = False
    """An abort or a regroup destroyed every group since the last Repair."""
    failed: dict[int, Any] = field(default_factory=dict)
    """The tracebacks of the last FAILED_KEPT tasks that failed here, by task number
    (``%enot_debug``'s post-mortem)."""
    debugging: bool = False
    """This task is a post-mortem: its own failure (no stdin) is not one to debug."""


FAILED_KEPT = 4
"""How many failed tasks' tracebacks a rank keeps (they hold the failed cells' frames alive)."""

_SESSION: WorkerSession | None = None
"""Set by ``serve``: a process runs one session."""


def _session() -> WorkerSession:
    assert _SESSION is not None, "not a session worker"
    return _SESSION


def serve(task_fd: int | None, backend: str, timeout: Any) -> NoReturn:
    """The worker's loop (the session job's function); returns when the session closes.
    ``task_fd``: the session's task file (fork); None: it came as the shared memfd (spawn).
    ``backend``, ``timeout``: the world group's, for making it again (regroup)."""
    import torch.distributed as dist

    global _SESSION
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    _cell.make_main(namespace)  # for its whole life: a class a cell or a launched function defines
    assert bootstrap._message_fd is not None
    sock = socket.socket(fileno=os.dup(bootstrap._message_fd))
    reader: framing.MessageReader[SessionCommand] = framing.MessageReader()
    _SESSION = WorkerSession(
        namespace=namespace,
        task_fd=task_fd if task_fd is not None else shm.SHARED_FD[0],
        rank=dist.get_rank() if dist.is_initialized() else 0,
        backend=backend,
        timeout=timeout,
        sock=sock,
        reader=reader,
    )
    rank_input.connect(_ask_the_notebook)
    while True:
        try:  # a press from the end of a task to here was ignored (see _answer): it came late
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the next task's to take
            command = framing.recv_message(sock, reader)
        except KeyboardInterrupt:
            continue  # a press meant for a cell that had just ended
        except EOFError:
            bootstrap.leave(0)  # the kernel is gone (the parent-death signal would kill us anyway)
        if isinstance(command, StopWorker):
            bootstrap.leave(0)  # no outcome: the result file may hold the last task's, being read
        _answer(command)


def _ask_the_notebook(request: InputRequest) -> InputReply:
    """A line from the notebook (see rank_input): asked on the message socket, answered on it
    (a late Proceed of an earlier task is passed over)."""
    session = _session()
    bootstrap.send(request)
    while not isinstance(command := framing.recv_message(session.sock, session.reader), InputReply):
        pass
    return command


def _answer(command: SessionCommand) -> None:
    """Do one command and send its one answer. A stop press is ignored from the end of the task
    until the answer is sent (it would send a second one, see _cell.ignore_late_presses); one
    at the idle read came late too, and is passed over."""
    rank = _session().rank
    try:
        match command:
            case RunTask(size=size, specs=specs, objects=objects, storages=storages, parent=parent):
                _session().debugging = False
                frontend.follow_parent(parent)
                try:
                    result = run_task(size, specs, objects, storages, command.task if command.confirm else None)
                finally:
                    _report_device_memory()
                _cell.ignore_late_presses()
                if result is _SKIPPED:
                    bootstrap.send(Done())
                else:
                    bootstrap.send_outcome(rank, result)
                _KEPT.finish_retake()  # while the notebook applies the answer
            case Proceed() | InputReply():
                pass  # a late one (its task failed here): nothing to do
            case ReportGroups():
                bootstrap.send(Groups(groups.sequences()))
            case AbortGroups(peers=peers):  # no answer: the rank has answered its task already
                _record_subgroups(_session())
                groups.abort_groups(peers)
            case Regroup(init_method=init_method):
                session = _session()
                _record_subgroups(session)
                groups.regroup(init_method, session.backend, session.timeout)
                collectives.forget_so_far()  # the new group's numbers start again
                bootstrap.send(Done())  # never a Result: the task's result stays in the file
            case Repair():
                session = _session()
                lost, destroyed = session.lost_subgroups, session.groups_destroyed
                session.lost_subgroups, session.groups_destroyed = [], False
                line = repair.repair(session.namespace, lost, destroyed)
                if line is not None and rank == 0:
                    print(line, flush=True)
                bootstrap.send(Done())
            case StopWorker():
                pass
            case _:
                assert_never(command)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported; the worker stays
        _cell.ignore_late_presses()
        session = _session()
        if isinstance(command, RunTask) and not session.debugging:  # for a post-mortem (%enot_debug)
            session.failed[command.task] = exc.__traceback__
            for old in sorted(session.failed)[:-FAILED_KEPT]:
                del session.failed[old]
        _KEPT.drop()  # the notebook takes no outcome from this task: it may be behind what is kept
        if os.environ.get("ENOT_NB_DEBUG"):  # the whole stack, enot_nb's frames included
            traceback.print_exc()
        bootstrap.report_failure(exc)


def _record_subgroups(session: WorkerSession) -> None:
    """Before an abort or a regroup destroys every group: the user's subgroups, to be made again
    at the next Repair (the first destruction since the last repair saw them alive)."""
    if not session.groups_destroyed:
        session.lost_subgroups, session.groups_destroyed = groups.subgroups(), True


class PushRefused(RuntimeError):
    """The notebook's changes could not all be applied on this rank (before the task runs)."""


_SKIPPED = object()
"""The task ran nowhere: another rank could not apply its push."""

_KEPT = KeptSnapshot()
"""The master's snapshot from its last cell (see KeptSnapshot)."""


def run_task(size: int, specs: tuple, objects: int, storages: int, confirm: int | None = None) -> Any:
    """Load the task against this rank's objects, apply its push, run it; rank 0's result.
    ``confirm``: the task's number: say the push is applied, and run the task only if every rank
    could (a Proceed of an earlier task, interrupted before it was read, is passed over)."""
    session = _session()
    namespace = session.namespace
    with held_still(), unwarned():  # until the push is applied
        registry = paths.registry_at(namespace, list(specs), objects, storages, strict=True)
        state = result_file.read_result(session.task_fd, size, raw=True)
        task: Task = apply.load(collect.PickledState(*state), registry)  # type: ignore[assignment]
    # A push that only binds or deletes names changes no object a snapshot holds (the namespace
    # has none: the names are compared on their own); one that changes objects does.
    pushed = task.push is not None and bool(task.push.objects or task.push.storages or task.push.sharded)
    keep = isinstance(task, CellTask) and not pushed and task.mirror is not None
    if not keep:  # before anything changes: a push, another task (see KeptSnapshot)
        _KEPT.drop()
    if task.push is not None:
        with unwarned():
            problems = apply.apply_changes(namespace, registry, task.push, None)
        if problems:
            raise PushRefused("the notebook's changes could not all be applied on this rank: " + "; ".join(problems))
        _to_module_devices(registry, task.push)
        if task.push.objects:  # a layer replaced under a DDP wrapper: its next use says to build it again
            wrappers.guard_stale(namespace)
    if confirm is not None:
        bootstrap.send(Pushed())
        command = framing.recv_message(session.sock, session.reader)
        while isinstance(command, Proceed) and command.task != confirm:
            command = framing.recv_message(session.sock, session.reader)
        if not (isinstance(command, Proceed) and command.go):
            return _SKIPPED
    for load in task.push.sharded if task.push is not None else ():  # every rank, after every rank applied
        sharded.load_plain_changes(namespace[load.name], load.training, load.values)
    match task:
        case CellTask():
            return _run_cell(namespace, task, keep)
        case CallTask():
            return _call(namespace, task)
        case PullTask():
            return _pull(namespace, task)
        case SyncTask():
            devices.to_rank_device(namespace, task.to_device)
            return None
        case CheckTask():
            return replica_check.check_replicas(namespace)
        case DebugTask():
            return _post_mortem(task.rank, task.task)
        case _:
            assert_never(task)


def _post_mortem(rank: int, task: int | None) -> None:
    """The debugger on this rank's traceback of task ``task`` (None: its last failed one), if
    it is ``rank``; the traceback is kept for another look."""
    session = _session()
    if session.rank != rank:
        return None
    session.debugging = True  # a failure inside the debugger is not the user's cell's
    if not session.failed:
        raise LookupError(f"rank {rank} has no failed cell to debug: %enot_debug follows a cell that failed there")
    if task is not None and task not in session.failed:
        raise LookupError(
            f"rank {rank} no longer keeps the failure of that cell (it keeps the last {FAILED_KEPT} failed "
            f"cells'), or it did not fail there: `%enot_debug {rank}` opens its last one"
        )
    rank_input.post_mortem(session.failed[task if task is not None else max(session.failed)])
    return None


def _run_cell(namespace: dict[str, Any], task: CellTask, keep: bool) -> Any:
    """The cell; the master's snapshot of what it reaches is kept for the next cell (``keep``:
    nothing but this cell will have changed it, see KeptSnapshot)."""
    registry, scan = None, False
    with held_still():  # its registry found and its snapshot taken: a large container told plain once
        if task.mirror is not None and _session().rank == 0:
            with unwarned():
                registry = _KEPT.registry_for(namespace, task.mirror) if keep else None
                registry = registry or _mirror_registry(namespace, task.mirror)
            if registry.storages:  # the pages the cell writes are the master's own again (see shadow)
                scan = before_long_lived_snapshot(registry.storages)
        kept = _KEPT if keep and registry is not None else None
        outcome = _cell.run_cell(  # (it lets go before the cell's code runs)
            task.code, namespace, task.options, registry, scan_large=scan, kept=kept, late_presses_ignored=True
        )
    if kept is not None and task.mirror is not None:
        kept.found_by(task.mirror.packed, task.mirror.specs)
    if isinstance(outcome, _cell.CellOutcome):  # the master's: what lives on its GPU
        with unwarned():
            outcome.on_device = devices.names_on_device(namespace)
    return outcome


def _call(namespace: dict[str, Any], task: CallTask) -> Any:
    """fn on this rank; the master also returns what fn changed of the notebook's objects."""
    fn = _in_namespace(task.fn, namespace)
    if task.mirror is None or _session().rank != 0:
        return fn(*task.args, **task.kwargs)  # (a sharded module in it stays sharded: see below)
    with unwarned():
        registry = _mirror_registry(namespace, task.mirror)
        scan = before_long_lived_snapshot(registry.storages) if registry.storages else False
        tracker = _cell.Tracker(registry, namespace, (), {}, scan)
    options = _cell.CellOptions(keep_on_error=True)
    try:
        value = fn(*task.args, **task.kwargs)
        _cell.ignore_late_presses()
    except BaseException:
        with unwarned():
            tracker.send_partial(options)
        raise
    # A sharded module fn returns is the ranks' live one: it is not made whole in place, as a
    # one-off launch's is (a DTensor does not pickle, and the error says to pull it whole).
    with unwarned():
        return value, tracker.outcome(options, None, False, None, None)


def _in_namespace(fn: Any, namespace: dict[str, Any]) -> Any:
    """A function that travelled by value (the notebook's or a script's, a lambda, a nested
    function) with the rank's session namespace as its globals; a module's own function (one
    pickle names by reference) keeps its module's."""
    if not isinstance(fn, types.FunctionType):
        return fn
    if fn.__globals__ is not namespace and fn.__module__ != "__main__" and "<" not in fn.__qualname__:
        return fn
    rebound = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    rebound.__kwdefaults__, rebound.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
    return rebound


def _mirror_registry(namespace: dict[str, Any], mirror: RegistrySpecs) -> Registry:
    return paths.registry_at(namespace, mirror.specs, mirror.objects, mirror.storages, strict=False)


def _pull(namespace: dict[str, Any], task: PullTask) -> Any:
    """The master's values of ``names``: every object the notebook has at their paths as
    changed (its whole state travels, into the notebook's object), the rest by value. A module
    sharded by FSDP2 or FSDP1 comes as its full values (every rank takes part in gathering
    them; the live module stays sharded), which the notebook loads into its own module."""
    with unwarned():
        return _pulled(namespace, task)


def _pulled(namespace: dict[str, Any], task: PullTask) -> Any:
    whole = sharded.full_state_dicts(namespace, task.names)  # every rank: a collective, if any
    if _session().rank != 0:
        return None
    missing = [n for n in task.names if n not in namespace]
    if missing:  # a typo, most often: the notebook says so as a usage error, not a rank's failure
        held = [
            n
            for n, v in namespace.items()  # not the modules, nor get_ipython (a cell's runner binds it)
            if not n.startswith("_") and n != "get_ipython" and not isinstance(v, types.ModuleType)
        ]
        return NotHeld(missing, sorted(held))
    registry = _mirror_registry(namespace, task.mirror)
    not_returned: dict[str, str] = {}
    changes = collect.as_whole_changes(registry, namespace, [n for n in task.names if n not in whole], task.whole)
    sharded.left_sharded(registry, namespace, [], changes)  # their objects come as values, above
    state, _ = collect.dump(changes, registry, not_returned)
    return state, not_returned, whole


def _to_module_devices(registry: Registry, push: collect.Changes) -> None:
    """A tensor pushed into a module lands on the device of that module's parameters (the
    notebook holds CPU copies; the rank's module lives on its GPU)."""
    import torch

    for i, _ in push.objects:
        module = registry.objects[i]
        if isinstance(module, torch.nn.Module):
            devices = {p.device for p in module.parameters(recurse=False)} | {
                p.device for p in module.parameters() if p.device.type != "cpu"
            }
            off_cpu = [d for d in devices if d.type != "cpu"]
            if len(off_cpu) == 1:
                module.to(off_cpu[0])


def _report_device_memory() -> None:
    """The rank's GPU memory, for the session's table (only where this rank uses CUDA)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        mib = 1 << 20
        bootstrap.send(DeviceMemory(torch.cuda.memory_allocated() / mib, torch.cuda.memory_reserved() / mib))
