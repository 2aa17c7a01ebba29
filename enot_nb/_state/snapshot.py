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
        states = [_state_of(obj, kind) for obj, kind in zip(registry.objects, registry.kinds)]
        return cls(states, storage_digests(registry.storages, scan_large))

    def retake(self, registry: Registry, objects: list[int], storages: list[int], scan_large: bool = False) -> None:
        """Take again the states of ``objects`` and the digests of ``storages`` (indices into
        ``registry``, which may have grown since: the new ones must be among them), the rest
        kept: a long-lived process's record after a task that changed only these."""
        self.states.extend([None] * (len(registry.objects) - len(self.states)))
        for i in objects:
            self.states[i] = _state_of(registry.objects[i], registry.kinds[i])
        found = storage_digests([registry.storages[j] for j in storages], scan_large)
        digests: dict[int, StorageDigest] = dict(enumerate(self.storages)) | dict(zip(storages, found))
        assert len(digests) == len(registry.storages), "a new storage left out"
        self.storages = [digests[j] for j in range(len(registry.storages))]

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


def _state_of(obj: Any, kind: Any) -> Any:
    snapshot = OPS[kind].snapshot
    try:
        return None if snapshot is None else snapshot(obj)
    except Exception:  # noqa: BLE001 - left untracked, as an opaque object
        return None
