"""The kinds of object in the notebook's graph, and what is done with each: one table, OPS.

Every object reachable from the namespace has a ``Kind`` (``kind_of``). What the registry, the
snapshot, the master and the notebook do with an object of a kind is that kind's row of ``OPS``
(a ``KindOps``), as cloudpickle keeps a reducer per type::

    children     the objects it refers to, each with a step of a path to it (for messages);
                 None: the graph does not walk into it
    snapshot     its shallow state, what a change to the object itself (not to the objects it
                 refers to) changes: a record of states.py (or a digest); None: not tracked
    same         whether two shallow states are the same: slots hold the same values
    changed      whether it changed since its snapshot, where that is cheaper than a new
                 snapshot and ``same`` (NumPy arrays: their pages)
    travels      its new state as it travels to the notebook (default: a new snapshot)
    apply        make the notebook's object hold a new state, in place
    trim         leave out what of a new state cannot be pickled (the notebook keeps its own)
    has_storage, reads_globals   what the registry also records for it

Adding a kind: a member of ``Kind``, a rule in ``kind_of``, a row in ``OPS``.

State that no ``__dict__`` shows: a pandas object's (its BlockManager's C-level fields) travels by
value, compared as a digest of its pickle; a C iterator's or ``decimal.Context``'s through its
``__reduce__``, taken in place where ``__setstate__`` (or a Context's fields) allows, else a copy
held wherever the object was (states.Replaced); a weakref is walked into its referent, so that
under spawn it travels too. What cannot come back at all (a generator's frame, a notebook
function's lru_cache entries) travels as states.Lost: the notebook names it, a line each.

The boundary (README, "What comes back"): user objects are the namespace's values and
everything reachable from them, except Python modules, functions and classes defined outside
the notebook, and process plumbing (files, locks, sockets, threads, loggers, IPython and
matplotlib objects), which are referenced, never walked.
"""

from __future__ import annotations

import array
import collections
import contextlib
import copy
import enum
import functools
import io
import itertools
import operator
import pickle
import sys
import types
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from enot_nb._memory.digests import array_changed, array_digest, digest, pickle_digest
from enot_nb._serialize.tensors import (
    UNREADABLE,
    _rebuild_tensor,
    hook_ids,
    set_tensor_hooks,
    sparse_tensor,
    tensor_hooks,
)
from enot_nb._state.states import (
    KEEP,
    VALUE_TYPES,
    Attributes,
    CacheState,
    CellState,
    DictState,
    FrameState,
    FunctionState,
    ItemsState,
    Lost,
    ObjectState,
    ReducedState,
    Replaced,
    SparseView,
    TensorState,
    class_attributes,
    object_dict,
    same_dict,
    same_pairs,
    same_value,
    slot_names,
    slots,
    tensor_state,
)


class Kind(enum.Enum):
    """How the graph treats an object (see OPS for what each does)."""

    NAMESPACE = "namespace"  # index 0: the notebook's globals
    OPAQUE = "opaque"  # referenced, never walked or tracked
    TENSOR = "tensor"
    NDARRAY = "ndarray"
    RNG = "rng"  # a random generator: its state is in C
    FUNCTION = "function"  # defined in the notebook
    CLASS = "class"  # defined in the notebook
    METHOD = "method"
    CELL = "cell"  # a closure's cell
    DICT = "dict"
    LIST = "list"
    DEQUE = "deque"
    SET = "set"
    TUPLE = "tuple"  # and frozenset: never changes itself
    BYTEARRAY = "bytearray"
    ARRAY = "array"  # array.array
    PARTIAL = "partial"  # functools.partial
    PANDAS = "pandas"  # a DataFrame, Series or Index: by value (its state is in C-level blocks)
    REDUCED = "reduced"  # a C iterator, a decimal.Context: its state only its pickle shows
    WEAKREF = "weakref"  # walked into its referent while that is alive; never changes itself
    GENERATOR = "generator"  # its frame cannot travel: a change is named, never brought back
    CACHE = "cache"  # a notebook function's functools.lru_cache: its entries live in C, stay in the worker
    OBJECT = "object"  # anything else with a __dict__ or slots
    ATOMS = "atoms"  # a large container of atoms: compared as a whole, never walked
    PLAIN = "plain"  # a large container of plain data (lists and dicts of atoms too): digested whole

    # Members are singletons (unpickled too): hashed by identity, in C. Enum's own hash is Python
    # code, run at every OPS lookup of every object the walk and the comparison meet.
    __hash__ = object.__hash__


# ----------------------------------------------------------------------------- classification

_SEQUENCES: list[Any] = [[], (), range(0), range(2**64), "", "\u00e9", b"", bytearray(), array.array("b")]
_ITERATORS: set[type] = {type(iter(seq)) for seq in _SEQUENCES + [collections.deque()]} | {type(reversed([]))}
_ITERATORS |= {reversed, enumerate, zip, map, filter} | {
    getattr(itertools, name)
    for name in ("count", "cycle", "repeat", "islice", "chain", "accumulate", "compress", "dropwhile", "takewhile")
    + ("starmap", "zip_longest")
}
"""The C iterators whose position their pickle holds (one advanced in the cell comes back so)."""

# By exact type, before the rules: the same answer as the rules, without running them.
_EXACT: dict[type, Kind | None] = {
    **dict.fromkeys(VALUE_TYPES),
    dict: Kind.DICT,
    collections.OrderedDict: Kind.DICT,  # a module's hooks: half of what a model holds
    collections.defaultdict: Kind.DICT,
    collections.Counter: Kind.DICT,
    list: Kind.LIST,
    tuple: Kind.TUPLE,
    frozenset: Kind.TUPLE,
    set: Kind.SET,
    collections.deque: Kind.DEQUE,
    bytearray: Kind.BYTEARRAY,
    array.array: Kind.ARRAY,
    functools.partial: Kind.PARTIAL,
    types.CellType: Kind.CELL,
    types.MethodType: Kind.METHOD,
    weakref.ReferenceType: Kind.WEAKREF,
    types.GeneratorType: Kind.GENERATOR,
    **dict.fromkeys(_ITERATORS, Kind.REDUCED),
}

