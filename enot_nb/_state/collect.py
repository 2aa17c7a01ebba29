"""What a cell changed, as the master sends it and the notebook applies it.

Master (worker side)::

    Snapshot before the cell -> the cell -> Changes: names (re)bound and deleted, the registered
    objects whose shallow state changed (with their new state), the storages whose bytes changed
    (only the runs of pages written, where pagemap tells them) -> pickled by StatePickler: a
    registered object travels as ("o", index), a registered storage as ("s", index); everything
    new travels by value (tensor bytes out of band)

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
from typing import Any, NamedTuple

from enot_nb._memory.digests import written_parts
from enot_nb._serialize import picklers
from enot_nb._serialize.picklers import ResultPickler
from enot_nb._serialize.tensors import array_extent, array_owner, storage_array
from enot_nb._state.kinds import ATOMS_MIN, OPS, Kind, items_held_elsewhere, kind_of, plain_pickle
from enot_nb._state.registry import Registry, user_variables
from enot_nb._state.snapshot import Snapshot
from enot_nb._state.states import VALUE_TYPES, Attributes, DictState, ItemsState, Lost, Replaced


class StorageBytes(NamedTuple):
    """A registered storage's new bytes: all of them (``whole``: its size may have changed), or
    the runs of pages the master may have written, each as (offset, bytes)."""

    storage: int  # its index in the registry
    whole: bool
    parts: list[tuple[int, Any]]


WHOLE_ABOVE = 0.5
"""A storage of which more than this share may have been written travels whole (one buffer)."""


@dataclass
class Changes:
    """Everything the notebook must change to hold what the master holds."""

    bound: dict[str, Any] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    objects: list[tuple[int, Any]] = field(default_factory=list)
    """(registry index, new shallow state) of each registered object that changed."""
    storages: list[StorageBytes] = field(default_factory=list)
    value: Any = None
    has_value: bool = False
    unloaded: list[str] = field(default_factory=list)
    """Set by the notebook (see salvage): what could not be rebuilt there, a line each; the
    notebook keeps its own."""
    sharded: list[Any] = field(default_factory=list)
    """A session's push: the notebook's changes to modules the ranks hold sharded, loaded into
    theirs by every rank together (_session/tasks.ShardedLoad)."""


@dataclass
class PickledState:
    """Changes pickled against a registry; the buffers travel out of band (see picklers)."""

    main: bytes
    buffers: list[Any]


# ----------------------------------------------------------------------------- master side


def collect(
    registry: Registry,
    snapshot: Snapshot,
    names_before: dict[str, Any],
    namespace: dict[str, Any],
    hidden: Any = (),
    within: tuple[set[int], set[int]] | None = None,
) -> tuple[Changes, list[int]]:
    """The changes the cell made; also the indices of the changed objects (for their names).
    ``within``: the indices of the only objects and storages that can have changed."""
    changes = Changes()
    now = user_variables(namespace, hidden)
    changes.bound = {n: v for n, v in now.items() if names_before.get(n, _MISSING) is not v}
    changes.deleted = [n for n in names_before if n not in now]
    changed = snapshot.changed_objects(registry, within[0] if within is not None else None)
    objects = {i: OPS[registry.kinds[i]].new_state(registry.objects[i]) for i in changed}
    for i, state in list(objects.items()):
        if isinstance(state, Replaced):
            del objects[i]
            if not _hold_copy(registry, registry.objects[i], state.copy, now, changes.bound, objects):
                objects[i] = Lost(
                    "it changed in the cell but cannot change in place (it has no __setstate__), and "
                    "nothing holds it that could hold a copy instead: the notebook keeps its own (the "
                    "objects it refers to come back changed)"
                )
    changes.objects = list(objects.items())
    storages = snapshot.changed_storages(registry, within[1] if within is not None else None)
    written = written_parts([registry.storages[j] for j in storages], [snapshot.storages[j] for j in storages])
    changes.storages = [_new_bytes(j, registry.storages[j], parts) for j, parts in zip(storages, written)]
    return changes, changed


def as_whole_changes(
    registry: Registry, namespace: dict[str, Any], names: list[str], whole: tuple[int, int] | None = None
) -> Changes:
    """``names`` as changes against a registry of the notebook's objects at their paths (see
    paths.registry_at): every object found here sends its whole state (into the notebook's own
    object), every storage its bytes; a name the notebook does not hold in place travels by value.
    ``whole``: only the objects and storages below these indices send their states; the rest
    are there to be referred to (see tasks.PullTask)."""
    changes = Changes()
    objects, storages = whole if whole is not None else (len(registry.objects), len(registry.storages))
    at_top = {registry.parents[i][1] for i in range(1, objects) if registry.parents[i][0] == 0}
    changes.bound = {n: namespace[n] for n in names if n not in at_top or registry.find(namespace[n]) is None}
    found = [i for i in range(1, objects) if registry.find(registry.objects[i]) == i]
    # Only the storages found here: one with no counterpart on this rank stands as an empty
    # placeholder (see paths.registry_at), which would empty the notebook's.
    found_here = [
        j for j, s in enumerate(registry.storages[:storages]) if s is not None and registry.find_storage(s) == j
    ]
    states = whole_states(registry, found, found_here)
    changes.objects, changes.storages = states.objects, states.storages
    return changes


def whole_states(registry: Registry, objects: list[int], storages: list[int]) -> Changes:
    """The whole states of ``objects`` and the bytes of ``storages`` (indices into
    ``registry``), as changes: what makes the receiver's copies these, whatever they hold."""
    changes = Changes()
    for i in objects:
        if OPS[registry.kinds[i]].snapshot is not None:
            state = OPS[registry.kinds[i]].new_state(registry.objects[i])
            if not isinstance(state, Replaced):
                changes.objects.append((i, state))
    changes.storages = [_new_bytes(j, registry.storages[j], None) for j in storages]
    return changes


