"""The registry: every object reachable from the notebook's namespace, by index.

A cell runs in a worker, but the notebook must end up as if the cell had run locally: every
object reachable from the namespace that the cell changed (directly, through a function, in
place or by rebinding) is changed the same way in the notebook, in place. So, before the cell::

    kernel: walk the namespace -> Registry (every object reachable, by index; tensors' storages)
    fork:   the master inherits the Registry: same objects, same ids
    spawn:  the Registry's objects travel with the shipped variables in one pickle, so index i
            names the worker's copy of the notebook's object i (see reach)
    master: Snapshot (see snapshot) -> the cell runs -> what changed, by index (see collect)

Pickled references to registered objects travel as their index, so unchanged objects never
travel and keep their identity.
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from typing import Any

from enot_nb._serialize.tensors import tensor_storages
from enot_nb._state.kinds import OPS, SET_ITEM, Kind, kind_of
from enot_nb._state.states import VALUE_TYPES, Replaced

# Names IPython binds in the namespace for itself: never shipped, compared or brought back.
_IPYTHON_NAME = re.compile(
    r"^(_|__|___|_i|_ii|_iii|_i\d+|_\d+|_dh|_oh|_ih|In|Out|exit|quit|"
    r"get_ipython|__\w+__)$"
)


def is_user_name(name: str, hidden: Any = ()) -> bool:
    """A namespace name that belongs to the user (not IPython's own). ``hidden``: names
    IPython hides (any container)."""
    return isinstance(name, str) and name not in hidden and not _IPYTHON_NAME.match(name)


STAYS_IN_THE_KERNEL = "_enot_nb_stays_in_the_kernel"
"""A class attribute, True on enot_nb's own live objects (a Session, its workers): they hold
processes and descriptors, and are never sent to a rank (see stays_in_the_kernel)."""


def stays_in_the_kernel(value: Any) -> bool:
    """Whether ``value`` is one of enot_nb's own live objects, which never leave this process."""
    return getattr(type(value), STAYS_IN_THE_KERNEL, False) is True


def user_variables(namespace: dict[str, Any], hidden: Any = ()) -> dict[str, Any]:
    """The namespace's user names and their values (IPython's own left out)."""
    return {n: v for n, v in namespace.items() if is_user_name(n, hidden)}


@dataclass
class Registry:
    """Every object reachable from the namespace, by index; index 0 is the namespace itself."""

    objects: list[Any] = field(default_factory=list)
    kinds: list[Kind] = field(default_factory=list)
    parents: list[tuple[int, str]] = field(default_factory=list)
    """How each object was first reached: (index of the parent, step); (-1, name) for roots."""
    index: dict[int, int] = field(default_factory=dict)
    storages: list[Any] = field(default_factory=list)
    """The untyped storages of the registered tensors, in order of first use."""
    storage_index: dict[int, int] = field(default_factory=dict)
    notebook_functions: list[Any] = field(default_factory=list)
    edges: dict[int, int] = field(default_factory=dict)
    """For each object the walk registered (by index), how many steps of walked objects reach
    it, its first included; an update may count one again, never less (see record.Record.update:
    a replaced object that nothing else held may leave the registry). None for others: unknown."""
    storage_users: dict[int, int] = field(default_factory=dict)
    """For each storage (by index), how many registered tensors use it."""

    def find(self, obj: Any) -> int | None:
        i = self.index.get(id(obj))
        return i if i is not None and self.objects[i] is obj else None

    def find_storage(self, storage: Any) -> int | None:
        j = self.storage_index.get(id(storage))
        return j if j is not None and self.storages[j] is storage else None

    def path(self, i: int) -> str:
        """A readable way to reach object ``i`` from the namespace, e.g. ``model._modules['0']``."""
        steps = []
        while i > 0:
            i, step = self.parents[i]
            steps.append(step)
        return "".join(reversed(steps))

    def root_name(self, i: int) -> str | None:
        while i > 0:
            parent, step = self.parents[i]
            if parent <= 0:
                return step
            i = parent
        return None

    def names_holding(self, storages: set[int]) -> set[str]:
        """The variables (root names) of every registered tensor that holds one of ``storages``
        (by index): where an in-place write to a storage is seen, whatever alias made it."""
        names: set[str | None] = set()
        for i, kind in enumerate(self.kinds if storages else []):
            if OPS[kind].has_storage and {self.find_storage(s) for s in tensor_storages(self.objects[i])} & storages:
                names.add(self.root_name(i))
        return {n for n in names if n}  # (a rank's placeholder has no path: "")

    def _add(self, obj: Any, kind: Kind, parent: int, step: str) -> int:
        i = len(self.objects)
        self.objects.append(obj)
        self.kinds.append(kind)
        self.parents.append((parent, step))
        self.index[id(obj)] = i
        ops = OPS[kind]
        if ops.has_storage:
            self._add_storage(obj)
        elif ops.reads_globals:
            self.notebook_functions.append(obj)
        return i

    def _add_storage(self, tensor: Any) -> None:
        for storage in tensor_storages(tensor):
            j = self.find_storage(storage)
            if j is None:
                j = self.storage_index[id(storage)] = len(self.storages)
                self.storages.append(storage)
            self.storage_users[j] = self.storage_users.get(j, 0) + 1

    def replace(self, i: int, obj: Any, storages: list[tuple[int, Any]]) -> None:
        """Object ``i`` is now ``obj``, which its path holds instead (a training step's new
        ``.grad``), of the same kind; its storages take the places (indices) of the old one's,
        which only it used. What ``obj`` holds is not walked here."""
        del self.index[id(self.objects[i])]
        self.objects[i], self.index[id(obj)], self.edges[i] = obj, i, 1
        for j, storage in storages:
            del self.storage_index[id(self.storages[j])]
            self.storages[j], self.storage_index[id(storage)] = storage, j

    @classmethod
    def of_user_variables(cls, namespace: dict[str, Any], hidden: Any = ()) -> Registry:
        """Walk everything the namespace's user variables reach."""
        return cls.of_namespace(namespace, list(user_variables(namespace, hidden)))

    @classmethod
    def of_namespace(cls, namespace: dict[str, Any], names: list[str]) -> Registry:
        """Walk the objects reachable from ``namespace[name]`` for each of ``names``."""
        registry = cls()
        registry._add(namespace, Kind.NAMESPACE, -1, "")
        registry.extend(names, namespace)
        return registry

    def extend(self, names: list[str], namespace: dict[str, Any]) -> None:
        """Walk more roots (breadth first, so paths are short)."""
        self.grow([(namespace[name], 0, name) for name in names])

    def grow(self, starts: list[tuple[Any, int, str]]) -> None:
        """Walk from more objects, each (object, index of its parent, step), breadth first; the
        objects already registered keep their index and path."""
        queue: collections.deque[int] = collections.deque()
        for obj, parent, step in starts:
            self._visit(obj, parent, step, queue)
        set_items: list[tuple[Any, int, str]] = []  # reached last: by their path elsewhere if any
        while queue or set_items:
            if not queue:
                for child, i, step in set_items:
                    self._visit(child, i, step, queue)
                set_items = []
                continue
            i = queue.popleft()
            children = OPS[self.kinds[i]].children
            if children is None:  # never queued (see _visit)
                continue
            try:
                steps = children(self.objects[i])
            except Exception:  # noqa: BLE001 - an object that resists inspection is left opaque
                continue
            for step, child in steps:
                if step.startswith(SET_ITEM):
                    set_items.append((child, i, step))
                else:
                    self._visit(child, i, step, queue)

    def _visit(self, obj: Any, parent: int, step: str, queue: collections.deque[int]) -> None:
        if type(obj) in VALUE_TYPES:
            return
        found = self.find(obj)
        if found is not None:
            if found in self.edges:
                self.edges[found] += 1
            return
        try:
            kind = kind_of(obj)
        except Exception:  # noqa: BLE001 - an object that resists inspection is left untracked
            kind = Kind.OPAQUE
        if kind is None:
            return
        i = self._add(obj, kind, parent, step)
        self.edges[i] = 1
        if OPS[kind].children is not None:
            queue.append(i)

    @classmethod
    def of_objects(cls, objects: list[Any], parents: list[tuple[int, str]] | None = None) -> Registry:
        """The registry of a spawned worker: the shipped copies, at the notebook's indices.
        ``parents``: the notebook's paths; where a copy's holder rebuilt what it holds on the
        way in (its ``__setstate__`` made a new sub-object), the object it holds takes the
        index, given the copy's state (as the notebook's object has it): the cell changes that
        one, and its changes come back."""
        registry = cls()
        children: dict[int, dict[str, list[Any]]] = {}
        for i, obj in enumerate(objects):
            if i and parents is not None:
                obj = registry._held_instead(obj, parents[i], children)
            kind = Kind.NAMESPACE if not registry.objects else (kind_of(obj) or Kind.OPAQUE)
            registry._add(obj, kind, -1, "")
        return registry

    def held_by_step(self, i: int, seen: dict[int, dict[str, list[Any]]]) -> dict[str, list[Any]]:
        """What object ``i`` holds, by step (a set's items may share one): its kind's
        ``children``, listed once per ``seen``; what they raise is raised (an object that
        resists inspection), and ``seen`` then holds what was listed before."""
        steps = seen.get(i)
        if steps is None:
            steps = seen[i] = {}
            walk = OPS[self.kinds[i]].children
            for step, child in walk(self.objects[i]) if walk is not None else ():
                steps.setdefault(step, []).append(child)
        return steps

    def _held_instead(self, copy: Any, path: tuple[int, str], children: dict[int, dict[str, list[Any]]]) -> Any:
        parent, step = path
        if parent <= 0 or type(copy) in VALUE_TYPES:
            return copy
        try:
            steps = self.held_by_step(parent, children)
        except Exception:  # noqa: BLE001 - an object that resists inspection: keep the copy
            return copy
        held = steps.get(step, [])
        if len(held) != 1 or held[0] is copy or self.find(held[0]) is not None:
            return copy
        new = held[0]
        try:
            kind = kind_of(new)
        except Exception:  # noqa: BLE001 - as the walk: left alone
            return copy
        if copy is not None:
            apply = OPS[kind].apply if kind is not None else None
            if type(new) is not type(copy) or kind is None or apply is None:
                return copy
            state = OPS[kind].new_state(copy)
            if isinstance(state, Replaced):
                return copy
            apply(new, state, lambda _: None)
        return new