# Process plumbing: referenced by identity, never walked (their state is the worker's).
_PLUMBING_MODULES = (
    "IPython",
    "ipykernel",
    "ipywidgets",
    "zmq",
    "tornado",
    "asyncio",
    "logging",
    "threading",
    "_thread",
    "socket",
    "subprocess",
    "multiprocessing",
    "concurrent",
    "io",
    "_io",
    "matplotlib",
    "traitlets",
    "jupyter_client",
    "comm",
    "tqdm",
    "selectors",
    "queue",
    "weakref",
    "_weakref",
    "enot_nb",
)
_OPAQUE_TYPES = (
    types.ModuleType,
    types.CoroutineType,
    types.AsyncGeneratorType,
    types.FrameType,
    types.CodeType,
    types.TracebackType,
    types.BuiltinFunctionType,
    types.MethodWrapperType,
    types.WrapperDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    types.MappingProxyType,
    property,
    staticmethod,
    classmethod,
    memoryview,
)


def defined_in_notebook(obj: Any) -> bool:
    """A function or class the user defined in a cell (its module is the notebook's)."""
    return getattr(obj, "__module__", None) == "__main__"


def kind_of(obj: Any) -> Kind | None:
    """How the graph treats ``obj``: None for atoms (immutable, never registered). The rules
    run in order; the first that matches decides."""
    t = type(obj)
    if t in _ATOM_CONTAINERS and len(obj) >= ATOMS_MIN:
        if holds_only_atoms(obj):
            return Kind.ATOMS
        if t in _PLAIN_CONTAINERS and holds_plain_data(obj):
            return Kind.PLAIN
    if t in _EXACT:
        return _EXACT[t]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return Kind.TENSOR
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return Kind.NDARRAY
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(obj, (pandas.DataFrame, pandas.Series, pandas.Index)):
        return Kind.PANDAS
    decimal = sys.modules.get("decimal")
    if decimal is not None and isinstance(obj, decimal.Context):
        return Kind.REDUCED
    if _is_bound_builtin(obj):
        return Kind.METHOD
    if isinstance(obj, _OPAQUE_TYPES):
        return Kind.OPAQUE
    if _is_rng(obj):
        return Kind.RNG
    if isinstance(obj, types.FunctionType):
        return Kind.FUNCTION if defined_in_notebook(obj) else Kind.OPAQUE
    if isinstance(obj, type):
        return Kind.CLASS if defined_in_notebook(obj) else Kind.OPAQUE
    if isinstance(obj, functools._lru_cache_wrapper):  # its __module__ is its function's
        return Kind.CACHE if defined_in_notebook(obj) else Kind.OPAQUE
    if isinstance(obj, types.MethodType):
        return Kind.METHOD
    if isinstance(obj, types.CellType):
        return Kind.CELL
    if isinstance(obj, dict):
        return Kind.DICT
    if isinstance(obj, list):
        return Kind.LIST
    if isinstance(obj, collections.deque):
        return Kind.DEQUE
    if isinstance(obj, set):
        return Kind.SET
    if isinstance(obj, (tuple, frozenset)):
        return Kind.TUPLE
    if isinstance(obj, bytearray):
        return Kind.BYTEARRAY
    if isinstance(obj, array.array):
        return Kind.ARRAY
    if isinstance(obj, functools.partial):
        return Kind.PARTIAL
    module = getattr(t, "__module__", "") or ""
    if module.split(".", 1)[0] in _PLUMBING_MODULES:
        return Kind.OPAQUE
    if hasattr(obj, "__dict__") or slot_names(t):
        return Kind.OBJECT
    return Kind.OPAQUE


ATOMS_MIN = 1000
"""A container this large that holds only atoms is one object of kind ATOMS (a dataset's
500,000 ``(path, label)`` samples): walking its items would cost the cell what the notebook
holds. Smaller ones are walked as any other."""
_ATOM_CONTAINERS = frozenset({list, tuple, dict, set, frozenset, collections.deque})
_FLAT = frozenset({tuple, frozenset})
_ATOM_TYPES = frozenset(VALUE_TYPES)


def holds_only_atoms(obj: Any) -> bool:
    """Whether every item (key and value) of a container is an atom or a tuple of atoms (C
    loops over the items' types: 0.05 s for 500,000 samples)."""
    parts = (obj.keys(), obj.values()) if type(obj) is dict else (obj,)
    for items in parts:
        types_met = set(map(type, items))
        if not types_met <= _ATOM_TYPES | _FLAT:
            return False
        if types_met & _FLAT:
            nested = itertools.chain.from_iterable(x for x in items if type(x) in _FLAT)
            if not set(map(type, nested)) <= _ATOM_TYPES:
                return False
    return True


_PLAIN_CONTAINERS = frozenset({list, dict})
IN_PLACE = frozenset({list, dict, set, bytearray})
"""The containers whose contents are updated in place (plain data's items, aliases of them)."""
_IN_PLACE_DEPTH = 100
"""How deep a plain container's new contents go into its old ones in place (deeper: replaced)."""


class _NotPlain(Exception):
    pass


