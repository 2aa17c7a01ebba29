"""The notebook's side of a session: what the ranks hold of the notebook, and what changed since.

A session's ranks keep their objects from cell to cell; the notebook mirrors the master. Between
two session cells, plain cells may change the notebook, and those changes must reach every rank
before the next session cell (the push). The notebook keeps, after each session cell, its record
of what the ranks hold::

    synced    the variables the ranks hold, each bound to the notebook's object of that time
    baseline  the registry of everything they reach, and its Snapshot (states, storage digests)

Before the next session cell, ``push`` is what changed since: the baseline's objects whose state
changed (in place on the ranks, their CUDA tensors updated on their devices), the synced names
rebound or deleted, and the names the cell reaches that the ranks do not hold yet (by value:
a variable reaches the ranks when a session cell first uses it, so a cell costs what it uses).
It is pickled against the baseline, so an object the ranks hold travels as its index, and the
ranks find their own at its path (see paths).

A variable the master changed that did not come back (``--return``, ``--no-return``, an object
that cannot be pickled) is stale here: pushing a change to it would overwrite the master's
newer value, so a plain cell that changed it is refused at the next push, by name.
"""

from __future__ import annotations

import io
import itertools
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from enot_nb._memory import written
from enot_nb._memory.digests import digested_size
from enot_nb._serialize import picklers
from enot_nb._serialize.tensors import array_extent, array_owner, may_be_an_arrays, tensor_storages
from enot_nb._session.mirror import paths
from enot_nb._session.mirror.record import Record, TaskChanges
from enot_nb._session.tasks import ShardedLoad
from enot_nb._state.collect import Changes, StatePickler, StorageBytes, collect, whole_states
from enot_nb._state.kinds import IN_PLACE, OPS, Kind
from enot_nb._state.registry import Registry, stays_in_the_kernel, user_variables
from enot_nb.errors import StaleError


@dataclass
class Push:
    """What the ranks must apply before the next task, pickled against the baseline."""

    changes: Changes | None
    names: list[str] = field(default_factory=list)
    """The variables the ranks hold once it is applied."""
    kept_here: dict[str, str] = field(default_factory=dict)
    """Variables newly left in the notebook (see Mirror.kept_here), with why: named once."""
    detached: list[str] = field(default_factory=list)
    """Variables bound to tensors with an autograd graph: they reach the ranks without it."""
    settles: list[str] = field(default_factory=list)
    """The conflicts the pull it goes with settles (``keeping``, or ``pulling`` with
    ``overwrite``): settled once the winning side is on both, kept if not (see
    NamespaceFlow.still_in_conflict)."""


@dataclass
class SinceSync:
    """What the push's comparison found: its changes (before the push keeps those it sends), and
    every object and storage of the record that changed (see _session/kernel/cell_reach)."""

    changes: Changes
    moved: TaskChanges


@dataclass
class PickledTask:
    """A task pickled against the baseline, and the specs of the objects it refers to."""

    main: bytes
    buffers: list[Any]
    specs: list[paths.ObjectSpec]
    objects: int
    storages: int
    has_push: bool = False
    """It carries changes for the ranks to apply first (they confirm, see protocol.RunTask)."""
    kept_here: dict[str, str] = field(default_factory=dict)
    """Variables left out of the push because they cannot be pickled, with why: named once."""


class _RecordingPickler(StatePickler):
    """StatePickler that notes which registered objects and storages it referred to."""

    def __init__(self, file: Any, buffer_callback: Any = None, *, registry: Registry) -> None:
        super().__init__(file, buffer_callback=buffer_callback, registry=registry)
        self.objects_used: set[int] = set()
        self.storages_used: set[int] = set()

    def persistent_id(self, obj: Any) -> Any:
        pid = super().persistent_id(obj)
        if pid is not None and pid[0] != "v":
            (self.objects_used if pid[0] in ("o", "p") else self.storages_used).add(pid[1])
        return pid