def _new_bytes(j: int, storage: Any, parts: list[tuple[int, int]] | None) -> StorageBytes:
    """By value, as buffers (the storage itself would travel as a reference to the notebook's):
    only the pages written where pagemap tells them (one element of 1 GiB: a page or two)."""
    data = storage_array(storage)
    if parts is None or sum(n for _, n in parts) > WHOLE_ABOVE * data.nbytes:
        parts = [(0, data.nbytes)]
        whole = True
    else:
        whole = False
    # (numpy declares the buffer protocol to type checkers for Python 3.12+ only.)
    buffers = [(o, pickle.PickleBuffer(data[o : o + n])) for o, n in parts]  # type: ignore[arg-type]
    return StorageBytes(j, whole, buffers)


_MISSING = object()

_HOLDERS = (Kind.LIST, Kind.DEQUE, Kind.DICT, Kind.OBJECT)


def _hold_copy(
    registry: Registry, obj: Any, copy: Any, now: dict[str, Any], bound: dict[str, Any], objects: dict[int, Any]
) -> bool:
    """An object that could not take its new state in place (see states.Replaced): the names, and
    the registered lists, dicts and objects, that hold it hold ``copy`` instead, as their new
    states. Whether anything held it."""
    names = [n for n, v in now.items() if v is obj]
    bound.update(dict.fromkeys(names, copy))
    held = bool(names)
    for j, kind in enumerate(registry.kinds):
        ops, holder = OPS[kind], registry.objects[j]
        if kind not in _HOLDERS or ops.children is None or holder is obj:
            continue
        try:
            steps = ops.children(holder)
        except Exception:  # noqa: BLE001 - an object that resists inspection, as in the registry's walk
            continue
        if any(child is obj for _, child in steps):
            objects[j] = _swap(objects[j] if j in objects else ops.new_state(holder), obj, copy)
            held = True
    return held