class _PlainPickler(pickle.Pickler):
    """The C pickler, refusing all but plain data: it asks ``reducer_override`` only of what its
    own fast paths do not pickle (exact dicts, lists, tuples, sets, frozensets, bytearrays, str,
    bytes, int, float, bool, None), so an atom or an atom's type passes and anything else stops it."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _ATOM_TYPES or (type(obj) is type and obj in _ATOM_TYPES):
            return NotImplemented
        raise _NotPlain


def _refuse_buffer(buffer: Any) -> None:
    raise _NotPlain  # a PickleBuffer: its own fast path, out of band (it would come back a bytearray)


_still: dict[int, tuple[Any, ...]] | None = None
"""While nothing can change the objects (``held_still``): each large container's plain pickle,
or None where it holds more than plain data, by id (the object kept: its id stays its own)."""


@contextlib.contextmanager
def held_still(resumed: dict[int, tuple[Any, ...]] | None = None) -> Iterator[dict[int, tuple[Any, ...]]]:
    """While nothing changes the objects (a walk, a snapshot, a push pickled; no cell, no apply):
    a large container is told plain once, and its digest and the push reuse that pickle (a log of
    300,000 records took 0.11 s a look, and a cell looked at it eight times). Yields what it
    learns; ``resumed``: what an earlier scope learned, where nothing changed the objects since
    (a task that brought nothing back but atoms)."""
    global _still
    outer = _still is None
    if outer:
        _still = resumed if resumed is not None else {}
    try:
        yield _still  # type: ignore[misc]
    finally:
        if outer:
            _still = None


def let_go() -> None:
    """The objects may change from here (the user's code runs): what ``held_still`` learned is
    forgotten, and nothing more is learned until a scope opens again."""
    global _still
    _still = None


def plain_pickle(obj: Any) -> bytes | None:
    """The pickle of a list's or dict's items if they are plain data (atoms, and exact tuples,
    lists, dicts, sets, frozensets and bytearrays of plain data; a log of 300,000
    ``{"step": i, "loss": x}`` records), else None. Such a container is one object of kind PLAIN:
    walking its 300,000 dicts, each registered, compared and found by path on the ranks, cost
    11-17 s for a cell that read it; this is one pass of the C pickler (0.05 s)."""
    raw = plain_bytes(obj)
    if raw is None:
        return None
    if _still is not None and len(_still[id(obj)]) == 3:
        return None if _still[id(obj)][2] else raw
    held = _held_from_outside(obj)
    if _still is not None:
        _still[id(obj)] = (obj, raw, held)
    return None if held else raw


def plain_bytes(obj: Any) -> bytes | None:
    """The pickle of a list's or dict's items if they are plain data, whatever holds them: a
    digest of it tells a change (``plain_pickle`` also asks that no item is held from outside)."""
    if _still is not None and id(obj) in _still:
        return _still[id(obj)][1]
    out = io.BytesIO()
    try:
        _PlainPickler(out, protocol=5, buffer_callback=_refuse_buffer).dump(obj)
        found: bytes | None = out.getvalue()
    except (_NotPlain, RecursionError):
        found = None
    if _still is not None:
        _still[id(obj)] = (obj, found)
    return found


def _held_from_outside(obj: Any) -> bool:
    """Whether a list, dict, set or bytearray inside ``obj`` (at any depth) is also held from
    outside it (``last = log[-1]``) or twice inside: then ``obj`` is walked item by item, so the
    alias stays one on every side (one pickle by value would copy the item). By reference
    counts, level by level, in C-level passes (a level of atoms ends it): an item held once is
    held by its container, by the lists made here that hold it, and by the count's argument."""
    items: Any = obj.values() if type(obj) is dict else obj
    made = 0  # the lists made here that hold each item of the level
    while True:
        met = set(map(type, items))
        containers_met = met & IN_PLACE
        if not containers_met:
            return False
        containers = items
        if containers_met != met:  # atoms beside them: the containers alone
            containers, made = list(itertools.compress(items, map(IN_PLACE.__contains__, map(type, items)))), made + 1
        if max(map(sys.getrefcount, containers)) > _REFS_HELD_ONCE + made:
            return True
        if containers_met == {dict}:
            items = list(itertools.chain.from_iterable(map(dict.values, containers)))
        elif containers_met <= {list, set}:
            items = list(itertools.chain.from_iterable(containers))
        else:
            items = list(itertools.chain.from_iterable(c.values() if type(c) is dict else c for c in containers))
        del containers
        made = 1  # ``items``


def _refs_held_once() -> int:
    """What ``_held_from_outside`` counts for an item its container alone holds (this Python's)."""
    return max(map(sys.getrefcount, [{}]))


_REFS_HELD_ONCE = _refs_held_once()


_DICT_ITEM_REFS = max(map(sys.getrefcount, {0: []}.values()))
"""As _REFS_HELD_ONCE, for a dict's values."""


def items_held_elsewhere(container: list | dict) -> Iterator[tuple[Any, Any]]:
    """(key, item) for each list, dict or bytearray item of plain data that something besides
    the container holds too (``d = {'k': log[0]}``): found by the items' reference counts, a
    C-level pass over them, so a large log costs milliseconds."""
    if type(container) is dict:
        keys: Any = list(container)
        counts = map(sys.getrefcount, container.values())
        base = _DICT_ITEM_REFS
    else:
        keys, counts, base = None, map(sys.getrefcount, container), _REFS_HELD_ONCE
    for index in itertools.compress(itertools.count(), map(base.__lt__, counts)):
        key = index if keys is None else keys[index]
        item = container[key]
        if type(item) in (list, dict, bytearray):
            yield key, item


def kind_of_state(kind: Kind, obj: Any, state: Any) -> Kind:
    """The kind whose ``apply`` takes ``state``: the sender's. A large list or dict is plain data
    on one side and walked item by item on the other where an item of it is held from outside
    on one side only (``rec = log[5]`` came back, see _held_from_outside); its state says which."""
    if kind in (Kind.LIST, Kind.DICT, Kind.PLAIN) and type(obj) in _PLAIN_CONTAINERS:
        if type(state) is list:
            return Kind.PLAIN
        if kind is Kind.PLAIN:
            return Kind.DICT if type(obj) is dict else Kind.LIST
    return kind


def holds_plain_data(obj: Any) -> bool:
    return plain_pickle(obj) is not None


def _plain_snapshot(obj: Any) -> list[tuple[int, int]]:
    """A digest of its pickle: a change anywhere inside (``log[7]["loss"] = 0``) changes it."""
    pickled = plain_bytes(obj)
    return [digest(pickled)] if pickled is not None else pickle_digest(obj)


def _plain_travels(obj: Any) -> Any:
    return list(obj.items()) if type(obj) is dict else list(obj)


PLAIN_MADE: dict[int, Any] | None = None
"""While changes are applied (apply.apply_changes): each new item of plain data that went into
an old one in place, by the new one's id, so a name bound to the new item in the same changes
(``log[5]['v'] = 1`` and ``rec = log[5]`` sent together), or a new value holding it, binds the
old one it went into (apply.with_old_items)."""


def _apply_plain(obj: Any, items: list[Any], note: Note) -> None:
    """In place, to the depth it holds: a dict, list, set or bytearray item that is one in both
    keeps its identity (``last = log[-1]`` still is ``log[-1]``), its contents replaced the same way."""
    made: dict[int, Any] = {}
    _into(obj, dict(items) if type(obj) is dict else items, _IN_PLACE_DEPTH, {}, made)
    if PLAIN_MADE is not None:
        PLAIN_MADE.update(made)


def _into(old: Any, new: Any, depth: int, done: dict[int, Any], made: dict[int, Any]) -> Any:
    """``old`` made to hold what ``new`` holds, in place where both are lists, dicts, sets or
    bytearrays (to ``depth`` levels); else ``new``. ``done``: what each old container was made to
    hold, by id: an alias of one stays one where the new state shares it too, and is let go where
    it does not (``log[1] = {...}`` while ``log[0]`` held the same dict), as in a cycle. ``made``:
    the old container each new one went into, by id: two places the new state shares hold one
    container (``log[1] = log[0]``)."""
    if id(new) in made:
        return made[id(new)]
    if type(old) is not type(new) or type(old) not in IN_PLACE or depth <= 0:
        return new
    if id(old) in done:
        return new  # already made to hold another: let go here
    done[id(old)], made[id(new)] = new, old
    if type(old) is set:
        old.clear()
        old.update(new)
    elif type(old) is bytearray:
        old[:] = new
    elif type(old) is list:
        kept = [_into(a, b, depth - 1, done, made) for a, b in zip(old, new)]
        old[:] = kept + list(new[len(kept) :])
    else:
        for key in [k for k in old if k not in new]:
            del old[key]
        for key, value in new.items():
            old[key] = _into(old[key], value, depth - 1, done, made) if key in old else value
    return old


def _is_bound_builtin(obj: Any) -> bool:
    """A C method bound to an object (``log.append``, ``acc.add_``, ``x.__setitem__``): calling it
    changes that object, so the walk goes on into it (a builtin function's ``__self__`` is its
    module: that is no object of the user's)."""
    if not isinstance(obj, (types.BuiltinMethodType, types.MethodWrapperType)):
        return False
    owner = getattr(obj, "__self__", None)
    return owner is not None and not isinstance(owner, (types.ModuleType, type))


def _is_rng(obj: Any) -> bool:
    """A random generator the user holds (its state lives in C, not in a __dict__)."""
    import random

    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    return (
        isinstance(obj, random.Random)
        and type(obj) is not random.SystemRandom
        or torch is not None
        and isinstance(obj, torch.Generator)
        and obj.device.type == "cpu"
        or numpy is not None
        and isinstance(obj, (numpy.random.Generator, numpy.random.RandomState))
    )


# ----------------------------------------------------------------------------- the table

Steps = list[tuple[str, Any]]
"""The objects an object refers to, each with the step of a path to it, e.g. ``("[0]", x)``."""
Note = Callable[[str], None]
"""Reports what a change left as it was (the rest of the change still applies)."""
Reason = Callable[[Any], str | None]
"""Why a value cannot be pickled, or None."""


@dataclass(frozen=True)
class KindOps:
    """What is done with the objects of one kind (see the module's docstring)."""

    children: Callable[[Any], Steps] | None = None
    snapshot: Callable[[Any], Any] | None = None
    same: Callable[[Any, Any], bool] = operator.eq
    changed: Callable[[Any, Any], bool] | None = None
    travels: Callable[[Any], Any] | None = None
    apply: Callable[[Any, Any, Note], None] | None = None
    trim: Callable[[Any, str, Reason, dict[str, str]], Any] | None = None
    has_storage: bool = False
    reads_globals: bool = False

    def new_state(self, obj: Any) -> Any:
        """The state that travels for a changed object."""
        if self.travels is not None:
            return self.travels(obj)
        return None if self.snapshot is None else self.snapshot(obj)


def _attribute_steps(obj: Any) -> Steps:
    """Its attributes; and its class, where the notebook defined it: the class's methods read the
    notebook's globals (see reach), and registered, the class travels by reference even when no
    name holds it any more (the class's cell was run again, a factory function made it)."""
    steps = [(".__class__", type(obj))] if defined_in_notebook(type(obj)) else []
    steps += [(f".{k}", v) for k, v in _travelling_dict(obj).items()]
    return steps + [(f".{k}", v) for k, v in slots(obj).items()]


_OBJECT_GETSTATE = getattr(object, "__getstate__", None)


def _travelling_dict(obj: Any) -> dict[str, Any]:
    """``obj``'s ``__dict__`` as far as its pickle carries it: a class's own ``__getstate__`` may
    leave attributes out (torch's Optimizer keeps three: an LR scheduler's ``step`` wrapper
    stays behind), and the receiver's copy then has no such path to find (its state still holds
    them: one changed travels, by value)."""
    d = object_dict(obj) or {}
    getstate = getattr(type(obj), "__getstate__", None)
    if not d or getstate is None or getstate is _OBJECT_GETSTATE:
        return d
    try:
        state = getstate(obj)
    except Exception:  # noqa: BLE001 - a getstate that needs more than the object: all of it
        return d
    if type(state) is tuple and len(state) == 2:  # (dict, slots)
        state = state[0]
    if type(state) is not dict or state is d or len(state) >= len(d):
        return d
    return {k: v for k, v in d.items() if k in state}


def _attributes(obj: Any) -> Attributes:
    d = object_dict(obj)
    return Attributes(dict(d) if d is not None else None, slots(obj))


def _same_attributes(a: Attributes, b: Attributes) -> bool:
    return same_dict(a.vars, b.vars) and same_dict(a.slots, b.slots)


def _same_items(a: list, b: list) -> bool:
    return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))


