"""What a cell changed, as the master sends it and the notebook applies it.

Master (worker side)::

    Snapshot before the cell -> the cell -> Changes: names (re)bound and deleted, the registered
    objects whose shallow state changed (with their new state), the storages whose bytes changed
    -> pickled by StatePickler: a registered object travels as ("o", index), a registered
    storage as ("s", index); everything new travels by value (tensor bytes out of band)

Notebook::

    StateUnpickler resolves the indices to the notebook's own objects -> apply_changes:
    storage bytes copied in place, tensor metadata (.data, requires_grad, .grad), containers,
    attributes, closures and classes updated in place, then names bound and deleted.

So unchanged objects never travel and keep their identity, new objects refer to the
notebook's own objects, and every other reference to a changed object sees the change.
"""

from __future__ import annotations

import io
import pickle
import sys
from dataclasses import dataclass, field
from typing import Any

from enot_nb import _objgraph, _pickling
from enot_nb._objgraph import Registry


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
    """Changes pickled against a registry; the buffers travel out of band (see _pickling)."""

    main: bytes
    buffers: list[Any]


# ----------------------------------------------------------------------------- master side


def collect(registry: Registry, snapshot: _objgraph.Snapshot, names_before: dict[str, Any],
            namespace: dict[str, Any], hidden: Any = ()) -> tuple[Changes, list[int]]:
    """The changes the cell made; also the indices of the changed objects (for their names)."""
    changes = Changes()
    now = {n: v for n, v in namespace.items() if _objgraph.is_user_name(n, hidden)}
    changes.bound = {n: v for n, v in now.items() if names_before.get(n, _MISSING) is not v}
    changes.deleted = [n for n in names_before if n not in now]
    changed = snapshot.changed_objects(registry)
    for i in changed:
        changes.objects.append((i, _new_state(registry.objects[i], registry.kinds[i])))
    # By value, as a buffer: the storage itself would travel as a reference to the notebook's.
    changes.storages = [(j, pickle.PickleBuffer(_pickling.storage_bytes(registry.storages[j]).numpy()))
                        for j in snapshot.changed_storages(registry)]
    return changes, changed


_MISSING = object()


def _new_state(obj: Any, kind: str) -> Any:
    if kind == "ndarray":
        return obj.copy()  # by value: the object itself would travel as a reference
    if kind == "bytearray":
        return bytes(obj)
    return _objgraph.shallow_state(obj, kind)


class StatePickler(_pickling.TensorPickler):
    """Pickles Changes: registered objects and storages by reference (their index)."""

    def __init__(self, file: Any, mode: str, registry: Registry, buffer_callback: Any = None) -> None:
        super().__init__(file, mode, buffer_callback=buffer_callback, namespace=registry.objects[0])
        self.registry = registry
        self._arrays: dict[int, list[Any]] | None = None

    def is_known(self, array: Any, root: Any) -> Any:
        if self._arrays is None:
            self._arrays = {}
            for obj, kind in zip(self.registry.objects, self.registry.kinds):
                if kind == "ndarray" and obj.flags.c_contiguous:
                    self._arrays.setdefault(id(_owner(obj)), []).append(obj)
        start, end = _extent(array)
        for known in self._arrays.get(id(root), ()):
            known_start, known_end = _extent(known)
            if known_start <= start and end <= known_end:
                return known
        return None

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _ATOMS:
            return None
        i = self.registry.find(obj)
        if i is not None:
            return ("o", i)
        j = self.registry.find_storage(obj)
        if j is not None:
            return ("s", j)
        return None


_ATOMS = (type(None), bool, int, float, str, bytes)


def _owner(array: Any) -> Any:
    while type(array.base).__name__ == "ndarray":
        array = array.base
    return array


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
    StatePickler(stream, "result", registry, buffer_callback=buffers.append).dump(changes)
    return PickledState(stream.getvalue(), buffers), off_cpu


def _dry(obj: Any, registry: Registry) -> int:
    return _pickling.dry_run(obj, pickler_class=_DryStatePickler, registry=registry)


class _DryStatePickler(StatePickler):
    def __init__(self, file: Any, mode: str, buffer_callback: Any = None,
                 registry: Registry | None = None) -> None:
        assert registry is not None
        super().__init__(file, mode, registry, buffer_callback=buffer_callback)


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
    if kind in ("object", "dict") and state[-1][0] is not None:
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
            reason = _reason(value, registry) or _reason(key, registry)
            if reason:
                not_returned[f"{path}[{key!r}]"] = reason
                value = KEEP
            items.append((key if _reason(key, registry) is None else KEEP, value))
        state = ([(k, v) for k, v in items if k is not KEEP], *state[1:])
    reason = _reason(state, registry)
    if reason:
        not_returned[path] = reason
        return None
    return state


# ----------------------------------------------------------------------------- notebook side


class StateUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, registry: Registry, buffers: list[Any]) -> None:
        super().__init__(file, buffers=buffers)
        self.registry = registry

    def persistent_load(self, pid: Any) -> Any:
        kind, index = pid
        return self.registry.objects[index] if kind == "o" else self.registry.storages[index]


def load(state: PickledState, registry: Registry) -> Changes:
    return StateUnpickler(io.BytesIO(state.main), registry, state.buffers).load()


