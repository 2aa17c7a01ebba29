"""Where an object sits in a namespace: its path (a variable, then attribute and item steps), so
that the notebook's objects and a session rank's own correspond.

A one-off cell's workers inherit the notebook's objects (fork) or get copies index for index
(spawn). A session's ranks built their objects themselves, cell after cell, and some of them
are the rank's alone (a DDP wrapper, CUDA tensors where the notebook holds CPU copies). They
correspond as DDP itself assumes every rank built the same model: by path from the namespace,
the first one the registry's breadth-first walk over sorted names found, each step one of the
steps its kind's ``children`` gives (``.fc``, ``['lr']``, ``._parameters['weight']``), the
type checked at the end.

An ``ObjectSpec`` per registry index says where the object is; ``registry_at`` builds, in a
rank, the registry of its own objects at the notebook's indices, storages included (a tensor's
spec names the storage indices it brings), so that changes pickled against one registry load
against the other (see collect, apply).
"""

from __future__ import annotations

import collections
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from enot_nb._serialize.tensors import tensor_storages
from enot_nb._session.tasks import ObjectSpec, RegistrySpecs
from enot_nb._state.kinds import OPS, SET_ITEM, Kind, kind_of
from enot_nb._state.registry import Registry


class PathError(LookupError):
    """An object of the notebook has no counterpart of its type at its path on a rank."""

    def __init__(self, variable: str, path: str, why: str) -> None:
        self.variable, self.path, self.why = variable, path, why
        super().__init__(f"{path}: {why}")