def _merge(old: dict, new: dict) -> dict:
    return {k: (old[k] if v is KEEP else v) for k, v in new.items() if not (v is KEEP and k not in old)}


def _apply_attributes(obj: Any, attributes: Attributes) -> None:
    current = object_dict(obj)
    if current is not None and attributes.vars is not None:
        merged = _merge(current, attributes.vars)
        current.clear()
        current.update(merged)
    present = slots(obj)
    for name in slot_names(type(obj)):
        value = attributes.slots.get(name, _MISSING)
        if value is _MISSING and name in present:  # unset in the master (``del obj.a``)
            object.__delattr__(obj, name)
        elif value is not _MISSING and value is not KEEP:
            object.__setattr__(obj, name, value)


def _attributes_that_pickle(attributes: Attributes, path: str, reason: Reason, left_out: dict[str, str]) -> Attributes:
    if attributes.vars is None:
        return attributes
    kept = dict(attributes.vars)
    for key, value in kept.items():
        why = reason(value)
        if why:
            left_out[f"{path}.{key}"] = why
            kept[key] = KEEP
    return attributes._replace(vars=kept)


# dict ------------------------------------------------------------------------


def _dict_children(obj: dict) -> Steps:
    """An item's step is its key's repr where the key is an atom (``['lr']``), else the key's
    place (``[<key 3>]``: an optimizer's state is keyed by tensors, whose repr is long and says
    nothing); a key's own step is its place too, so each step names one object (see paths)."""
    items = list(obj.items())
    steps = [(f"[{k!r}]" if type(k) in VALUE_TYPES else f"[<key {n}>]", v) for n, (k, v) in enumerate(items)]
    steps += [(f"<key {n}>", k) for n, (k, _) in enumerate(items) if type(k) not in VALUE_TYPES]
    factory = getattr(obj, "default_factory", None)
    if factory is not None:
        steps.append((".default_factory", factory))
    return steps + _attribute_steps(obj)


def _dict_state(obj: dict) -> DictState:
    return DictState(list(obj.items()), getattr(obj, "default_factory", None), _attributes(obj))


