"""When one object of the master's changes cannot be rebuilt in the notebook, the rest still can.

An object may pickle in the worker and fail to load in the kernel: its ``__setstate__`` or the
function its ``__reduce__`` names raises here (it reads a worker's environment, a module the
kernel lacks). pickle's C unpickler then raises for the whole cell's state. So apply.load retries
with ``SalvagingUnpickler``, pickle's pure-Python unpickler where each step that rebuilds an
object (``REDUCE``, ``NEWOBJ``, ``BUILD``, ``STACK_GLOBAL``) that fails leaves an ``Unloadable``
placeholder instead; ``leave_out`` then finds where the placeholders are in the changes and leaves
those names, attributes, items or objects as the notebook had them, a line each saying which.
"""

from __future__ import annotations

import gc
import io
import pickle
import types
from collections.abc import Callable
from typing import Any

from enot_nb._state.collect import Changes
from enot_nb._state.registry import Registry
from enot_nb._state.states import KEEP, DictState, ObjectState


class Unloadable:
    """Stands, in the loaded changes, for an object that could not be rebuilt in the notebook."""

    def __init__(self, what: str, error: BaseException) -> None:
        self.what, self.error = what, error

    def reason(self) -> str:
        return (
            f"{self.what} failed in this kernel ({type(self.error).__name__}: {self.error}); "
            "the notebook keeps what it had"
        )


def _name(obj: Any) -> str:
    if isinstance(obj, Unloadable):
        return obj.what
    named = obj if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) else type(obj)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', repr(named))}"


# Each step that rebuilds an object: how many stack items it takes, and what it is doing to them.
_STEPS: dict[bytes, tuple[int, Callable[[list[Any]], str]]] = {
    pickle.REDUCE: (2, lambda taken: f"rebuilding a {_name(taken[0])} (its __reduce__)"),
    pickle.NEWOBJ: (2, lambda taken: f"making a {_name(taken[0])}"),
    pickle.NEWOBJ_EX: (3, lambda taken: f"making a {_name(taken[0])}"),
    pickle.BUILD: (2, lambda taken: f"{_name(taken[0])}.__setstate__"),
    pickle.STACK_GLOBAL: (2, lambda taken: f"importing {taken[0]}.{taken[1]}"),
}


def _salvaging(code: bytes, step: Callable[[Any], None], taken: int, what: Callable[[list[Any]], str]) -> Any:
    def run(self: Any) -> None:  # a SalvagingUnpickler: its stack and memo are not in pickle's stubs
        depth = len(self.stack) - taken
        operands = self.stack[depth:]
        try:
            step(self)
        except Exception as err:  # noqa: BLE001 - this object is left out; the rest loads
            failed = next((o for o in operands if isinstance(o, Unloadable)), None)
            placeholder = Unloadable(failed.what, failed.error) if failed else Unloadable(what(operands), err)
            del self.stack[depth:]
            if code == pickle.BUILD:  # the object was memoized before its state: later refs see it
                for key, value in list(self.memo.items()):
                    if value is operands[0]:
                        self.memo[key] = placeholder
            self.append(placeholder)
            self.unloadable.append(placeholder)

    return run


def _salvaging_dispatch(dispatch: dict[int, Any]) -> dict[int, Any]:
    steps = {code[0]: _salvaging(code, dispatch[code[0]], taken, what) for code, (taken, what) in _STEPS.items()}
    return {**dispatch, **steps}


class SalvagingUnpickler(pickle._Unpickler):
    """pickle's Python unpickler, with a placeholder for each object that fails to rebuild
    (``unloadable``); ``resolve``: the registry's persistent ids, as StateUnpickler's."""

    dispatch = _salvaging_dispatch(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, buffers: list[Any], resolve: Callable[[Any], Any]) -> None:
        super().__init__(io.BytesIO(data), buffers=buffers)
        self.resolve = resolve
        self.unloadable: list[Unloadable] = []

    def persistent_load(self, pid: Any) -> Any:
        return self.resolve(pid)


def leave_out(changes: Changes, registry: Registry, unloadable: list[Unloadable]) -> list[str]:
    """Take the placeholders out of ``changes``: a name, attribute or dict item that holds one is
    left as the notebook has it; any other change that holds one is left out whole. Returns a line
    for each."""
    found = {id(p): p for p in unloadable}
    lines: list[str] = []

    def holds(value: Any) -> Unloadable | None:
        return _find(value, found, registry)

    for name, value in list(changes.bound.items()):
        placeholder = holds(value)
        if placeholder is not None:
            del changes.bound[name]
            lines.append(f"{name} was not brought back: {placeholder.reason()}")
    kept = []
    for i, state in changes.objects:
        placeholder = holds(state)
        if placeholder is not None:
            state = _keep_own(state, registry.path(i), found, lines)
            placeholder = holds(state)
            if placeholder is not None:
                lines.append(f"{registry.path(i)} was not brought back: {placeholder.reason()}")
                continue
        kept.append((i, state))
    changes.objects = kept
    if changes.has_value and holds(changes.value) is not None:
        changes.value, changes.has_value = None, False  # shown from its display data instead
    return lines


def _keep_own(state: Any, path: str, found: dict[int, Unloadable], lines: list[str]) -> Any:
    """An object's or dict's state with KEEP for each attribute or item that is a placeholder."""
    if isinstance(state, ObjectState) and state.attributes.vars is not None:
        kept = dict(state.attributes.vars)
        for key, value in kept.items():
            if id(value) in found:
                lines.append(f"{path}.{key} was not brought back: {found[id(value)].reason()}")
                kept[key] = KEEP
        return state._replace(attributes=state.attributes._replace(vars=kept))
    if isinstance(state, DictState):
        items = []
        for key, value in state.items:
            if id(value) in found:
                lines.append(f"{path}[{key!r}] was not brought back: {found[id(value)].reason()}")
                value = KEEP
            items.append((key, value))
        return state._replace(items=items)
    return state


_NOT_SEARCHED = (type, types.ModuleType, types.FunctionType, types.CodeType, types.BuiltinFunctionType)


def _find(value: Any, found: dict[int, Unloadable], registry: Registry) -> Unloadable | None:
    """A placeholder that ``value`` holds, at any depth: the objects the load made are searched,
    never the notebook's own (the registry's), classes, modules or functions."""
    seen: set[int] = set()
    todo = [value]
    while todo:
        obj = todo.pop()
        if id(obj) in found:
            return found[id(obj)]
        if id(obj) in seen or isinstance(obj, _NOT_SEARCHED) or registry.find(obj) is not None:
            continue
        seen.add(id(obj))
        todo += gc.get_referents(obj)
    return None
