"""An object's shallow state, as named records: what the snapshot keeps and what travels back.

A shallow state holds what a change to the object itself would change: its slots' values (its
items, attributes, a tensor's view of its storage), not the state of the objects in them. Two
states are the same when each slot holds the same value (``same_value``). The records travel
from the master to the notebook inside the pickled changes: they are NamedTuples (cheap, and
pickled by reference to this module).
"""

from __future__ import annotations

import struct
import weakref
from typing import Any, NamedTuple

from enot_nb._serialize.tensors import (
    PLAIN,
    UNREADABLE,
    TensorBits,
    TensorHooks,
    coalesced,
    sparse_parts,
    tensor_bits,
    tensor_hooks,
)

VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis), type(NotImplemented), slice)
"""Immutable values: never registered, compared by value."""


class Attributes(NamedTuple):
    """An object's own attributes: its ``__dict__`` (None if it has none) and its slots."""

    vars: dict[str, Any] | None
    slots: dict[str, Any]


class DictState(NamedTuple):
    items: list[tuple[Any, Any]]
    default_factory: Any  # a defaultdict's; None for other dicts
    attributes: Attributes  # a dict subclass's


class ItemsState(NamedTuple):
    """A list's, deque's or set's items, in order."""

    items: list[Any]
    attributes: Attributes


class ObjectState(NamedTuple):
    """An object's class and attributes (a functools.partial's attributes only: its function,
    arguments and keywords never change)."""

    type: type
    attributes: Attributes


class TensorState(NamedTuple):
    """A tensor's view of its storage (storage None: a tensor without one that can be read: a
    sparse tensor, whose parts are in ``sparse``, or a lazy module's uninitialized parameter),
    its flags, its grad and its attributes."""

    type: type
    storage: Any
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...] | None
    dtype: Any
    device: Any
    requires_grad: bool
    grad: Any
    attributes: dict[str, Any]
    bits: TensorBits  # conjugate, negative, inference: how its values read its storage
    sparse: SparseView | None  # a sparse tensor's
    hooks: TensorHooks


class SparseView(NamedTuple):
    """A sparse tensor's layout and parts (its indices and values, strided tensors whose storages
    the registry holds, as tensors' states: see sparse_parts), and whether a COO one is
    coalesced. Its values change in place as those storages' bytes; new parts (``s.add_(...)``
    can change how many values it has) are a new view."""

    layout: Any
    parts: tuple[TensorState, ...]
    coalesced: bool


class FunctionState(NamedTuple):
    """What a notebook function's own state can change to (its closure's cells are objects of
    their own)."""

    code: Any
    defaults: tuple[Any, ...] | None
    kwdefaults: dict[str, Any] | None
    attributes: dict[str, Any]


class CellState(NamedTuple):
    """A closure cell's contents; ``filled`` False: the cell is empty."""

    filled: bool
    contents: Any


class ReducedState(NamedTuple):
    """A C object whose state only its pickle shows (a C iterator, a ``decimal.Context``): its
    ``__reduce__``: the callable that rebuilds it, its arguments and the state given to
    ``__setstate__`` (None: it takes none)."""

    rebuild: Any
    args: tuple[Any, ...]
    state: Any


class FrameState(NamedTuple):
    """Where a generator is: its frame's last instruction and its locals (``position`` None:
    it finished)."""

    position: int | None
    locals: list[tuple[str, Any]]


class CacheState(NamedTuple):
    """A functools.lru_cache wrapper: how many entries its cache holds (they live in C) and its
    attributes."""

    entries: int
    attributes: Attributes


class Lost(NamedTuple):
    """What travels for an object whose change cannot come back (a generator's frame, a
    functools.lru_cache's entries): why; the master names it in the cell's notes."""

    reason: str


class Replaced(NamedTuple):
    """What travels for an object that cannot take its new state in place (an ``enumerate`` or
    ``itertools.count`` that advanced: they have no ``__setstate__``): a copy holding it; the
    names bound to the object are bound to the copy."""

    copy: Any


class _Keep:
    """Stands for an attribute or item that could not come back: the notebook keeps its own."""

    def __reduce__(self) -> str:
        return "KEEP"


KEEP = _Keep()


# ----------------------------------------------------------------------------- reading state


_BUILTIN_CONTAINERS = frozenset({dict, list, tuple, set, frozenset})
"""Exact types whose instances have neither a ``__dict__`` nor slots (looked up for every object
the walk, the snapshot and the comparison meet: the attribute lookup that fails costs an
exception each time)."""


