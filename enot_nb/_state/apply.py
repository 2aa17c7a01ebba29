"""The notebook's side of a cell's changes: resolved against its own objects, applied in place.

The master sends Changes pickled against the registry (see collect); here every index becomes
the notebook's own object, then each change is made to that object, in place, so that every
other reference to it sees the change.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

from enot_nb._processes.interrupts import interrupts_deferred
from enot_nb._serialize.tensors import bytes_view, storage_array, storage_of
from enot_nb._state import kinds, salvage
from enot_nb._state.collect import Changes, PickledState, StorageBytes, item_at
from enot_nb._state.kinds import OPS, Kind, apply_grad, kind_of_state
from enot_nb._state.registry import Registry
from enot_nb._state.states import VALUE_TYPES


class StateUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, registry: Registry, buffers: list[Any]) -> None:
        super().__init__(file, buffers=buffers)
        self.registry = registry

    def persistent_load(self, pid: Any) -> Any:
        kind, at, *steps = pid
        if kind == "v":  # plain data, pickled whole (see collect.StatePickler)
            return pickle.loads(at)
        if kind == "p":  # an item inside plain data (see collect.StatePickler._in_plain)
            return item_at(self.registry.objects[at], steps[0])
        return self.registry.objects[at] if kind == "o" else self.registry.storages[at]


def load(state: PickledState, registry: Registry) -> Changes:
    # Rebuilding objects can warn (a library's deprecated constructor): the worker already showed
    # what the cell's own code warned; a local cell would show nothing more.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unpickler = StateUnpickler(io.BytesIO(state.main), registry, state.buffers)
        try:
            try:
                return unpickler.load()
            except Exception:  # noqa: BLE001 - one object that cannot be rebuilt here: load the rest
                salvaging = salvage.SalvagingUnpickler(state.main, state.buffers, unpickler.persistent_load)
                changes = salvaging.load()
        finally:
            _end_sparse_loading()
    changes.unloaded = salvage.leave_out(changes, registry, salvaging.unloadable)
    return changes


def _end_sparse_loading() -> None:
    """torch's unpickling of a sparse tensor keeps it in a list, to check at the end of a
    ``torch.load`` (``torch._utils._sparse_tensors_to_validate``); a plain pickle never ends one,
    so every sparse tensor that came back stayed alive there after the notebook dropped it. The
    list is checked (where the user turned the checks on) and emptied, as torch.load does."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch._utils._validate_loaded_sparse_tensors()


def apply_changes(
    namespace: dict[str, Any], registry: Registry, changes: Changes, returns: list[str] | None
) -> list[str]:
    """Make the notebook hold what the master held; returns a line per thing left unchanged.

    With stop presses held to the end (then raised): a press halfway would leave some objects
    updated and others not, and copying to new objects and swapping them in cannot keep the
    storages' identity."""
    with interrupts_deferred():
        return _apply_all(namespace, registry, changes, returns)


def _apply_all(namespace: dict[str, Any], registry: Registry, changes: Changes, returns: list[str] | None) -> list[str]:
    problems: list[str] = list(changes.unloaded)

    def attempt(what: str, change: Callable[..., None], *args: Any) -> None:
        try:
            change(*args)
        except Exception as err:  # noqa: BLE001 - say so; the rest still applies
            problems.append(f"{what} could not be updated in place ({type(err).__name__}: {err})")

    def apply(i: int, state: Any) -> None:
        change = OPS[kind_of_state(registry.kinds[i], registry.objects[i], state)].apply
        if change is None:  # a kind that is never tracked, so never changed
            return
        path = registry.path(i)

        def note(text: str) -> None:
            problems.append(f"{path}: {text}")

        attempt(path, change, registry.objects[i], state, note)

    for new in changes.storages:
        attempt(f"the data of storage {new.storage}", _copy_into_storage, registry.storages[new.storage], new)
    tensors = [(i, s) for i, s in changes.objects if registry.kinds[i] is Kind.TENSOR]
    for i, state in tensors:
        apply(i, state)
    for i, state in tensors:  # after every tensor has its new shape: grads must match it
        attempt(f"{registry.path(i)}.grad", apply_grad, registry.objects[i], state)
    others = [(i, s) for i, s in changes.objects if registry.kinds[i] is not Kind.TENSOR]
    kinds.PLAIN_MADE = {}
    try:
        for i, state in others:  # plain data first: the new items that went into old ones
            if registry.kinds[i] is Kind.PLAIN:
                apply(i, state)
        made = kinds.PLAIN_MADE
    finally:
        kinds.PLAIN_MADE = None
    for i, state in others:
        if registry.kinds[i] is not Kind.PLAIN:
            apply(i, with_old_items(state, made, registry))
    wanted = (lambda name: True) if returns is None else set(returns).__contains__
    for name, value in changes.bound.items():
        if wanted(name):
            namespace[name] = with_old_items(value, made, registry)
    for name in changes.deleted:
        if wanted(name):
            namespace.pop(name, None)
    return problems