def _swap(state: Any, old: Any, new: Any) -> Any:
    """A list's, dict's or object's state (see states) with ``new`` wherever it held ``old``."""

    def one(value: Any) -> Any:
        return new if value is old else value

    def attributes(a: Attributes) -> Attributes:
        values = None if a.vars is None else {k: one(v) for k, v in a.vars.items()}
        return Attributes(values, {k: one(v) for k, v in a.slots.items()})

    if isinstance(state, ItemsState):
        return ItemsState([one(v) for v in state.items], attributes(state.attributes))
    if isinstance(state, DictState):
        return state._replace(items=[(k, one(v)) for k, v in state.items], attributes=attributes(state.attributes))
    return state._replace(attributes=attributes(state.attributes))  # ObjectState


class StatePickler(ResultPickler):
    """Pickles Changes: registered objects and storages by reference (their index)."""

    def __init__(self, file: Any, buffer_callback: Any = None, *, registry: Registry) -> None:
        super().__init__(file, buffer_callback=buffer_callback, namespace=registry.objects[0])
        self.registry = registry
        self._arrays: dict[int, list[Any]] | None = None
        """The contiguous arrays the receiver holds, by the id of their memory's owner."""
        self._strided: dict[int, list[Any]] = {}
        """The strided ones, as _arrays."""
        self._travelling: set[int] = set()
        """The registered objects whose new state this pickle carries (see _in_plain)."""
        self._carries_changes = False
        """Whether this pickle carries a change or binds a name to anything but an immutable
        value (see _in_plain)."""
        self._plain_items: dict[int, tuple[int, Any]] | None = None
        """The lists, dicts and bytearrays that are items of registered plain data, by id: (the
        data's index, their key in it). Made when first asked for (see _in_plain)."""

    def dump(self, obj: Any) -> None:
        """Pickle ``obj``: Changes, or a task carrying them as its ``push``."""
        changes = obj if isinstance(obj, Changes) else getattr(obj, "push", None)
        self._travelling = {i for i, _ in changes.objects} if isinstance(changes, Changes) else set()
        bound = changes.bound.values() if isinstance(changes, Changes) else ()
        self._carries_changes = bool(changes.objects) if isinstance(changes, Changes) else False
        self._carries_changes |= any(type(v) not in VALUE_TYPES for v in bound)
        self._plain_items = None
        super().dump(obj)

    def known_arrays(self) -> list[Any]:
        return [obj for obj, kind in zip(self.registry.objects, self.registry.kinds) if kind is Kind.NDARRAY]

    def known_storages(self) -> list[Any]:
        return list(self.registry.storages)

    def _known_by_owner(self) -> dict[int, list[Any]]:
        if self._arrays is None:
            self._arrays = {}
            for obj in self.known_arrays():
                by_owner = self._arrays if obj.flags.c_contiguous else self._strided
                by_owner.setdefault(id(array_owner(obj)), []).append(obj)
        return self._arrays

    def strided_known(self, root: Any) -> list[Any]:
        self._known_by_owner()
        return self._strided.get(id(root), [])

    def view_of(self, owner: Any) -> Any:
        known = self._known_by_owner().get(id(owner))
        return known[0] if known else None

    def is_known(self, array: Any, root: Any) -> Any:
        """A contiguous array the receiver holds whose memory holds ``array``'s, or None."""
        start, end = array_extent(array)
        known = self._known_by_owner().get(id(root), ())
        for candidate in known:
            known_start, known_end = array_extent(candidate)
            if known_start <= start and end <= known_end:
                return candidate
        return None

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in VALUE_TYPES:  # never registered: skip the lookups
            return None
        i = self.registry.find(obj)
        if i is not None:
            return ("o", i)
        j = self.registry.find_storage(obj)
        if j is not None:
            return ("s", j)
        if type(obj) not in (list, dict, bytearray):
            return None
        item = self._in_plain(obj)
        if item is None and type(obj) is not bytearray and len(obj) >= ATOMS_MIN:
            # Plain data (kinds ATOMS and PLAIN), by value in one C pickle: this pickler would
            # call back for each item.
            pickled = plain_pickle(obj)
            if pickled is not None:
                return ("v", pickled)
        return item

    def _in_plain(self, obj: Any) -> Any:
        """``("p", i, steps)`` where ``obj``, in a pickle that carries changes, is an item of
        registered plain data ``i`` (kind PLAIN: one object, its items not registered): the
        loading side takes its own item there, so ``last = log[-1]``, ``d = {'k': log[0]}`` and
        ``D['k'] = log[0]`` keep their aliases (by value each would be a copy). Not inside one
        whose new state travels in this pickle: its items go by value with it. The items that
        something else holds too are indexed once per such pickle (kinds.items_held_elsewhere),
        so a task alone costs nothing; an item deeper inside goes by value."""
        if not self._carries_changes:
            return None
        if self._plain_items is None:
            self._plain_items = {}
            for i, kind in enumerate(self.registry.kinds):
                if kind is Kind.PLAIN and i not in self._travelling:
                    for key, item in items_held_elsewhere(self.registry.objects[i]):
                        self._plain_items.setdefault(id(item), (i, key))
        found = self._plain_items.get(id(obj))
        return None if found is None else ("p", found[0], (found[1],))


