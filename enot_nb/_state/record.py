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

from dataclasses import dataclass, field
from typing import Any

from enot_nb._serialize.tensors import tensor_storages
from enot_nb._state.collect import Changes
from enot_nb._state.digests import FORKS, before_long_lived_snapshot
from enot_nb._state.kinds import OPS, kind_of
from enot_nb._state.registry import Registry
from enot_nb._state.snapshot import Snapshot
from enot_nb._state.writes import WRITES


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

    def walked_again(self, namespace: dict[str, Any], synced: dict[str, Any], moved: Moved) -> Record:
        """The record of ``synced``, walked anew where ``update`` could not say the paths hold
        (a parameter's ``.grad`` replaced by a new tensor, every training step): what this
        record and the walk both hold keeps its state and digest unless ``moved`` holds it, as
        ``update`` keeps them (see Snapshot.carried_over), where writes are tracked; else as
        ``walk``."""
        old = self.snapshot
        # Not under the shadow (writes untracked): its fork watch starts anew with each walk.
        if old is None or not WRITES.available() or not self._still_of(namespace):
            return Record.walk(namespace, synced)
        baseline = Registry.of_namespace(namespace, sorted(synced))
        return Record(synced, baseline, old.carried_over(self.baseline, baseline, moved.objects, moved.storages))

    def _still_of(self, namespace: dict[str, Any]) -> bool:
        """Whether this record's states may be kept for ``namespace``: it was taken of it, and no
        child that we did not fork shares its pages (the walk's snapshot starts the fork watch
        anew)."""
        return self.baseline.objects[0] is namespace and not FORKS.unseen_children()

    def update(self, namespace: dict[str, Any], synced: dict[str, Any], moved: Moved) -> bool:
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
        starts = _new_children(baseline, indices)
        if starts is None:
            return False
        objects, storages = len(baseline.objects), len(baseline.storages)
        new = sorted(n for n in synced if n not in self.synced or n in rebound)
        baseline.grow([*starts, *((synced[n], 0, n) for n in new)])
        written = {j for j in map(baseline.find_storage, moved.storages) if j is not None}
        written |= set(range(storages, len(baseline.storages)))
        scan = True
        if written:
            kept = [d for j, d in enumerate(snapshot.storages) if j not in written]
            scan = before_long_lived_snapshot([baseline.storages[j] for j in written], kept)
            if not scan:  # a new shadow shares every page again: each storage digested anew, cheaply
                written = set(range(len(baseline.storages)))
        snapshot.retake(baseline, [*indices, *range(objects, len(baseline.objects))], sorted(written), scan)
        self.synced = synced
        return True


@dataclass
class Moved:
    """What a task changed in the notebook (the push applied there by plain cells, the master's
    changes brought back): the objects whose state changed, and the storages written."""

    objects: list[Any] = field(default_factory=list)
    storages: list[Any] = field(default_factory=list)

    @classmethod
    def of(cls, changes: Changes | None, registry: Registry | None) -> Moved:
        return cls() if registry is None else cls().plus(changes, registry)

    def plus(self, changes: Changes | None, registry: Registry) -> Moved:
        """These, and the objects and storages ``changes`` (pickled against ``registry``) changed."""
        if changes is None:
            return self
        objects = self.objects + [registry.objects[i] for i, _ in changes.objects]
        return Moved(objects, self.storages + [registry.storages[new.storage] for new in changes.storages])


def _new_children(registry: Registry, indices: list[int]) -> list[tuple[Any, int, str]] | None:
    """What the objects at ``indices`` now hold that ``registry`` lacks, as starts of its walk
    (grow); None if one no longer holds a child at the step it was registered by, or a tensor
    is on a storage it lacks."""
    if not indices:
        return []
    wanted = set(indices)
    held: dict[int, list[int]] = {}  # parent -> the children registered by a step of it
    for j, (parent, _) in enumerate(registry.parents):
        if parent in wanted:
            held.setdefault(parent, []).append(j)
    starts = []
    for i in indices:
        obj, ops = registry.objects[i], OPS[registry.kinds[i]]
        if kind_of(obj) is not registry.kinds[i]:
            return None
        if ops.has_storage and any(registry.find_storage(s) is None for s in tensor_storages(obj)):
            return None
        try:
            steps = ops.children(obj) if ops.children is not None else []
        except Exception:  # noqa: BLE001 - as the walk: left opaque
            return None
        now = {(step, id(child)) for step, child in steps}
        if any((registry.parents[j][1], id(registry.objects[j])) not in now for j in held.get(i, ())):
            return None
        starts += [(child, i, step) for step, child in steps if registry.find(child) is None]
    return starts


_NONE = object()