def _same_dict_state(a: DictState, b: DictState) -> bool:
    return (
        same_pairs(a.items, b.items)
        and same_value(a.default_factory, b.default_factory)
        and _same_attributes(a.attributes, b.attributes)
    )


def _apply_dict(obj: dict, state: DictState, note: Note) -> None:
    items = state.items
    merged = _merge(dict(obj), dict(items)) if any(v is KEEP for _, v in items) else dict(items)
    obj.clear()
    obj.update(merged)
    if hasattr(obj, "default_factory"):
        obj.default_factory = state.default_factory
    _apply_attributes(obj, state.attributes)


def _dict_that_pickles(state: DictState, path: str, reason: Reason, left_out: dict[str, str]) -> DictState:
    attributes = _attributes_that_pickle(state.attributes, path, reason, left_out)
    items = []
    for key, value in state.items:
        key_reason = reason(key)
        why = reason(value) or key_reason
        if why:
            left_out[f"{path}[{key!r}]"] = why
            value = KEEP
        items.append((KEEP if key_reason else key, value))
    return state._replace(items=[(k, v) for k, v in items if k is not KEEP], attributes=attributes)


# list, deque, set, tuple -------------------------------------------------------


def _indexed_children(obj: Any) -> Steps:
    return [(f"[{i}]", v) for i, v in enumerate(list(obj))]


def _sequence_children(obj: Any) -> Steps:
    return _indexed_children(obj) + _attribute_steps(obj)


SET_ITEM = "<item"
"""How a set's (or frozenset's) item steps begin: the walk reaches them last (see
Registry.grow), so an item that has a path elsewhere is registered by that path."""


def _set_children(obj: set | frozenset) -> Steps:
    """A set's items, each by a step made of what it holds, never of its place in the
    iteration (which follows ids, so differs between processes): a rank finds its own item by
    the same step. Atoms are never registered: their step does not matter."""
    return [(_item_step(v), v) for v in list(obj)] + _attribute_steps(obj)


def _item_step(item: Any) -> str:
    if type(item) in VALUE_TYPES:
        return f"{SET_ITEM}>"
    held: Any = ()
    if isinstance(item, (tuple, frozenset)):
        held = sorted(repr(x) for x in item if type(x) in VALUE_TYPES)
    elif hasattr(item, "shape") and hasattr(item, "dtype"):  # a tensor, an array: never its data
        held = (tuple(item.shape), str(item.dtype))
    else:
        attributes = getattr(item, "__dict__", None)
        if isinstance(attributes, dict):
            held = sorted((k, repr(v)) for k, v in attributes.items() if isinstance(k, str) and type(v) in VALUE_TYPES)
    key = zlib.crc32(repr(held).encode())
    return f"{SET_ITEM} {type(item).__qualname__} {key:08x}>"


def _tuple_children(obj: tuple | frozenset) -> Steps:
    return _set_children(obj) if isinstance(obj, frozenset) else _indexed_children(obj)


def _items_state(obj: Any) -> ItemsState:
    return ItemsState(list(obj), _attributes(obj))


def _same_sequence(a: ItemsState, b: ItemsState) -> bool:
    return _same_items(a.items, b.items) and _same_attributes(a.attributes, b.attributes)


def _same_set(a: ItemsState, b: ItemsState) -> bool:
    return {id(x) for x in a.items} == {id(x) for x in b.items} and _same_attributes(a.attributes, b.attributes)


def _apply_list(obj: list, state: ItemsState, note: Note) -> None:
    obj[:] = state.items
    _apply_attributes(obj, state.attributes)


def _apply_deque(obj: collections.deque, state: ItemsState, note: Note) -> None:
    obj.clear()
    obj.extend(state.items)
    _apply_attributes(obj, state.attributes)


def _apply_set(obj: set, state: ItemsState, note: Note) -> None:
    obj.clear()
    obj.update(state.items)
    _apply_attributes(obj, state.attributes)


# objects, partials -------------------------------------------------------------


def _object_state(obj: Any) -> ObjectState:
    return ObjectState(type(obj), _attributes(obj))


def _same_object(a: ObjectState, b: ObjectState) -> bool:
    return a.type is b.type and _same_attributes(a.attributes, b.attributes)


def _apply_object(obj: Any, state: ObjectState, note: Note) -> None:
    if type(obj) is not state.type:
        obj.__class__ = state.type
    _apply_attributes(obj, state.attributes)


def _object_that_pickles(state: ObjectState, path: str, reason: Reason, left_out: dict[str, str]) -> ObjectState:
    return state._replace(attributes=_attributes_that_pickle(state.attributes, path, reason, left_out))


def _partial_children(obj: functools.partial) -> Steps:
    """A partial never changes itself (its func, args and keywords); what it holds may."""
    return [(".func", obj.func), (".args", obj.args), (".keywords", obj.keywords)] + _attribute_steps(obj)


# tensors -----------------------------------------------------------------------


def _tensor_children(obj: Any) -> Steps:
    """Its grad, attributes and hook dicts (registered, so that a hook added to one in the cell
    comes back into the notebook's dict, where its ``RemovableHandle`` looks)."""
    grad = obj.grad if obj.is_leaf else None
    steps = [(".grad", grad)] if grad is not None else []
    hooks = tensor_hooks(obj)
    steps += [
        (step, d)
        for step, d in (
            ("._backward_hooks", hooks.backward),
            ("._post_accumulate_grad_hooks", hooks.post_accumulate_grad),
        )
        if d is not None
    ]
    return steps + [(f".{k}", v) for k, v in (object_dict(obj) or {}).items()]


def _same_tensor(a: TensorState, b: TensorState) -> bool:
    return (
        a.type is b.type
        and a.storage is b.storage
        and (a.offset, a.size, a.stride, a.bits) == (b.offset, b.size, b.stride, b.bits)
        and a.dtype == b.dtype
        and a.device == b.device
        and a.requires_grad == b.requires_grad
        and a.grad is b.grad
        and same_dict(a.attributes, b.attributes)
        and _same_sparse(a.sparse, b.sparse)
        and a.hooks.backward is b.hooks.backward
        and a.hooks.post_accumulate_grad is b.hooks.post_accumulate_grad
        and a.hooks.ids == b.hooks.ids
    )


