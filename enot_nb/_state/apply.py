"""The notebook's side of a cell's changes: resolved against its own objects, applied in place.

The master sends Changes pickled against the registry (see collect); here every index becomes
the notebook's own object, then each change is made to that object, in place, so that every
other reference to it sees the change.
"""

from __future__ import annotations

import array
import io
import pickle
import sys
import warnings
from typing import Any

from enot_nb._serialize import pickling
from enot_nb._state import objgraph
from enot_nb._state.collect import _MISSING, KEEP, Changes, PickledState
from enot_nb._state.objgraph import Registry


class StateUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, registry: Registry, buffers: list[Any]) -> None:
        super().__init__(file, buffers=buffers)
        self.registry = registry

    def persistent_load(self, pid: Any) -> Any:
        kind, index = pid
        return self.registry.objects[index] if kind == "o" else self.registry.storages[index]


def load(state: PickledState, registry: Registry) -> Changes:
    # Rebuilding objects can warn (a library's deprecated constructor): the worker already showed
    # what the cell's own code warned; a local cell would show nothing more.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return StateUnpickler(io.BytesIO(state.main), registry, state.buffers).load()


def apply_changes(
    namespace: dict[str, Any], registry: Registry, changes: Changes, returns: list[str] | None
) -> list[str]:
    """Make the notebook hold what the master held; returns a line per thing left unchanged."""
    problems: list[str] = []

    def attempt(what: str, change: Any, *args: Any) -> None:
        try:
            change(*args)
        except Exception as err:  # noqa: BLE001 - say so; the rest still applies
            problems.append(f"{what} could not be updated in place ({type(err).__name__}: {err})")

    for j, data in changes.storages:
        attempt(f"the data of storage {j}", _copy_into_storage, registry.storages[j], data)
    tensors = [(i, s) for i, s in changes.objects if registry.kinds[i] == "tensor"]
    for i, state in tensors:
        attempt(registry.path(i), _apply_tensor, registry.objects[i], state, problems, registry.path(i))
    for i, state in tensors:  # after every tensor has its new shape: grads must match it
        attempt(f"{registry.path(i)}.grad", _apply_grad, registry.objects[i], state)
    for i, state in changes.objects:
        kind = registry.kinds[i]
        if kind != "tensor":
            attempt(registry.path(i), _APPLY[kind], registry.objects[i], state)
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

    source = torch.empty(0, dtype=torch.uint8).set_(pickling._rebuild_storage(data))
    if storage.nbytes() != source.numel():
        storage.resize_(source.numel())
    target = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    target.copy_(source)


def _apply_tensor(tensor: Any, state: tuple, problems: list[str], path: str) -> None:
    import torch

    _, storage, offset, size, stride, dtype, device, requires_grad, _, attributes = state
    current = objgraph.tensor_meta(tensor)
    if storage is not None and not (storage is current[1] and (offset, size, stride, dtype) == tuple(current[2:6])):
        rebuilt = pickling._rebuild_tensor(storage, offset, size, stride, dtype, False, False)
        if device.type != "cpu" and tensor.device.type != "cpu":
            rebuilt = rebuilt.to(tensor.device)  # stays on the GPU of a kernel that uses CUDA
        with torch.no_grad():
            tensor.data = rebuilt
    if tensor.requires_grad != requires_grad:
        if tensor.is_leaf:
            tensor.requires_grad_(requires_grad)
        else:
            problems.append(f"{path}: requires_grad could not change on a non-leaf tensor")
    if not objgraph._same_dict(attributes, getattr(tensor, "__dict__", None) or {}):
        tensor.__dict__.clear()
        tensor.__dict__.update(attributes)


def _apply_grad(tensor: Any, state: tuple) -> None:
    grad = state[8]
    if not tensor.is_leaf or tensor.grad is grad:
        return
    if grad is not None and grad.device != tensor.device:
        grad = grad.to(tensor.device)
    tensor.grad = grad


def _merge(old: dict, new: dict) -> dict:
    return {k: (old[k] if v is KEEP else v) for k, v in new.items() if not (v is KEEP and k not in old)}


def _apply_attributes(obj: Any, attributes: tuple[dict | None, dict]) -> None:
    new_dict, slots = attributes
    current = objgraph._object_dict(obj)
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
        _reshape_in_place(obj, new)
    obj[...] = new


def _reshape_in_place(obj: Any, new: Any) -> None:
    """As the cell did (``arr.shape = ...``, ``arr.dtype = ...``, ``arr.resize(...)``), where
    NumPy allows it for this array: checked first, so that nothing is half done."""
    import numpy

    resize = obj.nbytes != new.nbytes
    if not obj.flags.c_contiguous or resize and not obj.flags.owndata:
        raise ValueError(
            f"its shape or dtype changed to {new.shape}, {new.dtype}, which NumPy "
            "cannot do in place for this array; assign the array to a name to bring "
            "it back"
        )
    obj.shape = (obj.size,)
    obj.dtype = numpy.uint8  # its bytes, as a 1-d array: from here every step is allowed
    if resize:
        obj.resize(new.nbytes, refcheck=False)
    obj.dtype = new.dtype
    obj.shape = new.shape


def _apply_bytearray(obj: bytearray, new: bytes) -> None:
    obj[:] = new


def _apply_array(obj: Any, new: bytes) -> None:
    """An ``array.array``: same typecode, new items (assigned in place when the length is the
    same, so that a memoryview of it stays valid)."""
    items = array.array(obj.typecode)
    items.frombytes(new)
    obj[:] = items


def _apply_function(obj: Any, state: tuple) -> None:
    code, defaults, kwdefaults, attributes = state
    obj.__code__, obj.__defaults__, obj.__kwdefaults__ = code, defaults, kwdefaults
    obj.__dict__.clear()
    obj.__dict__.update(attributes)


def _apply_class(cls: type, attributes: dict) -> None:
    current = objgraph.class_attributes(cls)
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


_APPLY = {
    "rng": objgraph.set_rng_state,
    "dict": _apply_dict,
    "list": _apply_list,
    "deque": _apply_deque,
    "set": _apply_set,
    "object": _apply_object,
    "partial": _apply_object,
    "ndarray": _apply_ndarray,
    "bytearray": _apply_bytearray,
    "array": _apply_array,
    "function": _apply_function,
    "class": _apply_class,
    "cell": _apply_cell,
}


def shared_memory_tensors(registry: Registry) -> int:
    """How many of the registered tensors live in memory shared with other processes."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    return sum(
        1
        for obj, kind in zip(registry.objects, registry.kinds)
        if kind == "tensor" and obj.device.type == "cpu" and obj.is_shared()
    )