def item_at(container: Any, steps: tuple[Any, ...]) -> Any:
    """The item ``_in_plain`` named: ``container[steps[0]][steps[1]]...``."""
    for step in steps:
        container = container[step]
    return container


def dump(changes: Changes, registry: Registry, not_returned: dict[str, str]) -> tuple[PickledState, int]:
    """Pickle the changes; what cannot be pickled is left out and named in ``not_returned``."""
    for name, value in changes.bound.items():
        if _cached_entries(value):
            not_returned[f"{name}'s cache"] = (
                "the cached results live in C (functools.lru_cache): the function came back with an empty cache"
            )
    try:
        return _pickled(changes, registry)
    except Exception:  # noqa: BLE001 - find the culprits (by dry runs), then pickle the rest
        pass  # (out of the handler: its traceback would keep the failed pickle's copies alive)
    _leave_out_unpicklable(changes, registry, not_returned)
    return _pickled(changes, registry)


def _pickled(changes: Changes, registry: Registry) -> tuple[PickledState, int]:
    """The changes pickled, and how many of their tensors are off the CPU. Pickled at once, not
    after a dry run: the dry run is for a pickle that failed (a cell's every answer paid for
    two pickles before)."""
    buffers: list[Any] = []
    stream = io.BytesIO()
    pickler = StatePickler(stream, buffer_callback=buffers.append, registry=registry)
    try:
        pickler.dump(changes)
    except BaseException:
        buffers.clear()  # the host copies of GPU storages met so far: freed before the retry
        pickler.clear_memo()
        raise
    return PickledState(stream.getvalue(), buffers), pickler.off_cpu


def _cached_entries(value: Any) -> int:
    """How many results a notebook function's lru_cache holds (0 for anything else)."""
    try:
        return value.cache_info().currsize if kind_of(value) is Kind.CACHE else 0
    except Exception:  # noqa: BLE001 - an object that resists inspection holds no cache we know of
        return 0


def _dry(obj: Any, registry: Registry) -> int:
    return picklers.dry_run(obj, pickler_class=StatePickler, registry=registry)


def _reason(value: Any, registry: Registry, shown_as: str | None = None) -> str | None:
    try:
        _dry(value, registry)
    except Exception as err:  # noqa: BLE001 - any failure means it cannot come back
        return f"{shown_as or type(value).__name__} cannot be pickled: {err}"
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
    """Leave out the attributes or items of a changed object that cannot be pickled (where
    its kind can do without them: see KindOps.trim), or else the whole change."""
    trim, path = OPS[registry.kinds[i]].trim, registry.path(i)
    if trim is not None:
        state = trim(state, path, lambda value: _reason(value, registry), not_returned)
    # A state record is named "tuple" in the message, as it was before the states had names.
    reason = _reason(state, registry, "tuple" if isinstance(state, tuple) else None)
    if reason:
        not_returned[path] = reason
        return None
    return state