_OLD_ITEMS_DEPTH = 8
"""How deep with_old_items looks inside the new values (an alias is an item of what a cell binds)."""


def with_old_items(value: Any, made: dict[int, Any], registry: Registry, depth: int = _OLD_ITEMS_DEPTH) -> Any:
    """``value`` (a new state or a value bound by the changes), with each new item of plain data
    that went into an old one in place (``made``, see kinds.PLAIN_MADE) replaced by that old one,
    inside the lists, dicts, tuples and objects it holds that came with the changes: ``rec =
    log[998]; L = [rec]`` in a cell that changed ``log`` keeps ``L[0] is log[998]``."""
    if not made:
        return value
    seen: set[int] = set()

    def walk(x: Any, depth: int) -> Any:
        old = made.get(id(x))
        if old is not None:
            return old
        if depth <= 0 or id(x) in seen or type(x) in VALUE_TYPES or registry.find(x) is not None:
            return x
        seen.add(id(x))
        t = type(x)
        if t is list:
            x[:] = [walk(item, depth - 1) for item in x]
        elif t is dict:
            for key, item in list(x.items()):
                x[key] = walk(item, depth - 1)
        elif isinstance(x, tuple):
            items = [walk(item, depth - 1) for item in x]
            if any(a is not b for a, b in zip(items, x)):
                try:
                    return t._make(items) if hasattr(t, "_make") else t(items)
                except Exception:  # noqa: BLE001 - a tuple type made otherwise: the copy stays
                    return x
        elif not isinstance(x, type | types.ModuleType | types.FunctionType):
            attributes = getattr(x, "__dict__", None)
            if type(attributes) is dict:
                for key, item in list(attributes.items()):
                    attributes[key] = walk(item, depth - 1)
        return x

    return walk(value, depth)


def _copy_into_storage(storage: Any, new: StorageBytes) -> None:
    """The master's bytes, read in place: the one copy is into the notebook's storage. On the
    CPU by NumPy, in this thread: torch's copy would wake its intra-op threads, which then spin
    for milliseconds on cores the ranks are computing on (about 5 ms of every session cell's
    time on 2 cores)."""
    import numpy
    import torch

    if new.whole and storage.nbytes() != len(memoryview(new.parts[0][1]).cast("B")):
        storage.resize_(len(memoryview(new.parts[0][1]).cast("B")))
    if storage.device.type == "cpu":
        into = storage_array(storage)
        for offset, data in new.parts:
            got = numpy.frombuffer(memoryview(data).cast("B"), dtype=numpy.uint8)
            into[offset : offset + got.size] = got
        return
    target = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    for offset, data in new.parts:
        source = bytes_view(data)
        target[offset : offset + source.numel()].copy_(source)


def shared_memory_tensors(registry: Registry) -> int:
    """How many of the registered tensors live in memory shared with other processes."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    storages = [storage_of(obj) for obj, kind in zip(registry.objects, registry.kinds) if kind is Kind.TENSOR]
    return sum(1 for s in storages if s is not None and s.device.type == "cpu" and s.is_shared())
