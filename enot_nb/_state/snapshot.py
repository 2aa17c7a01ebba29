"""The master's record of the registry before the cell, and what changed since.

Before the cell, each registered object's shallow state (its kind's ``snapshot``: shallow copies
of containers and ``__dict__``s, tensor metadata, a digest of every array) and a digest of every
storage (see digests: which pages this process owns). After it, the objects whose shallow state
is no longer the same, and the storages whose bytes changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from enot_nb._state.digests import StorageDigest, changed_storages, storage_digests, watch_forks
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
        watch_forks()
        states = []
        for obj, kind in zip(registry.objects, registry.kinds):
            snapshot = OPS[kind].snapshot
            try:
                states.append(None if snapshot is None else snapshot(obj))
            except Exception:  # noqa: BLE001 - left untracked, as an opaque object
                states.append(None)
        return cls(states, storage_digests(registry.storages, scan_large))

    def changed_objects(self, registry: Registry) -> list[int]:
        changed = []
        for i, (obj, kind) in enumerate(zip(registry.objects, registry.kinds)):
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
            if not ops.same(before, now):
                changed.append(i)
        return changed

    def changed_storages(self, registry: Registry) -> list[int]:
        return changed_storages(registry.storages, self.storages)