def object_dict(obj: Any) -> dict[str, Any] | None:
    """``obj``'s own ``__dict__`` (never a class's ``__getattr__``'s answer), or None."""
    if type(obj) in _BUILTIN_CONTAINERS:
        return None
    try:
        d = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return d if type(d) is dict else None


_SLOT_NAMES: weakref.WeakKeyDictionary[type, tuple[tuple, tuple[str, ...]]] = weakref.WeakKeyDictionary()
"""Each type's slot names, with the MRO they were read from (assigning ``__bases__`` makes a new
one): read once per type, not for every object at every cell. Weak: a class redefined in the
notebook leaves with its last instance."""


def slot_names(t: type) -> tuple[str, ...]:
    mro = getattr(t, "__mro__", ())
    try:
        cached = _SLOT_NAMES.get(t)
    except TypeError:  # not weakly referenceable: read each time
        cached = None
    if cached is not None and cached[0] is mro:
        return cached[1]
    names: list[str] = []
    for klass in mro:
        declared = klass.__dict__.get("__slots__", ())
        names += (
            [declared] if isinstance(declared, str) else [s for s in declared if s not in ("__dict__", "__weakref__")]
        )
    try:
        _SLOT_NAMES[t] = (mro, tuple(names))
    except TypeError:
        pass
    return tuple(names)


def slots(obj: Any) -> dict[str, Any]:
    """The values of ``obj``'s slots that are set."""
    names = slot_names(type(obj))
    if not names:
        return {}
    values = {}
    for name in names:
        try:
            values[name] = object.__getattribute__(obj, name)
        except AttributeError:
            pass
    return values


_NOT_THE_CLASS_S = ("__dict__", "__weakref__", "__slotnames__")
"""Not the user's: ``__slotnames__`` is copyreg's cache, set on whichever side pickled an instance."""


def class_attributes(cls: type) -> dict[str, Any]:
    return {k: v for k, v in vars(cls).items() if k not in _NOT_THE_CLASS_S}


def tensor_state(t: Any) -> TensorState:
    """A tensor's state; one without a storage or strided view that can be read (UNREADABLE) is
    tracked by its identity, type, flags and, if sparse, its parts (``size()``, not ``shape``: a
    lazy module's uninitialized parameter refuses the latter)."""
    try:
        storage = t.untyped_storage()
        offset, size, stride, bits = t.storage_offset(), tuple(t.shape), t.stride(), tensor_bits(t)
    except UNREADABLE:
        storage, offset, size, stride, bits = None, 0, tuple(t.size()), None, PLAIN
    parts = sparse_parts(t) if storage is None else ()
    sparse = SparseView(t.layout, tuple(map(tensor_state, parts)), coalesced(t)) if parts else None
    return TensorState(
        type(t),
        storage,
        offset,
        size,
        stride,
        t.dtype,
        t.device,
        t.requires_grad,
        t.grad if t.is_leaf else None,
        dict(object_dict(t) or {}),
        bits,
        sparse,
        tensor_hooks(t),
    )


# ----------------------------------------------------------------------------- comparing state


def same_value(a: Any, b: Any) -> bool:
    """Whether a slot still holds the same value: the same object, or an equal atom (two equal
    floats or strings, dtypes or devices, are the same value). A new list equal to the old one is
    not the same value: other references still see the old one. Floats and complex numbers are
    the same when their bits are: ``-0.0 == 0.0``, yet the cell that wrote -0.0 changed the slot,
    and ``nan != nan``, yet a NaN with the same bits is no change."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) is float or type(a) is complex:
        return _bits(a) == _bits(b)
    if type(a) in VALUE_TYPES:
        return a == b
    return type(a).__name__ in ("dtype", "device") and type(a).__module__.split(".")[0] in ("torch", "numpy") and a == b


def _bits(x: float | complex) -> bytes:
    """A float's or complex number's IEEE 754 bits (the sign of a zero, a NaN's payload)."""
    return struct.pack("<dd", x.real, x.imag) if type(x) is complex else struct.pack("<d", x)


def same_pairs(a: Any, b: Any) -> bool:
    """Two sequences of (key, value) pairs, in order (a loop: compared for every object at every
    session cell, where a generator's set-up costs more than a short dict's comparison)."""
    a, b = list(a), list(b)
    if len(a) != len(b):
        return False
    for (ka, va), (kb, vb) in zip(a, b):
        if not (same_value(ka, kb) and same_value(va, vb)):
            return False
    return True


def same_dict(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and (not a or same_pairs(a.items(), b.items()))
