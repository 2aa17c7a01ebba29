"""What a cell changed, as the master sends it and the notebook applies it.

Master (worker side)::

    Snapshot before the cell -> the cell -> Changes: names (re)bound and deleted, the registered
    objects whose shallow state changed (with their new state), the storages whose bytes changed
    -> pickled by StatePickler: a registered object travels as ("o", index), a registered
    storage as ("s", index); everything new travels by value (tensor bytes out of band)

Notebook (see apply)::

    StateUnpickler resolves the indices to the notebook's own objects -> apply_changes:
    storage bytes copied in place, tensor metadata (.data, requires_grad, .grad), containers,
    attributes, closures and classes updated in place, then names bound and deleted.

So unchanged objects never travel and keep their identity, new objects refer to the
notebook's own objects, and every other reference to a changed object sees the change.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any

from enot_nb._serialize import pickling
from enot_nb._state import objgraph
from enot_nb._state.objgraph import Registry


class _Keep:
    """Stands for an attribute or item that could not come back: the notebook keeps its own."""

    def __reduce__(self) -> str:
        return "KEEP"


KEEP = _Keep()


@dataclass
class Changes:
    """Everything the notebook must change to hold what the master holds."""

    bound: dict[str, Any] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    objects: list[tuple[int, Any]] = field(default_factory=list)
    """(registry index, new shallow state) of each registered object that changed."""
    storages: list[tuple[int, Any]] = field(default_factory=list)
    """(storage index, its new bytes)."""
    value: Any = None
    has_value: bool = False


@dataclass
class PickledState:
    """Changes pickled against a registry; the buffers travel out of band (see pickling)."""

    main: bytes
    buffers: list[Any]


# ----------------------------------------------------------------------------- master side


def collect(
    registry: Registry,
    snapshot: objgraph.Snapshot,
    names_before: dict[str, Any],
    namespace: dict[str, Any],
    hidden: Any = (),
) -> tuple[Changes, list[int]]:
    """The changes the cell made; also the indices of the changed objects (for their names)."""
    changes = Changes()
    now = objgraph.user_variables(namespace, hidden)
    changes.bound = {n: v for n, v in now.items() if names_before.get(n, _MISSING) is not v}
    changes.deleted = [n for n in names_before if n not in now]
    changed = snapshot.changed_objects(registry)
    for i in changed:
        changes.objects.append((i, _new_state(registry.objects[i], registry.kinds[i])))
    # By value, as a buffer: the storage itself would travel as a reference to the notebook's.
    changes.storages = [
        (j, pickle.PickleBuffer(pickling.storage_array(registry.storages[j])))
        for j in snapshot.changed_storages(registry)
    ]
    return changes, changed


_MISSING = object()


def _new_state(obj: Any, kind: str) -> Any:
    if kind == "ndarray":
        return obj.copy()  # by value: the object itself would travel as a reference
    if kind == "bytearray":
        return bytes(obj)
    if kind == "array":  # array.array
        return obj.tobytes()
    if kind == "rng":
        return objgraph.rng_state(obj)
    return objgraph.shallow_state(obj, kind)


class StatePickler(pickling.TensorPickler):
    """Pickles Changes: registered objects and storages by reference (their index)."""

    def __init__(self, file: Any, mode: str, buffer_callback: Any = None, *, registry: Registry) -> None:
        super().__init__(file, mode, buffer_callback=buffer_callback, namespace=registry.objects[0])
        self.registry = registry
        self._arrays: dict[int, list[Any]] | None = None

    def known_arrays(self) -> list[Any]:
        return [obj for obj, kind in zip(self.registry.objects, self.registry.kinds) if kind == "ndarray"]

    def is_known(self, array: Any, root: Any) -> Any:
        if self._arrays is None:
            self._arrays = {}
            for obj in self.known_arrays():
                if obj.flags.c_contiguous:
                    self._arrays.setdefault(id(pickling.array_owner(obj)), []).append(obj)
        start, end = _extent(array)
        for known in self._arrays.get(id(root), ()):
            known_start, known_end = _extent(known)
            if known_start <= start and end <= known_end:
                return known
        return None

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in objgraph._ATOMS:  # never registered: skip the lookups
            return None
        i = self.registry.find(obj)
        if i is not None:
            return ("o", i)
        j = self.registry.find_storage(obj)
        if j is not None:
            return ("s", j)
        return None


def _extent(array: Any) -> tuple[int, int]:
    """The addresses of the first and after the last byte an array can reach."""
    start = end = array.__array_interface__["data"][0]
    for size, stride in zip(array.shape, array.strides):
        if size == 0:
            return start, start
        reach = (size - 1) * stride
        start, end = (start + reach, end) if stride < 0 else (start, end + reach)
    return start, end + array.itemsize


def dump(changes: Changes, registry: Registry, not_returned: dict[str, str]) -> tuple[PickledState, int]:
    """Pickle the changes; what cannot be pickled is left out and named in ``not_returned``."""
    try:
        off_cpu = _dry(changes, registry)
    except Exception:  # noqa: BLE001 - find the culprits, then pickle the rest
        _leave_out_unpicklable(changes, registry, not_returned)
        off_cpu = _dry(changes, registry)
    buffers: list[Any] = []
    stream = io.BytesIO()
    StatePickler(stream, "result", buffer_callback=buffers.append, registry=registry).dump(changes)
    return PickledState(stream.getvalue(), buffers), off_cpu


def _dry(obj: Any, registry: Registry) -> int:
    return pickling.dry_run(obj, pickler_class=StatePickler, registry=registry)


def _reason(value: Any, registry: Registry) -> str | None:
    try:
        _dry(value, registry)
    except Exception as err:  # noqa: BLE001 - any failure means it cannot come back
        return f"{type(value).__name__} cannot be pickled: {err}"
    return None


def _leave_out_unpicklable(changes: Changes, registry: Registry, not_returned: dict[str, str]) -> None:
    for name, value in list(changes.bound.items()):
        reason = _reason(value, registry)
        if reason:
            not_returned[name] = reason
            del changes.bound[name]
    kept = []
    for i, state in changes.objects:
        if _reason(state, registry) is None:
            kept.append((i, state))
            continue
        state = _keep_what_pickles(i, registry, state, not_returned)
        if state is not None:
            kept.append((i, state))
    changes.objects = kept
    if changes.has_value and _reason(changes.value, registry):
        changes.value, changes.has_value = None, False  # shown from its display data instead


def _keep_what_pickles(i: int, registry: Registry, state: Any, not_returned: dict[str, str]) -> Any:
    """Leave out the attributes or items of a changed object that cannot be pickled."""
    kind, path = registry.kinds[i], registry.path(i)
    if kind in ("object", "partial", "dict") and state[-1][0] is not None:
        attributes = dict(state[-1][0])
        for key, value in attributes.items():
            reason = _reason(value, registry)
            if reason:
                not_returned[f"{path}.{key}"] = reason
                attributes[key] = KEEP
        state = (*state[:-1], (attributes, state[-1][1]))
    if kind == "dict":
        items = []
        for key, value in state[0]:
            key_reason = _reason(key, registry)
            reason = _reason(value, registry) or key_reason
            if reason:
                not_returned[f"{path}[{key!r}]"] = reason
                value = KEEP
            items.append((KEEP if key_reason else key, value))
        state = ([(k, v) for k, v in items if k is not KEEP], *state[1:])
    reason = _reason(state, registry)
    if reason:
        not_returned[path] = reason
        return None
    return state
