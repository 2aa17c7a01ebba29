"""The master's record of the registry before the cell, and what changed since.

Before the cell, each registered object's shallow state (its kind's ``snapshot``: shallow copies
of containers and ``__dict__``s, tensor metadata, a digest of every array) and a digest of every
storage (see digests: which pages this process owns). After it, the objects whose shallow state
is no longer the same, and the storages whose bytes changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from enot_nb._memory import written
from enot_nb._memory.digests import StorageDigest, changed_storages, storage_digests
from enot_nb._state.kinds import OPS
from enot_nb._state.registry import Registry


@dataclass
class Snapshot:
    """The master's record of the registry before the cell."""

    states: list[Any]
    """Each object's shallow state (a record of states, or a digest); None: not tracked."""
    storages: list[StorageDigest]

    @classmethod
    def take(cls, registry: Registry, scan_large: bool = False) -> Snapshot:
        """``scan_large``: see digests.storage_digests (a long-lived process's snapshot)."""
        written.start_fork_watch()
        states = [_state_of(obj, kind) for obj, kind in zip(registry.objects, registry.kinds)]
        return cls(states, storage_digests(registry.storages, scan_large))

    def retake(self, registry: Registry, objects: list[int], storages: list[int], scan_large: bool = False) -> None:
        """Take again the states of ``objects`` and the digests of ``storages`` (indices into
        ``registry``, which may have grown since: the new ones must be among them), the rest
        kept: a long-lived process's record after a task that changed only these."""
        self.states.extend([None] * (len(registry.objects) - len(self.states)))
        for i in sorted({*objects, *self.untaken(registry)}):  # a state that could not be taken is tried again
            self.states[i] = _state_of(registry.objects[i], registry.kinds[i])
        found = storage_digests([registry.storages[j] for j in storages], scan_large)
        digests: dict[int, StorageDigest] = dict(enumerate(self.storages)) | dict(zip(storages, found))
        assert len(digests) == len(registry.storages), "a new storage left out"
        self.storages = [digests[j] for j in range(len(registry.storages))]

    def carried_over(
        self,
        before: Registry,
        registry: Registry,
        moved: Iterable[Any] = (),
        written: Iterable[Any] = (),
        scan_large: bool = True,
    ) -> Snapshot:
        """This snapshot (of ``before``) made one of ``registry``: each object and storage that
        both hold keeps its state or digest, unless it is in ``moved`` (objects) or ``written``
        (storages), changed since; the rest are taken now (``scan_large``: see storage_digests).
        On the terms retake is used on (a long-lived process whose writes are tracked: see
        a session's KeptSnapshot and Record): a cell that makes new objects (a training step's new
        ``.grad`` tensors) changes the registry, and the states and digests of the rest cost
        nothing again."""
        moved_ids, written_ids = {id(obj) for obj in moved}, {id(storage) for storage in written}
        states = []
        for obj, kind in zip(registry.objects, registry.kinds):
            i = before.find(obj)
            same = i is not None and before.kinds[i] is kind and id(obj) not in moved_ids
            state = self.states[i] if same and i is not None else None  # (i: for the type checker)
            states.append(state if state is not None else _state_of(obj, kind))
        at = [None if id(s) in written_ids else before.find_storage(s) for s in registry.storages]
        fresh = [j for j, i in enumerate(at) if i is None]
        found = dict(zip(fresh, storage_digests([registry.storages[j] for j in fresh], scan_large)))
        return Snapshot(states, [found[j] if i is None else self.storages[i] for j, i in enumerate(at)])

    def untaken(self, registry: Registry, indices: Iterable[int] | None = None) -> list[int]:
        """The objects at ``indices`` (default: all) whose kind has a state that could not be
        taken here: nothing compares them, so a change to one goes unseen."""
        at = range(len(self.states)) if indices is None else indices
        return [i for i in at if self.states[i] is None and OPS[registry.kinds[i]].snapshot is not None]

    def changed_objects(self, registry: Registry, within: Iterable[int] | None = None) -> list[int]:
        """The objects whose state changed (``within``: of these indices only)."""
        changed = []
        for i in range(len(registry.objects)) if within is None else sorted(within):
            obj, kind = registry.objects[i], registry.kinds[i]
            before, ops = self.states[i], OPS[kind]
            if before is None or ops.snapshot is None:
                continue
            try:
                if ops.changed is not None:
                    if ops.changed(obj, before):
                        changed.append(i)
                    continue
                now = ops.snapshot(obj)
            except Exception:  # noqa: BLE001 - an object that resists inspection is left untracked
                continue
            try:
                same = ops.same(before, now)
            except Exception:  # noqa: BLE001 - states that cannot be compared: it changed
                same = False
            if not same:
                changed.append(i)
        return changed

    def changed_storages(self, registry: Registry, within: Iterable[int] | None = None) -> list[int]:
        """The storages whose bytes changed (``within``: of these indices only)."""
        if within is None:
            return changed_storages(registry.storages, self.storages)
        at = sorted(within)
        found = changed_storages([registry.storages[j] for j in at], [self.storages[j] for j in at])
        return [at[k] for k in found]


def _state_of(obj: Any, kind: Any) -> Any:
    snapshot = OPS[kind].snapshot
    try:
        return None if snapshot is None else snapshot(obj)
    except Exception:  # noqa: BLE001 - left untracked, as an opaque object
        return None


class SnapshotKeeper(Protocol):
    """Where a long-lived process keeps its snapshot from one cell to the next (a session
    master's: see _session/mirror/kept.py); a one-off cell has none and takes it anew."""

    def take(self, registry: Registry, scan_large: bool) -> Snapshot:
        """The snapshot of ``registry`` now, from the kept one where it still holds."""
        ...

    def keep(self, registry: Registry, snapshot: Snapshot, objects: list[int], storages: list[int]) -> None:
        """After a cell that ended well: its snapshot, and what it changed (indices)."""
        ...