def _tensor_changed(t: Any, before: TensorState) -> bool:
    """``not _same_tensor(before, tensor_state(t))``, read off the tensor a field at a time: a
    session compares every tensor of a model on both sides at every cell, and building each
    state costs more than comparing it. A sparse tensor, or one unreadable before, is compared
    the long way."""
    if before.sparse is not None or before.storage is None:
        return not _same_tensor(before, tensor_state(t))
    try:
        if (
            t.untyped_storage() is not before.storage
            or t.storage_offset() != before.offset
            or tuple(t.shape) != before.size
            or t.stride() != before.stride
            or (t.is_conj(), t.is_neg(), t.is_inference()) != before.bits
        ):
            return True
    except UNREADABLE:
        return True  # (it had a storage before)
    hooks, backward, post = before.hooks, t._backward_hooks, t._post_accumulate_grad_hooks
    return not (
        t.dtype == before.dtype
        and t.device == before.device
        and t.requires_grad == before.requires_grad
        and (t.grad if t.is_leaf else None) is before.grad
        and same_dict(before.attributes, object_dict(t) or {})
        and backward is hooks.backward
        and post is hooks.post_accumulate_grad
        and hook_ids(backward, post) == hooks.ids
        and type(t) is before.type  # (last: a type check narrows what the checker knows of t)
    )


def _same_sparse(a: SparseView | None, b: SparseView | None) -> bool:
    if a is None or b is None:
        return a is b
    return (
        a.layout == b.layout
        and a.coalesced == b.coalesced
        and len(a.parts) == len(b.parts)
        and all(map(_same_tensor, a.parts, b.parts))
    )


def apply_tensor(tensor: Any, state: TensorState, note: Note) -> None:
    """A tensor's view of its storage, requires_grad and attributes; its grad is applied once
    every tensor has its new shape (apply_grad)."""
    import torch

    current = tensor_state(tensor)
    if state.storage is not None and not (
        state.storage is current.storage
        and (state.offset, state.size, state.stride, state.dtype, state.bits)
        == (current.offset, current.size, current.stride, current.dtype, current.bits)
    ):
        assert state.stride is not None  # a tensor with a storage has strides (see tensor_state)
        rebuilt = _rebuild_tensor(
            state.storage, state.offset, state.size, state.stride, state.dtype, False, False, None, state.bits
        )
        if state.device.type != "cpu" and tensor.device.type != "cpu":
            rebuilt = rebuilt.to(tensor.device)  # stays on the GPU of a kernel that uses CUDA
        with torch.no_grad():
            tensor.data = rebuilt
    if state.sparse is not None and not _same_sparse(state.sparse, current.sparse):
        _set_sparse(tensor, state, state.sparse)
    if type(tensor) is not state.type:  # a lazy module's parameter, materialized: now a Parameter
        tensor.__class__ = state.type
    if tensor.requires_grad != state.requires_grad:
        if tensor.is_leaf:
            tensor.requires_grad_(state.requires_grad)
        else:
            note("requires_grad could not change on a non-leaf tensor")
    if not same_dict(state.attributes, getattr(tensor, "__dict__", None) or {}):
        tensor.__dict__.clear()
        tensor.__dict__.update(state.attributes)
    set_tensor_hooks(tensor, state.hooks)  # their contents: the dicts' own changes (DICT)


def _set_sparse(tensor: Any, state: TensorState, sparse: SparseView) -> None:
    """A sparse tensor's new parts, in place. A COO tensor takes them as they are (``.data``: it
    shares their memory, as the master's did); torch ignores ``.data =`` on a compressed layout
    (CSR, CSC, BSR, BSC) without a word, so theirs are copied in (``resize_as_sparse_``, ``copy_``)."""
    import torch

    parts = []
    for part in sparse.parts:
        assert part.stride is not None  # a sparse tensor's parts are strided (see sparse_parts)
        parts.append(_rebuild_tensor(part.storage, part.offset, part.size, part.stride, part.dtype, False, False))
    new = sparse_tensor(sparse.layout, parts, state.size, sparse.coalesced)
    if state.device.type != "cpu" and tensor.device.type != "cpu":
        new = new.to(tensor.device)
    if new.layout != tensor.layout or new.dtype != tensor.dtype:
        raise ValueError(f"it became a {new.dtype} {new.layout} tensor, which cannot be done in place")
    with torch.no_grad():
        if new.layout == torch.sparse_coo:
            tensor.data = new
        else:
            tensor.resize_as_sparse_(new)
            tensor.copy_(new)


def apply_grad(tensor: Any, state: TensorState) -> None:
    grad = state.grad
    if not tensor.is_leaf or tensor.grad is grad:
        return
    if grad is not None and grad.device != tensor.device:
        grad = grad.to(tensor.device)
    tensor.grad = grad


# NumPy arrays, bytearrays, array.array -----------------------------------------


def _array_children(obj: Any) -> Steps:
    """An object array holds Python objects; any other, none."""
    return [(f"[{i}]", v) for i, v in enumerate(obj.ravel(order="K").tolist())] if obj.dtype.hasobject else []


def _apply_ndarray(obj: Any, new: Any, note: Note) -> None:
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


def _apply_bytearray(obj: bytearray, new: bytes, note: Note) -> None:
    obj[:] = new


def _apply_array(obj: array.array, new: bytes, note: Note) -> None:
    """An ``array.array``: same typecode, new items (assigned in place when the length is the
    same, so that a memoryview of it stays valid)."""
    items = array.array(obj.typecode)
    items.frombytes(new)
    obj[:] = items


# functions, classes, methods, cells ------------------------------------------------


def _function_children(obj: types.FunctionType) -> Steps:
    steps: Steps = [(".__defaults__", obj.__defaults__), (".__kwdefaults__", obj.__kwdefaults__)]
    steps += [(f".<closure {i}>", c) for i, c in enumerate(obj.__closure__ or ())]
    return steps + [(f".{k}", v) for k, v in obj.__dict__.items()]


def _function_state(obj: types.FunctionType) -> FunctionState:
    return FunctionState(obj.__code__, obj.__defaults__, obj.__kwdefaults__, dict(obj.__dict__))


def _same_function(a: FunctionState, b: FunctionState) -> bool:
    return (
        a.code is b.code
        and a.defaults is b.defaults
        and a.kwdefaults is b.kwdefaults
        and same_dict(a.attributes, b.attributes)
    )


def _apply_function(obj: types.FunctionType, state: FunctionState, note: Note) -> None:
    obj.__code__, obj.__defaults__, obj.__kwdefaults__ = state.code, state.defaults, state.kwdefaults
    obj.__dict__.clear()
    obj.__dict__.update(state.attributes)


