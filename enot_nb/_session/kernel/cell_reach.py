"""What a session cell reaches in the notebook, and the specs of it that the master finds its own
objects by; the next cell may use both again, while nothing they were made from can have changed.

Walking what a cell reaches and writing the paths of it cost about 4 ms per thousand objects,
every cell, even for a cell that changes nothing (an evaluation over a large model). A cell's
reach is the same as the last cell's where:

    the code names the same names                          (reach.cell_names)
    each name the walk looked up holds what it found then  (reach.bound_as_looked_up: the same
                                                            object, an atom both times, or absent)
    none of the reached objects changed since the walk     (below)

The last is told by the push's comparison of the record (see _session/mirror/mirror): it sees any change
to the record's objects and storages since the last sync. So a reach is kept only after a cell
whose changes leave it what a walk gives (the bytes it wrote move nothing; an object whose new
children took its old ones' places, a training step's new ``.grad``, is updated as the record
is, see record.replaced_in_place), and only if the record holds every object and storage of it.
The master keeps its registry where what the cell changed is found again by the same specs
(see kept.KeptSnapshot.registry_for, paths.found_again).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from enot_nb._session.mirror import paths
from enot_nb._session.mirror.mirror import SinceSync
from enot_nb._session.mirror.record import Record, TaskChanges, grown_in_place
from enot_nb._session.tasks import RegistrySpecs
from enot_nb._state import reach


@dataclass
class CellReach:
    """A cell's reach, and its specs once made (see the module's docstring)."""

    names: reach.CodeNames
    found: reach.Reach
    """The walk's result."""
    mirror: RegistrySpecs | None = None

    @classmethod
    def of(
        cls,
        namespace: dict[str, Any],
        code: str,
        hidden: Any,
        since: SinceSync | None,
        kept: CellReach | None,
        rank_only: Collection[str] = (),
        synced: Collection[str] = (),
        also: Collection[str] = (),
    ) -> CellReach:
        """``code``'s reach: ``kept`` (the last cell's) where it holds still, else walked. A
        cell that reaches a variable that lives only on the ranks (``rank_only``: a DDP
        wrapper, a Trainer) may reach through it what the notebook holds under other names
        (``ddp.module`` is ``model``, with its buffers and ``training`` flags): its reach takes
        in every variable the ranks hold (``synced``), so that the master compares them and
        sends what changed under the notebook's own paths. ``also``: variables it takes in
        beside the code's (see Mirror.arrays_over_new_storages)."""
        names = reach.cell_names(code)
        if also:
            names = reach.CodeNames(names.names | frozenset(also), names.dynamic)
        if kept is not None and kept.holds(namespace, names, hidden, since):
            return kept
        found = reach.reach(namespace, code, hidden, found=names)
        through = [n for n, value in found.looked_up.items() if value is reach.ABSENT and n in rank_only]
        if through and found.whole is None and set(synced) - set(found.names):
            wider = reach.CodeNames(names.names | frozenset(synced), names.dynamic)
            found = reach.reach(namespace, code, hidden, found=wider)
        return cls(names, found)

    def specs(self) -> RegistrySpecs:
        if self.mirror is None:
            self.mirror = paths.mirrored(self.found.registry)
        return self.mirror

    def holds(self, namespace: dict[str, Any], names: reach.CodeNames, hidden: Any, since: SinceSync | None) -> bool:
        """Whether a fresh walk for a cell with ``names`` would give this reach again (``since``:
        the push's comparison, None where there is no record)."""
        registry = self.found.registry
        return (
            since is not None
            and names == self.names
            and reach.bound_as_looked_up(self.found, namespace, hidden)
            and not any(registry.find(obj) is not None for obj in since.moved.objects)
            and not any(registry.find_storage(storage) is not None for storage in since.moved.storages)
        )

    def kept_after(self, moved: TaskChanges, record: Record) -> CellReach | None:
        """After the cell ended well: this reach, for the next cell, if what the cell changed of
        it (``moved``: what came back) leaves it what a walk gives (bytes written; objects
        whose new children took the old ones' places, see record.replaced_in_place), it was
        not a walk of every name (code that reads names dynamically), and ``record`` holds all
        of it, each state taken; else None. Its specs are made again where it moved (a storage
        may have been resized), and kept where they are the same: the master then knows them."""
        registry, baseline, snapshot = self.found.registry, record.baseline, record.snapshot
        if self.found.whole is not None or self.found.left_out:
            return None
        if snapshot is None or baseline.objects[0] is not registry.objects[0]:
            return None
        changed = sorted({i for i in map(registry.find, moved.objects) if i is not None and i > 0})
        objects, storages = len(registry.objects), len(registry.storages)
        replaced = grown_in_place(registry, changed) if changed else []
        if replaced is None:
            return None
        at = [baseline.find(obj) for obj in registry.objects[1:]]
        if any(i is None for i in at) or any(baseline.find_storage(s) is None for s in registry.storages):
            return None
        if snapshot.untaken(baseline, [i for i in at if i is not None]):
            return None
        if moved.objects or moved.storages:
            self.mirror = self._specs_after(changed, replaced, moved.storages, objects, storages)
        return self

    def _specs_after(
        self, changed: list[int], replaced: list[int], written: list[Any], objects: int, storages: int
    ) -> RegistrySpecs | None:
        """The specs again, where the cell moved them (``objects`` and ``storages``: the counts
        before the registry grew): made anew for the objects it changed or replaced, those on a
        storage it wrote (one may have been resized) and those new; where only new ones were
        added (a list appended to), the last specs with theirs after (see RegistrySpecs.grown)."""
        registry, old = self.found.registry, self.mirror
        if old is None:
            return None
        count = len(registry.objects)
        written_at = {j for j in map(registry.find_storage, written) if j is not None and j < storages}
        on_written = [spec.at for spec in old.specs if written_at.intersection(spec.storages)] if written_at else []
        remade = {*changed, *replaced, *on_written, *range(objects, count)}  # (a storage may be resized)
        specs = {spec.at: spec for spec in paths.specs_of(registry, sorted(remade))}
        added = [specs[i] for i in range(objects, count)]
        if all(old.specs[i - 1] == spec for i, spec in specs.items() if i < objects):  # (specs[i - 1].at == i)
            return old.grown(added, count, len(registry.storages)) if added else old
        again = [specs.get(spec.at, spec) for spec in old.specs]
        return RegistrySpecs(again + added, count, len(registry.storages))