def type_name(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def specs_of(registry: Registry, indices: list[int] | None = None, sizes: list[int] | None = None) -> list[ObjectSpec]:
    """The specs of ``indices`` (every object if None) and of all their parents, in index order
    (a parent before its children: the walk is breadth first). ``sizes``: each storage's bytes
    as the rank should have them (a push: as they were at the last sync); default: now."""
    wanted: set[int] = set()
    for i in range(1, len(registry.objects)) if indices is None else indices:
        while i > 0 and i not in wanted:
            wanted.add(i)
            i = registry.parents[i][0]
    owners = _storage_owners(registry, wanted)
    if sizes is None:
        sizes = [s.nbytes() for s in registry.storages]
    specs = []
    for i in sorted(wanted):
        held = owners.get(i, ())
        parent, step = registry.parents[i]
        sized = tuple(sizes[j] if j >= 0 else -1 for j in held)
        plain = registry.kinds[i] is Kind.PLAIN
        specs.append(ObjectSpec(i, parent, step, type_name(registry.objects[i]), held, sized, plain))
    return specs


def _storage_owners(registry: Registry, wanted: set[int]) -> dict[int, tuple[int, ...]]:
    owners: dict[int, tuple[int, ...]] = {}
    for i in wanted:
        if OPS[registry.kinds[i]].has_storage:
            found = [registry.find_storage(s) for s in tensor_storages(registry.objects[i])]
            owners[i] = tuple(-1 if j is None else j for j in found)
    return owners


def storage_holders(registry: Registry, storages: set[int]) -> list[int]:
    """For each storage index in ``storages``, a registered tensor that holds it."""
    holders, left = [], set(storages)
    for i, kind in enumerate(registry.kinds):
        if not left:
            break
        if OPS[kind].has_storage:
            found = {registry.find_storage(s) for s in tensor_storages(registry.objects[i])}
            if found & left:
                holders.append(i)
                left -= found
    return holders


class _Missing:
    """Stands where a rank has no counterpart: untracked, found by nothing."""

    def __repr__(self) -> str:
        return "<no counterpart on this rank>"


_MISSING = _Missing()


def has_placeholders(registry: Registry, start: int = 0) -> bool:
    """Whether some object of a rank's registry (registry_at), from index ``start``, had no
    counterpart here."""
    return any(type(obj) is _Missing for obj in registry.objects[start:])


def registry_at(
    namespace: dict[str, Any], specs: list[ObjectSpec] | tuple, objects: int, storages: int, strict: bool
) -> Registry:
    """This rank's objects at the notebook's registry indices (``objects`` of them, with
    ``storages`` storages). ``strict``: an object with no counterpart raises PathError (a push
    that would change it cannot be applied); else a placeholder stands there (the rank's object
    is then new to the notebook)."""
    registry = Registry()
    registry.objects = [_MISSING] * objects  # one placeholder: a baseline may hold 300k objects
    registry.kinds = [Kind.OPAQUE] * objects
    registry.parents = [(-1, "")] * objects
    registry.storages = [None] * storages
    registry.objects[0], registry.kinds[0] = namespace, Kind.NAMESPACE
    registry.index[id(namespace)] = 0
    children: dict[int, dict[str, list[Any]]] = {}
    for spec in specs:
        try:
            _place(registry, spec, children)
        except PathError as err:
            if strict:
                raise
            if os.environ.get("ENOT_NB_DEBUG"):
                print(f"enot_nb: no counterpart here for {err}", file=sys.stderr)
    if storages and any(s is None for s in registry.storages):  # of tensors with no counterpart
        import torch

        empty = torch.UntypedStorage(0)  # one for all: a push with no specs lacks every storage
        registry.storages = [empty if s is None else s for s in registry.storages]
    return registry


def _place(registry: Registry, spec: ObjectSpec, children: dict[int, dict[str, list[Any]]]) -> None:
    """This rank's object at ``spec``, and its storages, registered at the spec's indices."""
    registry.parents[spec.at] = (spec.parent, spec.step)
    obj = _child(registry, spec, children)
    registry.objects[spec.at], registry.kinds[spec.at] = obj, _kind_at(spec, obj)
    registry.index[id(obj)] = spec.at
    if spec.storages:
        for j, storage in zip(spec.storages, tensor_storages(obj)):
            if j >= 0 and registry.find_storage(storage) is None:
                registry.storages[j] = storage
                registry.storage_index[id(storage)] = j


def _kind_at(spec: ObjectSpec, obj: Any) -> Kind:
    """This rank's object's kind, plain data where the sender's was (its items have no specs)."""
    kind = kind_of(obj) or Kind.OPAQUE
    return Kind.PLAIN if spec.plain and kind in (Kind.LIST, Kind.DICT) else kind


def grown_at(registry: Registry, added: list[ObjectSpec], objects: int, storages: int) -> bool:
    """A rank's registry (registry_at's) made, in place, what ``registry_at`` of its specs and
    ``added`` gives (the notebook's registry grew to ``objects`` and ``storages``: a list
    appended to); False, and the registry to be dropped, where an added object or storage has
    no counterpart here."""
    first = len(registry.objects), len(registry.storages)
    grown = objects - first[0], storages - first[1]
    if grown[0] < 0 or grown[1] < 0 or any(spec.at < len(registry.objects) for spec in added):
        return False
    registry.objects += [_MISSING] * grown[0]
    registry.kinds += [Kind.OPAQUE] * grown[0]
    registry.parents += [(-1, "")] * grown[0]
    registry.storages += [None] * grown[1]
    children: dict[int, dict[str, list[Any]]] = {}
    try:
        for spec in added:
            _place(registry, spec, children)
    except PathError:
        return False
    return not has_placeholders(registry, first[0]) and all(s is not None for s in registry.storages[first[1] :])


@dataclass
class FoundAgain:
    """The objects (indices) that ``found_again`` put in new places, and their storages'."""

    objects: list[int] = field(default_factory=list)
    storages: list[int] = field(default_factory=list)


def found_again(registry: Registry, specs: list[ObjectSpec], changed: list[int]) -> FoundAgain | None:
    """After a cell changed the states of the objects at ``changed`` in a rank's registry (made by
    ``registry_at(specs)``): that registry made, in place, what ``registry_at(specs)`` would find
    now. Each changed object is found again, as is each spec under one (and under one found
    anew, in turn: the specs are in index order, a parent first); an object that is not the one
    registered there takes its index, and its storages those of the old one's (a training
    step's new ``.grad`` tensors). None, and the registry left as it was, where one has no
    counterpart now (of its type and storage sizes), is on other storages than its index's, is
    registered at another index, or shares a storage with another spec (which of them a fresh
    find gives the storage's index depends on the order); and, where one is to take a new
    object's place, where the registry is not each spec's own object and storages as the specs
    say (``_as_specified``: the rank shares what the notebook does not, or a storage was
    resized), which finding only the changes cannot mend."""
    wanted, moved = set(changed), set(changed)
    users = collections.Counter(j for spec in specs for j in spec.storages if j >= 0)
    now = Registry(objects=list(registry.objects), kinds=list(registry.kinds), parents=registry.parents)
    children: dict[int, dict[str, list[Any]]] = {}
    moves: list[tuple[ObjectSpec, Any, list[Any]]] = []
    claimed: set[int] = set()  # the new objects and storages (ids)
    for spec in specs:
        if spec.parent not in wanted and spec.at not in moved:  # a changed one: its size, its storages
            continue
        try:
            obj = _child(now, spec, children)
        except PathError:
            return None
        storages = tensor_storages(obj) if spec.storages else []
        if len(storages) != len(spec.storages):
            return None
        if obj is registry.objects[spec.at]:
            if any(j >= 0 and registry.storages[j] is not s for j, s in zip(spec.storages, storages)):
                return None  # on another storage now (``t.data = other``)
            now.kinds[spec.at] = _kind_at(spec, obj)  # a list grown into an atoms container
            continue
        ids = {id(obj), *map(id, storages)}
        if registry.find(obj) is not None or ids & claimed or len(ids) != 1 + len(storages):
            return None  # (two new ones sharing an object or a storage: the first found takes it)
        if any(users[j] != 1 for j in spec.storages if j >= 0):
            return None
        if any(registry.find_storage(storage) is not None for storage in storages):
            return None
        claimed |= ids
        now.objects[spec.at], now.kinds[spec.at] = obj, _kind_at(spec, obj)
        moves.append((spec, obj, storages))
        wanted.add(spec.at)
    if moves and not _as_specified(registry, specs):  # (where nothing moves, it is as registry_at left it)
        return None
    found = FoundAgain()
    registry.kinds[:] = now.kinds
    for spec, obj, storages in moves:
        registry.index.pop(id(registry.objects[spec.at]), None)
        registry.objects[spec.at], registry.index[id(obj)] = obj, spec.at
        for j, storage in zip(spec.storages, storages):
            if j >= 0:
                registry.storage_index.pop(id(registry.storages[j]), None)
                registry.storages[j], registry.storage_index[id(storage)] = storage, j
                found.storages.append(j)
        found.objects.append(spec.at)
    return found


def _as_specified(registry: Registry, specs: list[ObjectSpec]) -> bool:
    """Whether each spec's object in ``registry`` holds its own index, and its storages their own
    slots, of the sizes the spec says. Not so where this rank's objects share what the notebook's
    do not (the same object, or a view of one storage, at two specs: registry_at registered it
    once, leaving the other slot empty) or a storage was resized: a fresh find then gives what
    no update of the changed objects alone would."""
    for spec in specs:
        obj = registry.objects[spec.at]
        if type(obj) is _Missing or registry.index.get(id(obj)) != spec.at:
            return False
        if spec.storages:
            storages = tensor_storages(obj)
            if len(storages) != len(spec.storages):
                return False
            if any(j >= 0 and registry.storages[j] is not s for j, s in zip(spec.storages, storages)):
                return False
            if spec.sizes and tuple(s.nbytes() for s in storages) != spec.sizes:
                return False
    return True


def _variable(registry: Registry, spec: ObjectSpec) -> str:
    root = spec.at
    while registry.parents[root][0] > 0:
        root = registry.parents[root][0]
    return registry.parents[root][1]


def _child(registry: Registry, spec: ObjectSpec, children: dict[int, dict[str, list[Any]]]) -> Any:
    def fail(why: str) -> PathError:
        return PathError(_variable(registry, spec), registry.path(spec.at), why)

    parent = registry.objects[spec.parent]
    if isinstance(parent, _Missing):
        raise fail("the object holding it has no counterpart on this rank")
    if spec.parent == 0:
        if spec.step not in parent:
            raise fail("no such variable on this rank")
        obj = parent[spec.step]
    elif type(parent) is list and spec.step.startswith("["):  # an item by its index: no need to list them all
        at = int(spec.step[1:-1])
        if at >= len(parent):
            raise fail("nothing there on this rank")
        obj = parent[at]
    else:
        try:
            steps = registry.held_by_step(spec.parent, children)
        except Exception as err:  # noqa: BLE001 - an object that resists inspection
            raise fail(f"its holder cannot be inspected here ({err})") from err
        found = steps.get(spec.step, [])
        if not found:
            raise fail("nothing there on this rank")
        if len(found) > 1 and not spec.step.startswith(SET_ITEM):
            raise fail("the step is ambiguous")
        # A set's items with one step hold the same values: each spec takes one of them.
        obj = found.pop(0)
    if type_name(obj) != spec.type_name and not _sharded_of(obj, spec.type_name):
        raise fail(f"a {spec.type_name} in the notebook, a {type_name(obj)} on this rank")
    if spec.sizes:
        here = tuple(s.nbytes() for s in tensor_storages(obj))
        # -1: a storage the notebook made since the last sync (``p.data = ...``, ``.set_()``,
        # ``.double()``): the push brings it whole, in place of the rank's, whatever its size
        if len(here) != len(spec.sizes) or any(n >= 0 and n != m for n, m in zip(spec.sizes, here)):
            raise fail(f"its storage holds {spec.sizes} bytes in the notebook, {here} on this rank")
    return obj


def _sharded_of(obj: Any, name: str) -> bool:
    """Whether ``obj``'s class is the one FSDP2 made of the class ``name`` (``FSDPSequential``
    of ``Sequential``): the same module, sharded on this rank."""
    cls = type(obj)
    return cls.__module__.startswith("torch.distributed.fsdp") and any(
        f"{base.__module__}.{base.__qualname__}" == name for base in cls.__mro__[1:]
    )


def mirrored(registry: Registry) -> RegistrySpecs:
    """What the master needs to find its own objects at the notebook's registry indices."""
    return RegistrySpecs(specs_of(registry), len(registry.objects), len(registry.storages))