def _class_children(obj: type) -> Steps:
    """Its attributes, the functions inside its properties, static and class methods, and the
    bases the notebook defined: what its instances' methods run."""
    steps: Steps = []
    for k, v in class_attributes(obj).items():
        steps.append((f".{k}", v))
        if isinstance(v, property):
            steps += [(f".{k}.{part}", f) for part in ("fget", "fset", "fdel") if (f := getattr(v, part)) is not None]
        elif isinstance(v, (staticmethod, classmethod)):
            steps.append((f".{k}.__func__", v.__func__))
    bases = enumerate(getattr(obj, "__bases__", ()))
    return steps + [(f".__bases__[{i}]", b) for i, b in bases if defined_in_notebook(b)]


def _apply_class(cls: type, attributes: dict[str, Any], note: Note) -> None:
    current = class_attributes(cls)
    for name in current:
        if name not in attributes:
            delattr(cls, name)
    for name, value in attributes.items():
        if current.get(name, _MISSING) is not value and value is not KEEP:
            setattr(cls, name, value)


_MISSING = object()


def _method_children(obj: Any) -> Steps:
    """A bound method's object (and function): ``push = log.append`` reaches ``log``."""
    function = getattr(obj, "__func__", None)
    return [(".__self__", obj.__self__)] + ([(".__func__", function)] if function is not None else [])


def _cell_children(obj: types.CellType) -> Steps:
    try:
        return [(".cell_contents", obj.cell_contents)]
    except ValueError:
        return []


def _cell_state(obj: types.CellType) -> CellState:
    try:
        return CellState(True, obj.cell_contents)
    except ValueError:
        return CellState(False, None)


def _same_cell(a: CellState, b: CellState) -> bool:
    return a.filled == b.filled and same_value(a.contents, b.contents)


def _apply_cell(cell: types.CellType, state: CellState, note: Note) -> None:
    if state.filled:
        cell.cell_contents = state.contents
    else:
        del cell.cell_contents


# large containers of atoms -----------------------------------------------------------


def _atoms_snapshot(obj: Any) -> tuple[list[Any], ...]:
    """Its items, in order (a dict's keys and values): atoms never change, so the container is
    unchanged exactly when each slot still holds the same object (no digest needed, and -0.0
    where 0.0 was is another object). A tuple or frozenset never changes at all."""
    if type(obj) in _FLAT:
        return ()
    return (list(obj), list(obj.values())) if type(obj) is dict else (list(obj),)


def _same_atoms(a: tuple[list[Any], ...], b: tuple[list[Any], ...]) -> bool:
    return all(len(x) == len(y) and all(map(operator.is_, x, y)) for x, y in zip(a, b))


def _atoms_travel(obj: Any) -> list[Any]:
    return list(obj.items()) if type(obj) is dict else list(obj)


def _apply_atoms(obj: Any, items: list[Any], note: Note) -> None:
    if type(obj) is list:
        obj[:] = items
    elif type(obj) is collections.deque:
        obj.clear()
        obj.extend(items)
    else:  # a dict (from its items) or a set
        obj.clear()
        obj.update(items)


# random generators -----------------------------------------------------------------


def rng_state(obj: Any) -> Any:
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        return obj.bit_generator.state
    if numpy is not None and isinstance(obj, numpy.random.RandomState):
        return obj.get_state()
    if hasattr(obj, "get_state"):  # torch.Generator
        return obj.get_state()
    return obj.getstate()


def _rng_snapshot(obj: Any) -> bytes:
    """The generator's state as bytes: a torch generator's state tensor by its bytes, as pickling
    a tensor is not byte for byte the same each time in a rank (it made an unchanged generator
    "changed", stale, then a conflict that refused every cell)."""
    state = rng_state(obj)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(state, torch.Tensor):
        return bytes(state.numpy().tobytes())
    return pickle.dumps(state)


def _apply_rng(obj: Any, state: Any, note: Note) -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        obj.bit_generator.state = state
    elif numpy is not None and isinstance(obj, numpy.random.RandomState):
        obj.set_state(state)
    elif hasattr(obj, "set_state"):
        obj.set_state(state)
    else:
        obj.setstate(state)


# pandas objects ------------------------------------------------------------------


def _pandas_children(obj: Any) -> Steps:
    """The Python objects in its object columns (a Series' or Index's, in its values): registered,
    so they keep their identity when it travels (under spawn they travel with it)."""
    pandas = sys.modules["pandas"]
    if isinstance(obj, pandas.DataFrame):
        objects = obj.select_dtypes(include=["object"]).to_numpy()
    elif obj.dtype == object:
        objects = obj.to_numpy()
    else:
        return []
    return [(f".<item {i}>", v) for i, v in enumerate(objects.ravel(order="K").tolist())]


def _apply_pandas(obj: Any, new: Any, note: Note) -> None:
    """A DataFrame's, Series' or Index's state is its ``__dict__`` (its BlockManager, name,
    attrs and flags; an Index's data and names): ``new``'s, which nothing else holds, is moved
    over. Its flags refer back to their object (a weakref): made anew for ``obj``; an Index keeps
    its identity token (``Index.is_``)."""
    if type(obj) is not type(new):
        obj.__class__ = type(new)
    state = dict(object.__getattribute__(new, "__dict__"))
    if "_flags" in state:
        state["_flags"] = type(new.flags)(obj, allows_duplicate_labels=new.flags.allows_duplicate_labels)
    current = object.__getattribute__(obj, "__dict__")
    if "_id" in current:
        state["_id"] = current["_id"]
    current.clear()
    current.update(state)


# C iterators, decimal.Context ---------------------------------------------------------


def reduced_state(obj: Any) -> ReducedState:
    with warnings.catch_warnings():  # Python 3.12 and 3.13 deprecate pickling itertools' objects
        warnings.simplefilter("ignore", DeprecationWarning)
        reduced = obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return ReducedState(reduced[0], tuple(reduced[1]), reduced[2] if len(reduced) > 2 else None)


def _reduced_children(obj: Any) -> Steps:
    """What it iterates over (a list, the iterators a zip holds): tracked on their own, so a zip
    whose iterators advanced is itself unchanged and they come back advanced in place."""
    state = reduced_state(obj)
    steps = [(f".<argument {k}>", v) for k, v in enumerate(state.args)]
    return steps + ([(".<state>", state.state)] if state.state is not None else [])


def _same_part(a: Any, b: Any) -> bool:
    """A part of a pickled state: the same value, or a tuple or list that each pickle makes anew
    (a Context's flags, a cycle's saved items) with the same values."""
    if same_value(a, b):
        return True
    if type(a) is type(b) and type(a) in (tuple, list) and len(a) == len(b):
        return all(_same_part(x, y) for x, y in zip(a, b))
    return False


