"""A session's worker: a torchrun worker that runs the tasks the notebook sends, one after another,
in a namespace of its own that lives as long as the process.

Life of a session worker (see _launch/session_workers for the kernel's side)::

    bootstrap.run: isolation, init_torch (once), Connected -> serve():
      idle: read a command from the message socket (a stop press here is one that came late)
      RunTask  -> the task from the task file, its objects found by path (paths.registry_at):
                  the push applied in place (what the notebook changed since the last sync),
                  then the cell / the function / the pull; outcome: Result (rank 0), Done, or
                  ErrorReport (the worker stays: a failed cell is only a failed cell)
      ReportGroups -> Groups(sequence)   AbortGroups -> every group aborted   Regroup -> a new one
      StopWorker (or the kernel gone) -> leave, as a one-off worker does

Tasks are records (``CellTask``, ``CallTask``, ``PullTask``, ``SyncTask``), each with the push
that comes first; the kernel pickles them against the mirror's registry (collect.StatePickler),
so an object the ranks already hold travels as its index and is found here by its path.
"""

from __future__ import annotations

import builtins
import os
import pickle
import signal
import socket
import sys
import traceback
import types
from dataclasses import dataclass, field
from typing import Any, NoReturn

from typing_extensions import assert_never

from enot_nb._processes import framing
from enot_nb._processes.protocol import (
    AbortGroups,
    DeviceMemory,
    Done,
    Groups,
    Proceed,
    Pushed,
    Regroup,
    ReportGroups,
    RunTask,
    SessionCommand,
    StopWorker,
)
from enot_nb._serialize import result_file, shm
from enot_nb._state import apply, collect, paths
from enot_nb._state.digests import before_long_lived_snapshot
from enot_nb._state.registry import Registry
from enot_nb._state.snapshot import KeptSnapshot
from enot_nb._worker import bootstrap, frontend, sharded
from enot_nb._worker import cell as _cell


@dataclass
class Mirrored:
    """The notebook's registry for a task, as specs: the master finds its own objects at the
    same indices (paths.registry_at), snapshots them, and sends what changed against them."""

    specs: list[paths.ObjectSpec]
    objects: int
    storages: int
    packed: bytes | None = field(default=None, compare=False, repr=False)
    """Its pickle, made once (the notebook sends the same specs again while a cell's reach is
    kept) and kept where it was loaded: the master knows the same specs by it (see
    KeptSnapshot.registry_for)."""

    @classmethod
    def of(cls, registry: Registry) -> Mirrored:
        """What the master needs to find its own objects at the notebook's registry indices."""
        return cls(paths.specs_of(registry), len(registry.objects), len(registry.storages))

    def __reduce__(self) -> tuple:
        # Plain data, pickled in one go by the C pickler: the task's pickler (a Python subclass
        # that looks every object up in the registry) would visit each of its thousands of parts.
        if self.packed is None:
            self.packed = pickle.dumps((self.specs, self.objects, self.storages), protocol=5)
        return _mirrored, (self.packed,)


def _mirrored(data: bytes) -> Mirrored:
    specs, objects, storages = pickle.loads(data)
    return Mirrored(specs, objects, storages, packed=data)


@dataclass
class CellTask:
    """Run a cell (the magic's options as the worker needs them)."""

    push: collect.Changes | None
    code: str
    options: _cell.CellOptions
    mirror: Mirrored | None
    """None: nothing comes back (--mirror none, --no-return)."""


@dataclass
class CallTask:
    """``Session.launch(fn, ...)``: fn with the rank's session namespace as its globals."""

    push: collect.Changes | None
    fn: Any
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    mirror: Mirrored | None = None
    """The notebook's registry of what fn reaches: what fn changes comes back, as a cell's."""


@dataclass
class PullTask:
    """``pull(names)``: the master's values, as changes against the notebook's registry of them
    (in place where the notebook holds an object of the same type at the same path)."""

    push: collect.Changes | None
    names: list[str]
    mirror: Mirrored


@dataclass
class SyncTask:
    """Only the push (``Session.push``, or a sync before a pull)."""

    push: collect.Changes | None


Task = CellTask | CallTask | PullTask | SyncTask

_state: dict[str, Any] = {}
"""This worker's session: its namespace, the task file's descriptor, the backend and rank."""