def _with_a_graph(bound: dict[str, Any]) -> list[str]:
    """The names bound to tensors that carry an autograd graph (torch looked up, not imported)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    return sorted(n for n, v in bound.items() if isinstance(v, torch.Tensor) and v.grad_fn is not None)


class Mirror:
    """What the ranks hold of the notebook (see the module's docstring)."""

    def __init__(self) -> None:
        self.record = Record()
        self.stale: dict[str, str] = {}
        """Variables whose newest value the master alone holds, with why."""
        self.on_workers: dict[str, str] = {}
        """Variables that live only on the workers (they could not come back), with why."""
        self.on_device: set[str] = set()
        """The master's variables that live on its GPU (as its last cell reported): a restart
        puts them back on each rank's GPU."""
        self.kept_here: dict[str, tuple[int, str]] = {}
        """Variables that stay in the notebook, by the id of the value they hold and why:
        enot_nb's own live objects (a Session) and values that cannot be pickled. Never pushed
        while they hold that value; a new value is tried again."""
        self.synced_at = next(_SYNCS)
        """When the record was last made (a count over every mirror): plain cells run since
        are what can have changed it (see plain_cells)."""
        self.sharded: set[str] = set()
        """Variables the ranks hold as sharded modules (FSDP) whose notebook copy is plain (a
        pull made it whole): a plain cell's change to one is loaded into theirs (ShardedLoad)."""
        self.conflicts: set[str] = set()
        """Stale variables a plain cell changed too, found by a push that left the change out (a
        pull of other names): every later task but their own pull is refused until the user
        says which side wins (see StaleError)."""

    def reset(self) -> None:
        """New workers hold nothing: every variable reaches them again when a cell uses it."""
        written.end_shadow()
        self.__init__()  # type: ignore[misc]

    def recorded(self, namespace: dict[str, Any]) -> bool:
        """Whether there is a record of ``namespace`` to compare with."""
        return self.record.snapshot is not None and self.record.baseline.objects[0] is namespace

    def matched(self) -> None:
        """The push's comparison found the notebook as the record has it, and the task changed
        nothing: as good as a sync for what runs later (the plain cells run before it, and any
        code run outside them, need no comparison again)."""
        self.synced_at = next(_SYNCS)

    def arrays_over_new_storages(self, namespace: dict[str, Any], reached: Registry, hidden: Any = ()) -> list[str]:
        """The variables holding a NumPy array whose memory holds part of a storage ``reached``
        has that the ranks lack and that may be an array's (``t = torch.from_numpy(a[:2])``):
        they go with it, one memory there as here (``a`` sent later could not be: the ranks'
        copy of ``t``'s storage holds its part only)."""
        new = [s for s in reached.storages if may_be_an_arrays(s) and self.record.baseline.find_storage(s) is None]
        numpy = sys.modules.get("numpy")
        if not new or numpy is None:
            return []
        spans = [(s.data_ptr(), s.data_ptr() + s.nbytes()) for s in new]
        found = []
        for name, value in user_variables(namespace, hidden).items():
            if type(value) is numpy.ndarray and value.nbytes:
                start, end = array_extent(array_owner(value))
                if any(start < last and first < end for first, last in spans):
                    found.append(name)
        return found

    def compare(self, namespace: dict[str, Any], hidden: Any = (), reached: Registry | None = None) -> SinceSync | None:
        """What changed of the record's objects and storages since the last sync (None: there is
        no record of this namespace); ``push`` takes it. ``reached``: a walk of all that the
        plain cells run since can have changed (see plain_cells): only that is compared."""
        record = self.record
        if record.snapshot is None or not self.recorded(namespace):
            return None
        within = None
        if reached is not None:
            baseline = record.baseline
            objects = {i for i in map(baseline.find, reached.objects[1:]) if i is not None}
            found = {j for j in map(baseline.find_storage, reached.storages) if j is not None}
            shared_objects, shared_storages = _sharing_memory(baseline, reached)
            within = (objects | shared_objects | _plain_holders(baseline, reached), found | shared_storages)
        changes, changed = collect(record.baseline, record.snapshot, record.synced, namespace, hidden, within)
        storages = [record.baseline.storages[new.storage] for new in changes.storages]
        return SinceSync(changes, TaskChanges([record.baseline.objects[i] for i in changed], storages))

    def push(
        self,
        namespace: dict[str, Any],
        reached: list[str],
        hidden: Any = (),
        pulling: list[str] | None = None,
        since: SinceSync | None = None,
        overwrite: bool = False,
        keeping: list[str] | None = None,
    ) -> Push:
        """What changed since the last sync, and the reached variables the ranks lack.
        ``pulling``: variables about to be pulled: their changes here are not pushed (the
        master's values replace them; a stale one changed here refuses the pull unless
        ``overwrite``). ``keeping``: stale variables whose notebook value wins
        (``--keep-notebook``, which sends what they reach whole): they refuse nothing, and
        their rebinding or deletion here is pushed. In either kind
        of pull, another stale variable changed here refuses nothing (its change is left out,
        a conflict kept for later); in any other task it refuses the task (StaleError).
        ``since``: ``compare``'s answer (None: there is no record to compare with)."""
        pulling, keeping, synced = pulling or [], keeping or [], self.record.synced
        now = user_variables(namespace, hidden)
        changes = Changes()
        changed_stale: set[str] = set()
        if since is not None:
            changes = since.changes
            held = sorted(n for n in now if n in synced or n in reached)
            _only_reachable(self.record, namespace, changes, held)
            changes.objects, changes.storages, changed_stale = self._stale_apart(namespace, changes, pulling)
        # collect's rule for names, kept to those the ranks hold and those the task uses
        changes.bound = {
            n: v for n, v in now.items() if (n in synced or n in reached) and synced.get(n, _NONE) is not v
        }
        newly_kept = self._keep_here(changes)
        changes.deleted = [n for n in synced if n not in now]
        # a stale variable the ranks hold though no sync sent it (a cell bound it there): deleted too
        changes.deleted += [n for n in sorted(self.stale) if n not in now and n not in synced]
        changed_stale |= {n for n in [*changes.bound, *changes.deleted] if n in self.stale}
        changed_stale |= self.conflicts & set(self.stale)
        settles = sorted(changed_stale & {*pulling, *keeping})
        changed_stale -= set(keeping)  # the notebook's side goes
        for name in sorted(changed_stale):
            if name in pulling and not overwrite:
                raise StaleError(name, self.stale[name])
            if not pulling and not keeping:
                raise StaleError(name, self.stale[name])
        self.conflicts |= changed_stale - set(pulling)
        left_out = set(pulling) | changed_stale
        changes.sharded = self._sharded_loads(namespace, changes, left_out)
        changes.bound = {n: v for n, v in changes.bound.items() if n not in left_out}
        changes.deleted = [n for n in changes.deleted if n not in left_out]
        empty = not (changes.bound or changes.deleted or changes.objects or changes.storages or changes.sharded)
        names = [n for n in {**synced, **changes.bound} if n not in changes.deleted]
        return Push(None if empty else changes, names, newly_kept, _with_a_graph(changes.bound), settles)

    def _keep_here(self, changes: Changes) -> dict[str, str]:
        """Drop from ``changes.bound`` the variables that stay in the notebook (``kept_here``),
        enot_nb's own live objects among them; those newly kept, with why."""
        newly: dict[str, str] = {}
        for name, value in list(changes.bound.items()):
            kept = self.kept_here.get(name)
            if kept is not None and kept[0] != id(value):
                del self.kept_here[name]  # a new value: it may travel
                kept = None
            if kept is None and stays_in_the_kernel(value):
                why = f"{type(value).__name__} is enot_nb's own, bound to this kernel's processes"
                self.kept_here[name] = (id(value), why)
                newly[name] = why
            if name in self.kept_here:
                del changes.bound[name]
        return newly

    def _stale_apart(
        self, namespace: dict[str, Any], changes: Changes, pulling: list[str]
    ) -> tuple[list, list, set[str]]:
        """The changes, less those of what a stale or a pulled variable reaches (through any
        alias: found by walking them); the stale variables whose objects changed here."""
        held: dict[int, str] = {}
        if not changes.objects and not changes.storages:
            return [], [], set()
        for name in sorted(({*self.stale} | set(pulling)) & set(namespace)):
            walked = Registry.of_namespace(namespace, [name])
            for obj in walked.objects[1:]:
                held.setdefault(id(obj), name)
            for storage in walked.storages:
                held.setdefault(id(storage), name)
        kept_objects: list[tuple[int, Any]] = []
        kept_storages: list[StorageBytes] = []
        changed_stale: set[str] = set()
        for i, state in changes.objects:
            holder = held.get(id(self.record.baseline.objects[i]))
            if holder is None:
                kept_objects.append((i, state))
            elif holder in self.stale:
                changed_stale.add(holder)
        for new in changes.storages:
            holder = held.get(id(self.record.baseline.storages[new.storage]))
            if holder is None:
                kept_storages.append(new)
            elif holder in self.stale:
                changed_stale.add(holder)
        return kept_objects, kept_storages, changed_stale

    def _sharded_loads(self, namespace: dict[str, Any], changes: Changes, left_out: set[str]) -> list[ShardedLoad]:
        """The changes to modules the ranks hold sharded, taken out of ``changes`` (in place):
        as loads of the plain copy's training flags and (where its tensors changed) its values."""
        loads = []
        baseline = self.record.baseline
        for name in sorted(self.sharded - left_out):
            if name not in namespace or self.record.synced.get(name) is not namespace[name]:
                self.sharded.discard(name)  # rebound or deleted: it travels as any value
                continue
            module: Any = namespace[name]
            # What FSDP holds sharded on the ranks: the modules, their tables, their tensors. Any
            # other object under it (a config dict) goes as any change, at its path there.
            parts = [(m, m._parameters, m._buffers, m._modules) for m in module.modules()]
            tensors = [*module.parameters(), *module.buffers()]
            objects = {id(o) for held in parts for o in held} | {id(t) for t in tensors}
            storages = {id(s) for t in tensors for s in tensor_storages(t)}
            moved = [(i, st) for i, st in changes.objects if id(baseline.objects[i]) in objects]
            written = [new for new in changes.storages if id(baseline.storages[new.storage]) in storages]
            if not moved and not written:
                continue
            changes.objects = [c for c in changes.objects if c not in moved]
            changes.storages = [new for new in changes.storages if new not in written]
            new_values = written or any(OPS[baseline.kinds[i]].has_storage for i, _ in moved)
            values = {k: v.detach().clone() for k, v in module.state_dict().items()} if new_values else None
            loads.append(ShardedLoad(name, {n: m.training for n, m in module.named_modules()}, values))
        return loads

    def names_changed(self, changes: Changes) -> list[str]:
        """The variables whose objects or storages ``changes`` (pickled against the record)
        changes, bound or deletes."""
        baseline = self.record.baseline
        at = [i for i, _ in changes.objects]
        at += paths.storage_holders(baseline, {new.storage for new in changes.storages})
        roots = {baseline.root_name(i) for i in at}
        return sorted({n for n in roots if n is not None} | set(changes.bound) | set(changes.deleted))

    def notebook_wins(self, namespace: dict[str, Any], names: list[str]) -> Changes:
        """``names`` taken as the notebook holds them (``--keep-notebook``): every object of the
        record they reach sent whole (its state and bytes, in place on the ranks), whether or
        not the record saw it change. They stay stale until the ranks applied it (refreshed)."""
        baseline = self.record.baseline
        objects: set[int] = set()
        storages: set[int] = set()
        for name in names:
            if name not in namespace or baseline.objects[0] is not namespace:
                continue
            walked = Registry.of_namespace(namespace, [name])
            objects |= {i for i in map(baseline.find, walked.objects[1:]) if i is not None and i > 0}
            storages |= {j for j in map(baseline.find_storage, walked.storages) if j is not None}
        return whole_states(baseline, sorted(objects), sorted(storages))

    def pickle(self, task: Any, namespace: dict[str, Any]) -> PickledTask:
        """``task`` pickled against the baseline (the ranks' objects by index, new ones by
        value), with the specs of what it refers to. Where it cannot be pickled, the variables
        of its push that cannot are left in the notebook (``kept_here``) and it is pickled
        again without them; the first error is raised where none is to blame."""
        baseline = self.record.baseline
        registry = baseline if baseline.objects[0] is namespace else Registry.of_namespace(namespace, [])
        push = getattr(task, "push", None)
        buffers: list[Any] = []
        stream = io.BytesIO()
        kept: dict[str, str] = {}
        try:
            pickler = _RecordingPickler(stream, buffer_callback=buffers.append, registry=registry)
            pickler.dump(task)
        except Exception:
            kept = picklers.unpicklable(
                push.bound if push is not None else {}, pickler_class=StatePickler, registry=registry
            )
            if not kept:
                raise
            assert push is not None
            for name in kept:
                self.kept_here[name] = (id(push.bound.pop(name)), kept[name])
            buffers, stream = [], io.BytesIO()
            pickler = _RecordingPickler(stream, buffer_callback=buffers.append, registry=registry)
            pickler.dump(task)
        objects = set(pickler.objects_used)
        storages = set(pickler.storages_used)
        if push is not None:
            objects |= {i for i, _ in push.objects}
            storages |= {s.storage for s in push.storages}
        objects |= set(paths.storage_holders(registry, storages))
        objects.discard(0)
        sizes = None
        if self.record.snapshot is not None and registry is self.record.baseline:  # as the ranks hold them
            sizes = [digested_size(d) for d in self.record.snapshot.storages]
        specs = paths.specs_of(registry, sorted(objects), sizes)
        return PickledTask(
            stream.getvalue(), buffers, specs, len(registry.objects), len(registry.storages), push is not None, kept
        )

    def synced_after(
        self, namespace: dict[str, Any], names: list[str], hidden: Any = (), moved: TaskChanges | None = None
    ) -> None:
        """The ranks now hold ``names`` as the notebook does: the baseline of the next push.
        ``moved``: all that the task changed in the notebook, where the record may be updated
        in place (see Record.update) or walked again keeping the states of what did not move
        (Record.walked_again); else the names are walked and snapshotted again."""
        now = user_variables(namespace, hidden)
        synced = {
            n: now[n] for n in dict.fromkeys(names) if n in now and n not in self.on_workers and n not in self.kept_here
        }
        if moved is None:
            self.record = Record.walk(namespace, synced)
        elif not self.record.update(namespace, synced, moved):
            self.record = self.record.walked_again(namespace, synced, moved)
        self.synced_at = next(_SYNCS)

    def came_back(
        self, namespace: dict[str, Any], not_returned: dict[str, str], returned: set[str], reached: list[str]
    ) -> list[str]:
        """After a task the master answered: what it changed that did not come back
        (``not_returned``: what could not, what --return left out) is stale here (or lives on
        the workers only), what did is current; the variables the ranks now hold."""
        not_back = {n: why for n, why in not_returned.items() if n.isidentifier()}
        self.left_on_master(namespace, not_back)
        self.refreshed(sorted(returned - set(not_back)))
        return list(self.record.synced) + [n for n in reached + sorted(returned) if n in namespace]

    def left_on_master(self, namespace: dict[str, Any], changed: dict[str, str]) -> None:
        """Variables the master changed that did not come back, with why: stale where the
        notebook has them (only a change makes a name stale, never a read), else on the workers."""
        self.on_workers.update({n: why for n, why in changed.items() if n not in namespace})
        self.stale.update({n: why for n, why in changed.items() if n in namespace})

    def refreshed(self, names: list[str]) -> None:
        """The notebook and the ranks hold the same values of ``names`` again (a pull, a cell
        that brought them back, the notebook's sent by ``--keep-notebook``)."""
        for name in names:
            self.stale.pop(name, None)
            self.on_workers.pop(name, None)
            self.conflicts.discard(name)


def _memory_of(registry: Registry) -> list[tuple[int, int, int, bool]]:
    """The address ranges a registry's storages and NumPy arrays span: (start, end, index,
    is_storage)."""
    spans = [
        (s.data_ptr(), s.data_ptr() + s.nbytes(), j, True)
        for j, s in enumerate(registry.storages)
        if s.device.type == "cpu" and s.nbytes()
    ]
    for i, (obj, kind) in enumerate(zip(registry.objects, registry.kinds)):
        if kind is Kind.NDARRAY and obj.nbytes:
            start, end = array_extent(obj)
            spans.append((start, end, i, False))
    return spans


def _sharing_memory(baseline: Registry, reached: Registry) -> tuple[set[int], set[int]]:
    """The baseline's arrays and storages whose memory overlaps memory that ``reached`` holds
    (``a = t.numpy()`` written in a plain cell changes ``t``'s storage, which the ranks hold):
    (object indices, storage indices). Only where ``reached`` holds a storage or an array the
    baseline lacks, or a view of an array (``_ *= 2`` through ``_``, an old ``row = a[1:]`` in
    the record, writes ``a``, which the record holds on its own)."""

    def loose(span: tuple[int, int, int, bool]) -> bool:
        if span[3]:
            return baseline.find_storage(reached.storages[span[2]]) is None
        array = reached.objects[span[2]]
        return array.base is not None or baseline.find(array) is None

    unknown = [span for span in _memory_of(reached) if loose(span)]
    objects: set[int] = set()
    storages: set[int] = set()
    if not unknown:
        return objects, storages
    for start, end, index, is_storage in _memory_of(baseline):
        if any(start < other_end and other_start < end for other_start, other_end, _, _ in unknown):
            (storages if is_storage else objects).add(index)
    return objects, storages


def _plain_holders(baseline: Registry, reached: Registry) -> set[int]:
    """The plain data of the record (kind PLAIN: one object, its items not registered) that
    holds, as an item, a list, dict, set or bytearray the plain cells reached by another name
    (``rec = log[5]``, then ``rec['v'] = 19``): the write is the container's change. A C-level
    pass over each such container's items, only where a reached one is not in the record."""
    loose = {id(o) for o in reached.objects[1:] if type(o) in IN_PLACE and baseline.find(o) is None}
    return _plain_holding(baseline, range(len(baseline.kinds)), loose) if loose else set()


def _plain_holding(baseline: Registry, among: Iterable[int], ids: set[int]) -> set[int]:
    """Of ``among``, the plain data (kind PLAIN) that holds, as an item, an object whose id is
    in ``ids``: a C-level pass over each one's items."""
    holders = set()
    for i in among:
        if baseline.kinds[i] is Kind.PLAIN:
            container = baseline.objects[i]
            if not ids.isdisjoint(map(id, container.values() if type(container) is dict else container)):
                holders.add(i)
    return holders


def _only_reachable(record: Record, namespace: dict[str, Any], changes: Changes, held: list[str]) -> None:
    """Drop the changes of objects that no variable the ranks will hold (``held``: the synced
    ones and those the task reaches) reaches any more (a list written, then replaced by
    another): nothing on the ranks would see them, and their old paths may hold something else
    there. (An object taken out of a synced one into a new variable, ``c = d.pop('k')``, is
    reached by that variable: its changes go, and the rank binds its own, found at the old path.)"""
    if not changes.objects and not changes.storages:
        return
    baseline = record.baseline
    current = Registry.of_namespace(namespace, held)
    # What shares memory with something new is reached too: the new one travels over it (``row
    # = a[:2]`` or ``t = torch.from_numpy(a)``, then ``a[0] = 5; a = a + 1``: the old a's write).
    objects, storages = _sharing_memory(baseline, current)
    kept = {i for i, _ in changes.objects if i in objects or current.find(baseline.objects[i]) is not None}
    # Plain data a held variable reaches through an item (``rec = log[0]``, then ``rec['v'] =
    # 23; del log``): the write is the container's change, applied to the ranks' own before
    # the name goes.
    unreached = [i for i, _ in changes.objects if i not in kept and baseline.kinds[i] is Kind.PLAIN]
    if unreached:
        kept |= _plain_holding(baseline, unreached, set(map(id, current.objects)))
    changes.objects = [(i, s) for i, s in changes.objects if i in kept]
    changes.storages = [
        new
        for new in changes.storages
        if new.storage in storages or current.find_storage(baseline.storages[new.storage]) is not None
    ]


_NONE = object()
_SYNCS = itertools.count()
