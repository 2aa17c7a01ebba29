"""The notebook's record of what a session's ranks hold of it, as of the last sync: the synced
variables (each bound to the notebook's object of that time), the registry of everything they
reach (the paths the ranks find their own objects by, see paths), and its Snapshot (what the
next push compares against, see mirror).

After a task the record is made again: walked and snapshotted whole, or, where the task changed
contents only (objects' states, storages' bytes) and bound new names, updated where it moved
(``Record.update``): a cell that reads a large model and binds a number costs nothing here, one
that writes 1 MiB of 2 GiB re-digests that 1 MiB.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from enot_nb._memory import written
from enot_nb._memory.digests import before_long_lived_snapshot
from enot_nb._serialize.tensors import tensor_storages
from enot_nb._state.collect import Changes
from enot_nb._state.kinds import OPS, SET_ITEM, kind_of
from enot_nb._state.registry import Registry
from enot_nb._state.snapshot import Snapshot
from enot_nb._state.states import VALUE_TYPES


@dataclass
class Record:
    """What the ranks hold of the notebook (see the module's docstring)."""

    synced: dict[str, Any] = field(default_factory=dict)
    baseline: Registry = field(default_factory=lambda: Registry.of_namespace({}, []))
    snapshot: Snapshot | None = None

    @classmethod
    def walk(cls, namespace: dict[str, Any], synced: dict[str, Any]) -> Record:
        """The record of ``synced``, walked and snapshotted whole."""
        baseline = Registry.of_namespace(namespace, sorted(synced))
        # From here, the pages the notebook writes are its own again (see shadow), or tracked.
        scan = before_long_lived_snapshot(baseline.storages) if baseline.storages else False
        return cls(synced, baseline, Snapshot.take(baseline, scan_large=scan))

    def walked_again(self, namespace: dict[str, Any], synced: dict[str, Any], moved: TaskChanges) -> Record:
        """The record of ``synced``, walked anew where ``update`` could not say the paths hold
        (a parameter's ``.grad`` replaced by a new tensor, every training step): what this
        record and the walk both hold keeps its state and digest unless ``moved`` holds it, as
        ``update`` keeps them (see Snapshot.carried_over), where writes are tracked; else as
        ``walk``."""
        old = self.snapshot
        # Not under the shadow (writes untracked): its fork watch starts anew with each walk.
        if old is None or not written.kernel_tracks_writes() or not self._still_of(namespace):
            return Record.walk(namespace, synced)
        baseline = Registry.of_namespace(namespace, sorted(synced))
        return Record(synced, baseline, old.carried_over(self.baseline, baseline, moved.objects, moved.storages))

    def _still_of(self, namespace: dict[str, Any]) -> bool:
        """Whether this record's states may be kept for ``namespace``: it was taken of it, and no
        child that we did not fork shares its pages (the walk's snapshot starts the fork watch
        anew)."""
        return self.baseline.objects[0] is namespace and written.fork_watch_holds()

    def update(self, namespace: dict[str, Any], synced: dict[str, Any], moved: TaskChanges) -> bool:
        """Updated in place to hold ``synced``: the moved objects' states and storages' digests
        taken again, and what they and the new names reach that it lacks walked into it; False
        (and nothing done) where a walk could give other paths: a synced name rebound or
        deleted whose old value it walked (not an atom), an object no longer holding what it
        held (that may now be unreachable, or elsewhere), a tensor on another storage."""
        baseline, snapshot = self.baseline, self.snapshot
        if snapshot is None or not self._still_of(namespace):
            return False
        rebound = [n for n, v in self.synced.items() if synced.get(n, _NONE) is not v]
        if any(baseline.find(self.synced[n]) is not None for n in rebound):
            return False  # what was walked from its old value may be unreachable now
        indices = sorted({i for i in map(baseline.find, moved.objects) if i is not None and i > 0})
        regrowth = _registry_growth(baseline, indices)
        if regrowth is None:
            return False
        for r in regrowth.replaced:
            baseline.replace(r.at, r.new, r.storages)
        objects, storages = len(baseline.objects), len(baseline.storages)
        new = sorted(n for n in synced if n not in self.synced or n in rebound)
        baseline.grow([*regrowth.starts, *((synced[n], 0, n) for n in new)])
        indices += [r.at for r in regrowth.replaced]
        written = {j for j in map(baseline.find_storage, moved.storages) if j is not None}
        written |= set(range(storages, len(baseline.storages))) | {k for r in regrowth.replaced for k, _ in r.storages}
        scan = True
        if written:
            kept = [d for j, d in enumerate(snapshot.storages) if j not in written]
            scan = before_long_lived_snapshot([baseline.storages[j] for j in written], kept)
            if not scan:  # a new shadow shares every page again: each storage digested anew, cheaply
                written = set(range(len(baseline.storages)))
        snapshot.retake(baseline, [*indices, *range(objects, len(baseline.objects))], sorted(written), scan)
        self.synced = synced
        return True


def grown_in_place(registry: Registry, indices: list[int]) -> list[int] | None:
    """The objects at ``indices`` of a walk's registry changed: where all that they hold anew
    took the places of what they held (a training step's new ``.grad``, see Replacement), or
    one of them holds new objects after all it held, which a walk registers after everything
    else (a list appended to: see _walked_last), ``registry`` made to hold them too (the
    replaced ones at their old indices, the new ones after the last), which is then what
    walking again gives (as ``Record.update`` keeps its baseline); the indices replaced. None
    where they hold anything else anew, hold what they held in another order or a registered
    object by a new step (a walk would give other indices), one cannot be replaced, or a new
    object reads the notebook's globals (a function: the reach walks its global names too);
    the registry's counts may have grown then, and what it did grow: it is to be dropped."""
    regrowth = _registry_growth(registry, indices)
    if regrowth is None or not regrowth.in_walk_order:
        return None
    if regrowth.starts and not _walked_last(registry, regrowth):
        return None
    for r in regrowth.replaced:
        registry.replace(r.at, r.new, r.storages)
    objects = len(registry.objects)
    registry.grow(regrowth.starts)
    if any(OPS[kind].reads_globals for kind in registry.kinds[objects:]):
        return None
    return [r.at for r in regrowth.replaced]


def _walked_last(registry: Registry, regrowth: RegistryGrowth) -> bool:
    """Whether a walk registers the new objects after every object ``registry`` holds, as
    ``grow`` does: one object holds them all (not a replacement), after all it held, and no
    registered object was reached through an object after it, as a set's item (the walk
    reaches those last), or as a variable walked in a later round (a function's global)."""
    holders = {parent for child, parent, _ in regrowth.starts if type(child) not in VALUE_TYPES}
    if not holders:  # atoms only: never registered
        return True
    if regrowth.replaced or not regrowth.new_after_old or len(holders) != 1:
        return False
    holder, roots = holders.pop(), True
    for parent, step in registry.parents[1:]:
        if parent > holder or step.startswith(SET_ITEM) or (parent == 0 and not roots):
            return False  # (a variable after others' children: a later round, a function's global)
        roots = roots and parent == 0
    return True


@dataclass
class TaskChanges:
    """What a task changed in the notebook (the push applied there by plain cells, the master's
    changes brought back): the objects whose state changed, and the storages written."""

    objects: list[Any] = field(default_factory=list)
    storages: list[Any] = field(default_factory=list)

    @classmethod
    def of(cls, changes: Changes | None, registry: Registry | None) -> TaskChanges:
        return cls() if registry is None else cls().plus(changes, registry)

    def plus(self, changes: Changes | None, registry: Registry) -> TaskChanges:
        """These, and the objects and storages ``changes`` (pickled against ``registry``) changed."""
        if changes is None:
            return self
        objects = self.objects + [registry.objects[i] for i, _ in changes.objects]
        return TaskChanges(objects, self.storages + [registry.storages[new.storage] for new in changes.storages])


@dataclass
class Replacement:
    """An object a moved one held at the step it was registered by, which holds another there now
    that nothing else holds (a training step's new ``.grad``): the new one takes its index."""

    at: int
    new: Any
    storages: list[tuple[int, Any]]
    """The new object's storages, each with the index of the old one's whose place it takes."""


@dataclass
class RegistryGrowth:
    """What the moved objects hold now that the registry lacks: the starts of its walk (grow),
    and the objects replaced in place."""

    starts: list[tuple[Any, int, str]]
    replaced: list[Replacement]
    in_walk_order: bool = True
    """No moved object holds a registered object at a step it did not hold it by, nor its
    registered children in another order: a walk would register every object at the same index.
    (Where one does, the paths the registry holds still lead to its objects, which is all
    ``Record.update`` needs; a reach kept for the next cell must be what a walk gives.)"""
    new_after_old: bool = True
    """Each moved object holds its new objects after all the registered ones it holds."""


def _registry_growth(registry: Registry, indices: list[int]) -> RegistryGrowth | None:
    """What the objects at ``indices`` now hold that ``registry`` lacks (see RegistryGrowth); None if
    one no longer holds a child at the step it was registered by, except where that child may
    leave the registry and the new one take its place (``_replacement``), or a tensor is on a
    storage the registry lacks. The counts the registry keeps (edges, storage users) gain what
    the moved objects may hold anew: never undercounted, so a replacement is never wrong."""
    if not indices:
        return RegistryGrowth([], [])
    wanted = set(indices)
    held: dict[int, list[int]] = {}  # parent -> the children registered by a step of it
    parents = set()
    for j, (parent, _) in enumerate(registry.parents):
        parents.add(parent)
        if parent in wanted:
            held.setdefault(parent, []).append(j)
    now: dict[int, list[tuple[str, Any]]] = {}
    used: list[int] = []  # the storages of the moved tensors: one may be another now
    for i in indices:
        obj, ops = registry.objects[i], OPS[registry.kinds[i]]
        if kind_of(obj) is not registry.kinds[i]:
            return None
        if ops.has_storage:
            at = list(map(registry.find_storage, tensor_storages(obj)))
            if None in at:
                return None
            used += at  # type: ignore[arg-type]  # (no None in at)
        try:
            now[i] = ops.children(obj) if ops.children is not None else []
        except Exception:  # noqa: BLE001 - as the walk: left opaque
            return None
    holders = collections.Counter(id(child) for steps in now.values() for _, child in steps)
    starts, replaced, counted = [], [], []
    in_walk_order = new_after_old = True
    claimed: set[int] = set()  # the new objects' storages (two new views may share one)
    placed: set[int] = set()  # the new objects (ids): walked from their places, not as starts
    for i in indices:
        steps = dict(now[i])
        for j in held.get(i, ()):
            step = registry.parents[j][1]
            if steps.get(step, _NONE) is registry.objects[j]:
                continue
            r = None if j in wanted else _replacement(registry, j, steps.get(step, _NONE), parents, holders, claimed)
            if r is None:  # (a moved object left is walked from: its children would be the new one's)
                return None
            replaced.append(r)
            placed.add(id(r.new))
        tree = {registry.parents[j][1] for j in held.get(i, ())}
        if [step for step, _ in now[i] if step in tree] != [registry.parents[j][1] for j in held.get(i, ())]:
            in_walk_order = False  # its children in another order (a dict's key taken out and put back)
        new = False
        for step, child in now[i]:
            found = registry.find(child)
            if found is None:
                if id(child) not in placed:
                    starts.append((child, i, step))
                    new = new or type(child) not in VALUE_TYPES
            else:
                new_after_old = new_after_old and not new
                if step not in tree:
                    counted.append(found)  # held once more, maybe
                    in_walk_order = False  # a walk may reach it first by this step
    for j in counted:
        if j in registry.edges:
            registry.edges[j] += 1
    for k in used:
        registry.storage_users[k] = registry.storage_users.get(k, 0) + 1
    for r in replaced:
        children = OPS[registry.kinds[r.at]].children
        starts += [(child, r.at, step) for step, child in (children(r.new) if children is not None else [])]
    return RegistryGrowth(starts, replaced, in_walk_order, new_after_old)


def _replacement(
    registry: Registry, j: int, new: Any, parents: set[int], holders: collections.Counter, claimed: set[int]
) -> Replacement | None:
    """Object ``j``, no longer at its step, replaced there by ``new``; None where that would not
    leave the registry what a walk reaches: another object may still hold the old one (it was
    reached by more than its step, or a moved object holds it), the old one holds registered
    objects or shares a storage; the new one is no object of the same kind, is held by another
    moved object too, or it or its storages are registered (or ``claimed`` by another)."""
    old, kind = registry.objects[j], registry.kinds[j]
    if new is _NONE or type(new) in VALUE_TYPES or registry.find(new) is not None or holders[id(new)] != 1:
        return None
    if holders[id(old)] or registry.edges.get(j) != 1 or j in parents or OPS[kind].reads_globals:
        return None
    try:
        if kind_of(new) is not kind:
            return None
    except Exception:  # noqa: BLE001 - as the walk: left untracked
        return None
    if not OPS[kind].has_storage:
        return Replacement(j, new, [])
    before, after = tensor_storages(old), tensor_storages(new)
    ids = {id(s) for s in after}
    if len(before) != len(after) or len(ids) != len(after) or ids & claimed:
        return None
    at = [registry.find_storage(s) for s in before]
    if any(k is None or registry.storage_users.get(k) != 1 for k in at):
        return None
    if any(registry.find_storage(s) is not None for s in after):
        return None
    claimed |= ids
    return Replacement(j, new, list(zip(at, after)))  # type: ignore[arg-type]  # (no None in at)


_NONE = object()
