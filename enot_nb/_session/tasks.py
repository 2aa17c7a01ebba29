"""The records a session's kernel side and its ranks share: the tasks, and where each object
the notebook sends by index sits in its namespace (``ObjectSpec``), by which a rank finds its
own (see _session/mirror/paths).

A task is pickled against the mirror's registry (collect.StatePickler), so that an object the
ranks already hold travels as its index; each carries the push that comes first.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from enot_nb._state import collect
from enot_nb._worker.cell import CellOptions


class ObjectSpec(NamedTuple):
    """Where registry object ``at`` sits: the step from object ``parent`` (0: the namespace,
    whose steps are variable names), its type, and the storages it brings (a tensor's)."""

    at: int
    parent: int
    step: str
    type_name: str
    storages: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    """The bytes of each of its storages where the notebook's and the rank's should agree: a
    tensor of another shape on a rank must not take the notebook's bytes."""
    plain: bool = False
    """The sender walked it as plain data (one object, its items not registered): the receiver
    treats its own so too, whatever holds its items there (see kinds._held_from_outside)."""


@dataclass
class RegistrySpecs:
    """The notebook's registry for a task, as specs: the master finds its own objects at the
    same indices (see _session/mirror/paths.registry_at), snapshots them, and sends what changed against them."""

    specs: list[ObjectSpec]
    objects: int
    storages: int
    packed: tuple[bytes, ...] | None = field(default=None, compare=False, repr=False)
    """Its pickle, made once (the notebook sends the same specs again while a cell's reach is
    kept) and kept where it was loaded, in parts: a walk's specs, then those each later cell's
    new objects added (a list appended to, see ``grown``). The master knows the same specs by
    it, and finds only the objects of the parts it lacks (see KeptSnapshot.registry_for)."""

    def grown(self, added: list[ObjectSpec], objects: int, storages: int) -> RegistrySpecs:
        """These specs with ``added`` after them, for a registry that grew to ``objects`` and
        ``storages``; packed whole again once the parts are many."""
        packed = self._packed()
        parts = (*packed, _pack(added)) if len(packed) < _PARTS_MAX else None
        return RegistrySpecs(self.specs + added, objects, storages, parts)

    def _packed(self) -> tuple[bytes, ...]:
        if self.packed is None:
            self.packed = (_pack(self.specs),)
        return self.packed

    def __reduce__(self) -> tuple:
        return _registry_specs, (self._packed(), self.objects, self.storages)


_PARTS_MAX = 32


def _pack(specs: list[ObjectSpec]) -> bytes:
    # Plain data, pickled in one go by the C pickler: the task's pickler (a Python subclass
    # that looks every object up in the registry) would visit each of its thousands of parts.
    return pickle.dumps(specs, protocol=5)


_loaded: dict[bytes, list[ObjectSpec]] = {}
"""The parts of the specs last loaded here, loaded: the next task's are mostly the same."""


def _registry_specs(packed: tuple[bytes, ...], objects: int, storages: int) -> RegistrySpecs:
    global _loaded
    _loaded = {part: _loaded[part] if part in _loaded else pickle.loads(part) for part in packed}
    return RegistrySpecs([spec for part in packed for spec in _loaded[part]], objects, storages, packed)


@dataclass
class ShardedLoad:
    """A plain cell's change to a module the ranks hold sharded (FSDP), whose notebook copy is
    plain (a pull made it whole): each submodule's training flag, and, where its values changed,
    its full state dict, loaded into the ranks' sharded module by every rank together, once
    every rank confirmed the push."""

    name: str
    training: dict[str, bool]
    values: dict[str, Any] | None = None


@dataclass
class CellTask:
    """Run a cell (the magic's options as the worker needs them)."""

    push: collect.Changes | None
    code: str
    options: CellOptions
    mirror: RegistrySpecs | None
    """None: nothing comes back (--mirror none, --no-return)."""


@dataclass
class CallTask:
    """``Session.launch(fn, ...)``: fn with the rank's session namespace as its globals."""

    push: collect.Changes | None
    fn: Any
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    mirror: RegistrySpecs | None = None
    """The notebook's registry of what fn reaches: what fn changes comes back, as a cell's."""


@dataclass
class PullTask:
    """``pull(names)``: the master's values, as changes against the notebook's registry of them
    (in place where the notebook holds an object of the same type at the same path)."""

    push: collect.Changes | None
    names: list[str]
    mirror: RegistrySpecs
    whole: tuple[int, int] | None = None
    """How many of the registry's objects and storages are the pulled names' (their whole
    states come back); past them, what the ranks hold of the rest of the notebook, found by
    identity only (a pulled optimizer's params are the notebook's model's). None: all."""


class NotHeld(NamedTuple):
    """Rank 0's answer to a pull of names it does not hold: those, and the names it holds (its
    variables, not modules nor names starting with an underscore)."""

    missing: list[str]
    held: list[str]


@dataclass
class SyncTask:
    """Only the push (``Session.push``, a sync before a pull, a restart's restore)."""

    push: collect.Changes | None
    to_device: list[str] = field(default_factory=list)
    """Variables that lived on the ranks' GPUs: after the push (CPU copies) each rank moves them
    onto its own device (a restart's restore)."""


@dataclass
class CheckTask:
    """``Session.check()``: the replicas compared across the ranks (see _worker/replica_check);
    rank 0's report comes back. Nothing is pushed: what plain cells changed waits for the next task."""

    push: None = None


@dataclass
class DebugTask:
    """``%enot_debug``: the debugger on ``rank``'s traceback of task number ``task`` (None: its
    last failed one), in the notebook (see _worker/rank_input); the other ranks answer at once."""

    rank: int
    task: int | None = None
    push: None = None


Task = CellTask | CallTask | PullTask | SyncTask | CheckTask | DebugTask