def serve(task_fd: int | None, backend: str, timeout: Any) -> NoReturn:
    """The worker's loop (the session job's function); returns when the session closes.
    ``task_fd``: the session's task file (fork); None: it came as the shared memfd (spawn).
    ``backend``, ``timeout``: the world group's, for making it again (regroup)."""
    import torch.distributed as dist

    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    _state.update(
        namespace=namespace,
        task_fd=task_fd if task_fd is not None else shm.SHARED_FD[0],
        rank=dist.get_rank() if dist.is_initialized() else 0,
        backend=backend,
        timeout=timeout,
    )
    assert bootstrap._message_fd is not None
    sock = socket.socket(fileno=os.dup(bootstrap._message_fd))
    reader: framing.MessageReader[SessionCommand] = framing.MessageReader()
    _state.update(sock=sock, reader=reader)
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


def _answer(command: SessionCommand) -> None:
    """Do one command and send its one answer. A stop press is ignored from the end of the task
    until the answer is sent (it would send a second one, see _cell.ignore_late_presses); one
    at the idle read came late too, and is passed over."""
    rank = _state["rank"]
    try:
        match command:
            case RunTask(size=size, specs=specs, objects=objects, storages=storages, parent=parent):
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
                _KEPT.settle()  # while the notebook applies the answer
            case Proceed():
                pass  # a late one (its task failed here): nothing to do
            case ReportGroups():
                bootstrap.send(Groups(_sequences()))
            case AbortGroups(peers=peers):  # no answer: the rank has answered its task already
                abort_groups(set(peers) - {os.getpid()})
            case Regroup(init_method=init_method):
                regroup(init_method)
                bootstrap.send(Done())  # never a Result: the task's result stays in the file
            case StopWorker():
                pass
            case _:
                assert_never(command)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported; the worker stays
        _cell.ignore_late_presses()
        _KEPT.drop()  # the notebook takes no outcome from this task: it may be behind what is kept
        if os.environ.get("ENOT_NB_DEBUG"):  # the whole stack, enot_nb's frames included
            traceback.print_exc()
        bootstrap.report_failure(exc)


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
    namespace = _state["namespace"]
    registry = paths.registry_at(namespace, list(specs), objects, storages, strict=True)
    state = result_file.read_result(_state["task_fd"], size, raw=True)
    task: Task = apply.load(collect.PickledState(*state), registry)  # type: ignore[assignment]
    # A push that only binds or deletes names changes no object a snapshot holds (the namespace
    # has none: the names are compared on their own); one that changes objects does.
    pushed = task.push is not None and bool(task.push.objects or task.push.storages)
    keep = isinstance(task, CellTask) and not pushed and task.mirror is not None
    if not keep:  # before anything changes: a push, another task (see KeptSnapshot)
        _KEPT.drop()
    if task.push is not None:
        problems = apply.apply_changes(namespace, registry, task.push, None)
        if problems:
            raise PushRefused("the notebook's changes could not all be applied on this rank: " + "; ".join(problems))
        _to_module_devices(registry, task.push)
    if confirm is not None:
        bootstrap.send(Pushed())
        command = framing.recv_message(_state["sock"], _state["reader"])
        while isinstance(command, Proceed) and command.task != confirm:
            command = framing.recv_message(_state["sock"], _state["reader"])
        if not (isinstance(command, Proceed) and command.go):
            return _SKIPPED
    match task:
        case CellTask():
            return _run_cell(namespace, task, keep)
        case CallTask():
            return _call(namespace, task)
        case PullTask():
            return _pull(namespace, task)
        case SyncTask():
            return None
        case _:
            assert_never(task)


def _run_cell(namespace: dict[str, Any], task: CellTask, keep: bool) -> Any:
    """The cell; the master's snapshot of what it reaches is kept for the next cell (``keep``:
    nothing but this cell will have changed it, see KeptSnapshot)."""
    registry, scan = None, False
    if task.mirror is not None and _state["rank"] == 0:
        registry = _KEPT.registry_for(namespace, task.mirror.packed) if keep else None
        registry = registry or _mirror_registry(namespace, task.mirror)
        if registry.storages:  # the pages the cell writes are the master's own again (see shadow)
            scan = before_long_lived_snapshot(registry.storages)
    kept = _KEPT if keep and registry is not None else None
    outcome = _cell.run_cell(
        task.code, namespace, task.options, registry, scan_large=scan, kept=kept, late_presses_ignored=True
    )
    if kept is not None and task.mirror is not None:
        kept.found_by(task.mirror.packed, task.mirror.specs)
    return outcome


def _call(namespace: dict[str, Any], task: CallTask) -> Any:
    """fn on this rank; the master also returns what fn changed of the notebook's objects."""
    fn = _in_namespace(task.fn, namespace)
    if task.mirror is None or _state["rank"] != 0:
        return fn(*task.args, **task.kwargs)  # (a sharded module in it stays sharded: see below)
    registry = _mirror_registry(namespace, task.mirror)
    scan = before_long_lived_snapshot(registry.storages) if registry.storages else False
    tracker = _cell.Tracker(registry, namespace, (), {}, scan)
    options = _cell.CellOptions(keep_on_error=True)
    try:
        value = fn(*task.args, **task.kwargs)
        _cell.ignore_late_presses()
    except BaseException:
        tracker.send_partial(options)
        raise
    # A sharded module fn returns is the ranks' live one: it is not made whole in place, as a
    # one-off launch's is (a DTensor does not pickle, and the error says to pull it whole).
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