def _same_reduced(a: ReducedState, b: ReducedState) -> bool:
    return a.rebuild is b.rebuild and _same_part(a.args, b.args) and _same_part(a.state, b.state)


def _is_context(obj: Any) -> bool:
    decimal = sys.modules.get("decimal")
    return decimal is not None and isinstance(obj, decimal.Context)


def _reduced_travels(obj: Any) -> ReducedState | Replaced:
    """The new state, where the notebook's object can take it in place (a list iterator's
    ``__setstate__``, a Context's settable fields); else a copy (see Replaced)."""
    state = reduced_state(obj)
    if _is_context(obj) or state.state is not None and hasattr(obj, "__setstate__"):
        return state
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return Replaced(copy.copy(obj))


_CONTEXT_FIELDS = ("prec", "rounding", "Emin", "Emax", "capitals", "clamp", "flags", "traps")


def _apply_reduced(obj: Any, state: ReducedState | Lost, note: Note) -> None:
    if isinstance(state, Lost):
        note(state.reason)
    elif _is_context(obj):
        new = state.rebuild(*state.args)
        for name in _CONTEXT_FIELDS:
            setattr(obj, name, getattr(new, name))
    else:
        obj.__setstate__(state.state)


# generators, functools.lru_cache ----------------------------------------------------


def _frame_state(gen: types.GeneratorType) -> FrameState:
    frame = gen.gi_frame
    if frame is None:
        return FrameState(None, [])
    return FrameState(frame.f_lasti, list(frame.f_locals.items()))


def _generator_children(gen: types.GeneratorType) -> Steps:
    """The objects its suspended frame holds: what it changes when it runs on (its globals are
    reached through its code, see reach)."""
    frame = gen.gi_frame
    return [] if frame is None else [(f".gi_frame.f_locals[{k!r}]", v) for k, v in frame.f_locals.items()]


def _same_frame(a: FrameState, b: FrameState) -> bool:
    return a.position == b.position and same_pairs(a.locals, b.locals)


_GENERATOR_LOST = Lost(
    "it advanced in the cell, but a generator's frame cannot be pickled: in the notebook it resumes "
    "where it was before the cell (the objects its frame holds, such as the iterator it reads, come "
    "back as the cell left them)"
)
_CACHE_LOST = Lost(
    "its cached results (functools.lru_cache keeps them in C) and any attribute the cell set on it "
    "stay in the worker: the notebook's cache is as it was before the cell"
)


def _note_lost(obj: Any, state: Lost, note: Note) -> None:
    """Named in the notebook, where the object's path is known (a spawned master's registry has
    none)."""
    note(state.reason)


def _cache_state(obj: Any) -> CacheState:
    return CacheState(obj.cache_info().currsize, _attributes(obj))


def _same_cache(a: CacheState, b: CacheState) -> bool:
    return a.entries == b.entries and _same_attributes(a.attributes, b.attributes)


def _weakref_children(ref: weakref.ReferenceType) -> Steps:
    """Its referent, while alive: registered, so that under spawn it travels with the weakref
    (a hook's handle reaches its hooks' dict so) and what is done through it comes back."""
    referent = ref()
    return [("()", referent)] if referent is not None else []


# -----------------------------------------------------------------------------

OPS: dict[Kind, KindOps] = {
    Kind.NAMESPACE: KindOps(),
    Kind.OPAQUE: KindOps(),
    Kind.TENSOR: KindOps(
        _tensor_children, tensor_state, _same_tensor, _tensor_changed, apply=apply_tensor, has_storage=True
    ),
    Kind.NDARRAY: KindOps(
        _array_children,
        array_digest,
        changed=array_changed,
        travels=lambda obj: obj.copy(),  # by value: the object itself would travel as a reference
        apply=_apply_ndarray,
    ),
    # Compared as the bytes of a pickle of the state; the state itself is sent fresh.
    Kind.RNG: KindOps(snapshot=_rng_snapshot, travels=rng_state, apply=_apply_rng),
    Kind.FUNCTION: KindOps(
        _function_children, _function_state, _same_function, apply=_apply_function, reads_globals=True
    ),
    Kind.CLASS: KindOps(_class_children, class_attributes, same_dict, apply=_apply_class),
    Kind.METHOD: KindOps(_method_children),
    Kind.CELL: KindOps(_cell_children, _cell_state, _same_cell, apply=_apply_cell),
    Kind.DICT: KindOps(_dict_children, _dict_state, _same_dict_state, apply=_apply_dict, trim=_dict_that_pickles),
    Kind.LIST: KindOps(_sequence_children, _items_state, _same_sequence, apply=_apply_list),
    Kind.DEQUE: KindOps(_sequence_children, _items_state, _same_sequence, apply=_apply_deque),
    Kind.SET: KindOps(_set_children, _items_state, _same_set, apply=_apply_set),
    Kind.TUPLE: KindOps(_tuple_children),
    Kind.BYTEARRAY: KindOps(snapshot=digest, travels=bytes, apply=_apply_bytearray),
    Kind.ARRAY: KindOps(snapshot=digest, travels=lambda obj: obj.tobytes(), apply=_apply_array),
    Kind.PARTIAL: KindOps(
        _partial_children, _object_state, _same_object, apply=_apply_object, trim=_object_that_pickles
    ),
    # By value: compared as a digest of its pickle; a deep copy travels (the object itself would
    # travel as a reference), whose state replaces the notebook's object's.
    Kind.PANDAS: KindOps(_pandas_children, pickle_digest, travels=lambda obj: obj.copy(deep=True), apply=_apply_pandas),
    Kind.REDUCED: KindOps(
        _reduced_children, reduced_state, _same_reduced, travels=_reduced_travels, apply=_apply_reduced
    ),
    Kind.WEAKREF: KindOps(_weakref_children),
    Kind.GENERATOR: KindOps(
        _generator_children,
        _frame_state,
        _same_frame,
        travels=lambda gen: _GENERATOR_LOST,
        apply=_note_lost,
        reads_globals=True,
    ),
    Kind.CACHE: KindOps(_attribute_steps, _cache_state, _same_cache, travels=lambda obj: _CACHE_LOST, apply=_note_lost),
    Kind.OBJECT: KindOps(_attribute_steps, _object_state, _same_object, apply=_apply_object, trim=_object_that_pickles),
    Kind.ATOMS: KindOps(snapshot=_atoms_snapshot, same=_same_atoms, travels=_atoms_travel, apply=_apply_atoms),
    Kind.PLAIN: KindOps(snapshot=_plain_snapshot, travels=_plain_travels, apply=_apply_plain),
}
"""Each kind's operations (see the module's docstring)."""
