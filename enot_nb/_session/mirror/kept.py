"""A session master's snapshot, kept from one cell to the next.

Taking a snapshot costs every object's state and every storage's digest; a cell over the same
objects as the last one starts from the snapshot that cell ended with, taken again only for what
it changed (``KeptSnapshot.finish_retake``, after the answer is sent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from enot_nb._memory import written
from enot_nb._session.mirror import paths
from enot_nb._session.mirror.paths import ObjectSpec, found_again, has_placeholders
from enot_nb._session.tasks import RegistrySpecs
from enot_nb._state.registry import Registry
from enot_nb._state.snapshot import Snapshot


@dataclass
class PendingRetake:
    """A kept snapshot's retake, left for after the cell's answer (see KeptSnapshot.finish_retake)."""

    objects: list[int]
    storages: list[int]
    """The objects and storages (indices) the cell changed: their states and digests are taken again."""
    specs: tuple[bytes, ...] | None = None
    """What the registry was found by, pickled (see KeptSnapshot.found_by)."""
    found: list[ObjectSpec] = field(default_factory=list)
    """The same specs, loaded: the objects the cell changed are found again by them."""


@dataclass
class KeptSnapshot:
    """A long-lived process's snapshot kept from the end of one task to the start of the next (a
    session master's, from cell to cell): a cell over the same objects starts from it instead of
    taking it again, which costs every object's state and every storage's digest. It holds only
    if nothing but the cells changed those objects in between: the holder drops it for any other
    task or a push that changes objects (one that only binds names changes none), and a cell that
    fails keeps none. Only where writes are tracked by the kernel
    (see writes): the shadow fork's renewal and fork watch start with a snapshot taken anew."""

    registry: Registry | None = None
    snapshot: Snapshot | None = None
    specs: tuple[bytes, ...] | None = None
    """What the kept registry was found by (the notebook's specs, pickled: see paths.registry_at),
    where each object had a counterpart here and what the cell it was kept after changed was
    found again by them (paths.found_again: a training step's new ``.grad`` takes the old one's
    index): the next cell sent the same specs finds the same objects (see registry_for). None:
    it must be found again."""
    pending: PendingRetake | None = None
    """What ``keep`` and ``found_by`` left to ``finish_retake``."""

    def registry_for(self, namespace: dict[str, Any], mirror: RegistrySpecs) -> Registry | None:
        """The kept registry, where finding ``mirror``'s specs again would give it: the same
        specs it was found by (see ``specs``), or those and more after them (a list appended
        to: the kept registry and snapshot grow by the new ones' objects, states and digests),
        and each variable at its root still bound to the object it holds there (a push that
        binds names keeps the snapshot, and may have rebound one)."""
        self.finish_retake()
        registry, snapshot, kept, specs = self.registry, self.snapshot, self.specs, mirror.packed
        if (
            registry is None
            or snapshot is None
            or kept is None
            or specs is None
            or registry.objects[0] is not namespace
        ):
            return None
        if specs[: len(kept)] != kept:
            return None
        for i, (parent, step) in enumerate(registry.parents):
            if parent == 0 and namespace.get(step, _NONE) is not registry.objects[i]:
                return None
        if len(specs) > len(kept):
            objects, storages = len(registry.objects), len(registry.storages)
            added = mirror.specs[objects - 1 :]  # a spec for each object but the namespace, in order
            try:
                grown = paths.grown_at(registry, added, mirror.objects, mirror.storages)
                if grown:
                    new_objects, new_storages = range(objects, mirror.objects), range(storages, mirror.storages)
                    snapshot.retake(registry, list(new_objects), list(new_storages), scan_large=True)
            except Exception:  # noqa: BLE001 - half grown: the cell finds its objects anew
                grown = False
            if not grown:
                self.drop()
                return None
            self.specs = specs
        return registry

    def found_by(self, packed: tuple[bytes, ...] | None, specs: list[ObjectSpec]) -> None:
        """After the cell: the specs the kept registry was found by (``packed``: pickled), noted
        at ``finish_retake`` where what the cell changed is found again by them and every object had a
        counterpart (see ``specs``)."""
        if self.pending is not None:
            self.pending.specs, self.pending.found = packed, specs

    def take(self, registry: Registry, scan_large: bool) -> Snapshot:
        """The snapshot of ``registry`` now: the kept one, if it is of the very same objects and
        storages, else one made from it (``carried_over``: what both registries hold keeps its
        state), or taken anew where none is kept; nothing is kept from here until ``keep``."""
        self.finish_retake()
        kept, snapshot = self.registry, self.snapshot
        self.drop()
        if (
            snapshot is None
            or kept is None
            or not written.marks_hold()  # untracked, or a child we did not fork: taken anew
        ):
            return Snapshot.take(registry, scan_large)
        return (
            snapshot if _same_objects(kept, registry) else snapshot.carried_over(kept, registry, scan_large=scan_large)
        )

    def drop(self) -> None:
        """Something else may change the objects (see the class's docstring)."""
        self.registry = self.snapshot = self.specs = self.pending = None

    def keep(self, registry: Registry, snapshot: Snapshot, objects: list[int], storages: list[int]) -> None:
        """After a cell that ended well: its snapshot, to be taken again (at ``finish_retake``) for the
        objects and storages (indices) that it changed (none is kept where writes are not
        tracked)."""
        if not written.kernel_tracks_writes():
            return
        self.registry, self.snapshot = registry, snapshot
        self.pending = PendingRetake(objects, storages)

    def finish_retake(self) -> None:
        """What ``keep`` and ``found_by`` left, done: after the cell's answer is sent (the notebook
        applies it meanwhile), or before the kept snapshot is used. A failure drops it (the
        answer is sent: this must not make a second one)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        registry, snapshot = self.registry, self.snapshot
        if registry is None or snapshot is None:
            return
        objects, storages = pending.objects, pending.storages
        try:
            # Found again where the specs are known (else the next cell finds its objects anew)
            again = found_again(registry, pending.found, objects) if pending.specs is not None else None
            if again is not None:
                objects, storages = [*objects, *again.objects], sorted({*storages, *again.storages})
            snapshot.retake(registry, objects, storages, scan_large=True)
        except Exception:  # noqa: BLE001 - the next cell takes its snapshot anew
            self.drop()
            return
        if again is not None and not has_placeholders(registry) and not snapshot.untaken(registry):
            self.specs = pending.specs


def _same_objects(a: Registry, b: Registry) -> bool:
    """The same objects and storages at the same indices (a placeholder for an object a rank
    lacks is a new one each time: never the same)."""
    return (
        len(a.objects) == len(b.objects)
        and len(a.storages) == len(b.storages)
        and a.kinds == b.kinds  # a list grown into an atoms container has another kind of state
        and all(x is y for x, y in zip(a.objects, b.objects))
        and all(x is y for x, y in zip(a.storages, b.storages))
    )


_NONE = object()