def _mirror_registry(namespace: dict[str, Any], mirror: Mirrored) -> Registry:
    return paths.registry_at(namespace, mirror.specs, mirror.objects, mirror.storages, strict=False)


def _pull(namespace: dict[str, Any], task: PullTask) -> Any:
    """The master's values of ``names``: every object the notebook has at their paths as
    changed (its whole state travels, into the notebook's object), the rest by value. A module
    sharded by FSDP2 or FSDP1 comes as its full values (every rank takes part in gathering
    them; the live module stays sharded), which the notebook loads into its own module."""
    whole = sharded.full_state_dicts(namespace, task.names)  # every rank: a collective, if any
    if _state["rank"] != 0:
        return None
    missing = [n for n in task.names if n not in namespace]
    if missing:
        raise NameError(f"pull: rank 0 has no variable {', '.join(map(repr, missing))}")
    registry = _mirror_registry(namespace, task.mirror)
    not_returned: dict[str, str] = {}
    changes = collect.everything(registry, namespace, [n for n in task.names if n not in whole])
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


def _sequences() -> dict[str, int] | None:
    """Each process group's sequence number on this rank, by group name (see protocol.Groups)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    world = dist.distributed_c10d._world
    groups: list[Any] = list(world.pg_map)  # their counter is not in torch's stubs
    try:
        return {world.pg_names[group]: int(group._get_sequence_number_for_group()) for group in groups}
    except Exception:  # noqa: BLE001 - a backend that does not count: assume the worst
        return None


def abort_groups(peers: set[int]) -> None:
    """Abort every process group, so that a peer that waits in a collective with this rank is
    released with an error and returns to idle. NCCL's abort does it; gloo closes its
    connections only when the group object dies, and a DDP wrapper (or a user's subgroup) keeps
    it alive: so this rank's connections with the ``peers`` are shut down too (a peer blocked
    in a gloo wait sees "connection closed" within milliseconds)."""
    import torch.distributed as dist

    # Our own descriptors of them, taken while the groups still hold them (an abort may close
    # theirs, and a number closed may be reused by then).
    connections = []
    for fd in connections_with(peers):
        try:
            connections.append(socket.socket(fileno=os.dup(fd)))
        except OSError:
            pass
    if dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - then destroy, which also releases the peers
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the sockets below release them anyway
                pass
    for connection in connections:
        try:
            connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            connection.close()


def connections_with(peers: set[int]) -> list[int]:
    """This process's descriptors of TCP connections whose other end a process in ``peers``
    holds (read from /proc: the socket inodes, and the connections' addresses)."""
    mine = _socket_inodes(os.getpid())
    theirs: set[int] = set()
    for pid in peers:
        theirs |= set(_socket_inodes(pid))
    table = _tcp_connections()
    by_ends = {ends: inode for inode, ends in table.items()}
    found = []
    for inode, fd in mine.items():
        ends = table.get(inode)
        if ends is not None and by_ends.get((ends[1], ends[0])) in theirs:
            found.append(fd)
    return found


def _socket_inodes(pid: int) -> dict[int, int]:
    """inode -> descriptor of each socket ``pid`` holds (nothing if /proc cannot tell)."""
    inodes = {}
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(f"{folder}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes[int(target[8:-1])] = int(name)
    return inodes


def _tcp_connections() -> dict[int, tuple[str, str]]:
    """inode -> (local address, remote address) of every TCP socket in this network namespace."""
    table = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    table[int(fields[9])] = (fields[1], fields[2])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return table


def regroup(init_method: str) -> None:
    """Make the world group again, in this same process: the old one is gone (aborted, or left
    with a collective half done), and the objects that hold it must be made again."""
    import torch.distributed as dist

    from enot_nb._runtime import env

    backend = None
    if dist.is_initialized():
        backend = dist.get_backend()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - an aborted group may refuse; a new one is made anyway
            pass
    layout = env.read_layout()
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        import torch

        kwargs["device_id"] = torch.device("cuda", layout.local_rank)
    dist.init_process_group(
        backend=backend or _state["backend"],
        init_method=init_method,
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=_state["timeout"],
        **kwargs,
    )
    if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        dist.barrier()  # every rank connected before any cell runs (see bootstrap._check_connected)
