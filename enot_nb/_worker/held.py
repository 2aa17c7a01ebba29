"""What a rank holds, walked at any depth from its variables: the objects a repair acts on and
a replica check compares (DDP wrappers, optimizers, FSDP modules, DTensors), each named by its
path (``nets['G']``), the same on every rank that ran the same cells."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from enot_nb._state.kinds import Kind, held_still
from enot_nb._state.registry import Registry, user_variables
from enot_nb._state.states import object_dict

DDP = ("torch.nn.parallel.distributed", "DistributedDataParallel")
ZERO = ("torch.distributed.optim.zero_redundancy_optimizer", "ZeroRedundancyOptimizer")
HELD_KINDS = (
    DDP,  # first: the wrappers a repair rebinds
    ("torch.optim", "Optimizer"),
    ("torch.distributed.fsdp", "FSDPModule"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
    ("torch.distributed.tensor", "DTensor"),
)
"""The classes (module, name) of what a repair and a replica check act on."""


def reach(namespace: dict[str, Any], looking_for: list[Any] | None = None) -> Registry:
    """What the rank's variables hold, at any depth, walked as a cell's registry is (breadth
    first from the names in sorted order; a large plain container is one object): the same
    objects at the same paths on every rank that ran the same cells. ``looking_for``: the walk
    stops once it has registered each of these (none: at once), None: it goes to its end."""
    search = _Search.of_namespace(namespace, [])  # the namespace alone, at index 0
    assert isinstance(search, _Search)
    if looking_for is not None and not looking_for:
        return search
    search.left = None if looking_for is None else {id(o) for o in looking_for}
    with held_still():
        try:
            search.extend(sorted(user_variables(namespace)), namespace)
        except _AllFound:
            pass
    return search


class _AllFound(Exception):
    pass


@dataclass
class _Search(Registry):
    """A registry walk that ends once it has registered every object it looks for (their paths
    are those of the whole walk: breadth first, a path is found before any longer one). With
    the optimizer and the wrapper in variables, the walk ends among the variables, whatever
    large data they also hold: a walk to its end costs about 13 us an object, 4 s over 300,000
    small objects (docs/performance.md), and a rank that takes longer than the release wait to
    repair makes the session restart."""

    left: set[int] | None = None
    """The ids of the objects not found yet; None: the walk goes to its end."""

    def _add(self, obj: Any, kind: Kind, parent: int, step: str) -> int:
        i = super()._add(obj, kind, parent, step)
        if self.left is not None and id(obj) in self.left:
            self.left.discard(id(obj))
            if not self.left:
                raise _AllFound
        return i


def tracked(wanted: tuple[type, ...]) -> list[Any]:
    """Every object of ``wanted`` (or a subclass) the collector tracks in this process: what
    the walk looks for (see _Search), and a DDP wrapper that no variable holds is rebound too.
    Found by type, once per type (a torch process tracks some 300,000 objects: 0.35 s asking
    ``isinstance`` of each, which also asks a deprecated alias's ``__class__`` and warns)."""
    if not wanted:
        return []
    objects = gc.get_objects()
    hits = {t for t in set(map(type, objects)) if issubclass(t, wanted)}
    return [o for o in objects if type(o) in hits and _live(o)] if hits else []


def _live(obj: Any) -> bool:
    """Whether ``obj`` was made on a rank: a DDP wrapper or a ZeroRedundancyOptimizer that has
    no ``process_group`` is a copy (the notebook's, of the master's, without its group: a
    forked rank inherits the kernel's objects), which holds no group to move."""
    grouped = imported_classes(DDP, ZERO)
    return not isinstance(obj, grouped) or "process_group" in (object_dict(obj) or {})


def imported_classes(*found: tuple[str, str]) -> tuple[type, ...]:
    """The classes named (module, name) whose modules are imported; never imported here: a rank
    that has not imported one holds none of its objects."""
    return tuple(c for module, name in found if isinstance(c := getattr(sys.modules.get(module), name, None), type))


def reached_through(held: Registry, i: int, types: tuple[type, ...]) -> bool:
    """Whether object ``i`` was reached through an object of ``types`` (an FSDP module's own
    submodules and parameters are named with it, not each on its own)."""
    return bool(types) and any(isinstance(held.objects[a], types) for a in _ancestors(held, i))


def _ancestors(held: Registry, i: int) -> Iterator[int]:
    while i > 0:
        i = held.parents[i][0]
        if i > 0:
            yield i