def apply_changes(namespace: dict[str, Any], registry: Registry, changes: Changes,
                  returns: list[str] | None) -> list[str]:
    """Make the notebook hold what the master held; returns a line per thing left unchanged."""
    problems: list[str] = []
    for j, data in changes.storages:
        _copy_into_storage(registry.storages[j], data)
    tensors = [(i, s) for i, s in changes.objects if registry.kinds[i] == "tensor"]
    for i, state in tensors:
        _apply_tensor(registry.objects[i], state, problems, registry.path(i))
    for i, state in tensors:  # after every tensor has its new shape: grads must match it
        _apply_grad(registry.objects[i], state, problems, registry.path(i))
    for i, state in changes.objects:
        kind = registry.kinds[i]
        if kind != "tensor":
            try:
                _APPLY[kind](registry.objects[i], state)
            except Exception as err:  # noqa: BLE001 - say so; the rest still applies
                problems.append(f"{registry.path(i)} could not be updated in place ({err})")
    wanted = (lambda name: True) if returns is None else set(returns).__contains__
    for name, value in changes.bound.items():
        if wanted(name):
            namespace[name] = value
    for name in changes.deleted:
        if wanted(name):
            namespace.pop(name, None)
    return problems


def _copy_into_storage(storage: Any, data: Any) -> None:
    import torch

    source = torch.empty(0, dtype=torch.uint8).set_(_pickling._rebuild_storage(data))
    if storage.nbytes() != source.numel():
        storage.resize_(source.numel())
    target = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    target.copy_(source)


def _apply_tensor(tensor: Any, state: tuple, problems: list[str], path: str) -> None:
    import torch

    _, storage, offset, size, stride, dtype, device, requires_grad, _, attributes = state
    current = _objgraph.tensor_meta(tensor)
    if storage is not None and not (storage is current[1] and (offset, size, stride, dtype)
                                    == tuple(current[2:6])):
        rebuilt = _pickling._rebuild_tensor(storage, offset, size, stride, dtype, False, False)
        if tensor.device != rebuilt.device:
            rebuilt = rebuilt.to(tensor.device)  # a CUDA tensor of a kernel that uses CUDA
        with torch.no_grad():
            tensor.data = rebuilt
    if tensor.requires_grad != requires_grad:
        if tensor.is_leaf:
            tensor.requires_grad_(requires_grad)
        else:
            problems.append(f"{path}: requires_grad could not change on a non-leaf tensor")
    if attributes != (getattr(tensor, "__dict__", None) or {}):
        tensor.__dict__.clear()
        tensor.__dict__.update(attributes)


def _apply_grad(tensor: Any, state: tuple, problems: list[str], path: str) -> None:
    grad = state[8]
    if not tensor.is_leaf or tensor.grad is grad:
        return
    if grad is not None and grad.device != tensor.device:
        grad = grad.to(tensor.device)
    try:
        tensor.grad = grad
    except RuntimeError as err:
        problems.append(f"{path}.grad could not be set ({err})")


def _merge(old: dict, new: dict) -> dict:
    return {k: (old[k] if v is KEEP else v) for k, v in new.items() if not (v is KEEP and k not in old)}


def _apply_attributes(obj: Any, attributes: tuple[dict | None, dict]) -> None:
    new_dict, slots = attributes
    current = _objgraph._object_dict(obj)
    if current is not None and new_dict is not None:
        merged = _merge(current, new_dict)
        current.clear()
        current.update(merged)
    for name, value in slots.items():
        if value is not KEEP:
            object.__setattr__(obj, name, value)


def _apply_dict(obj: dict, state: tuple) -> None:
    items, factory, attributes = state
    merged = _merge(dict(obj), dict(items)) if any(v is KEEP for _, v in items) else dict(items)
    obj.clear()
    obj.update(merged)
    if hasattr(obj, "default_factory"):
        obj.default_factory = factory
    _apply_attributes(obj, attributes)


def _apply_list(obj: list, state: tuple) -> None:
    obj[:] = state[0]
    _apply_attributes(obj, state[1])


def _apply_deque(obj: Any, state: tuple) -> None:
    obj.clear()
    obj.extend(state[0])
    _apply_attributes(obj, state[1])


def _apply_set(obj: set, state: tuple) -> None:
    obj.clear()
    obj.update(state[0])
    _apply_attributes(obj, state[1])


def _apply_object(obj: Any, state: tuple) -> None:
    new_type, attributes = state
    if type(obj) is not new_type:
        obj.__class__ = new_type
    _apply_attributes(obj, attributes)


def _apply_ndarray(obj: Any, new: Any) -> None:
    if obj.shape != new.shape or obj.dtype != new.dtype:
        raise ValueError(f"its shape or dtype changed to {new.shape}, {new.dtype}; "
                         "assign the array to a name to bring it back")
    obj[...] = new


def _apply_bytearray(obj: bytearray, new: bytes) -> None:
    obj[:] = new


def _apply_function(obj: Any, state: tuple) -> None:
    code, defaults, kwdefaults, attributes = state
    obj.__code__, obj.__defaults__, obj.__kwdefaults__ = code, defaults, kwdefaults
    obj.__dict__.clear()
    obj.__dict__.update(attributes)


def _apply_class(cls: type, attributes: dict) -> None:
    current = _objgraph.class_attributes(cls)
    for name in current:
        if name not in attributes:
            delattr(cls, name)
    for name, value in attributes.items():
        if current.get(name, _MISSING) is not value and value is not KEEP:
            setattr(cls, name, value)


def _apply_cell(cell: Any, state: tuple) -> None:
    if state:
        cell.cell_contents = state[0]
    else:
        del cell.cell_contents


_APPLY = {"dict": _apply_dict, "list": _apply_list, "deque": _apply_deque, "set": _apply_set,
          "object": _apply_object, "ndarray": _apply_ndarray, "bytearray": _apply_bytearray,
          "function": _apply_function, "class": _apply_class, "cell": _apply_cell}


def shared_memory_tensors(registry: Registry) -> int:
    """How many of the registered tensors live in memory shared with other processes."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    return sum(1 for obj, kind in zip(registry.objects, registry.kinds)
               if kind == "tensor" and obj.device.type == "cpu" and obj.is_shared())
