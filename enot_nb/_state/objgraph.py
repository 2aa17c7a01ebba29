"""The notebook's objects as a graph: what a distributed cell may change, and what it changed.

A cell runs in a worker, but the notebook must end up as if the cell had run locally: every
object reachable from the namespace that the cell changed (directly, through a function, in
place or by rebinding) is changed the same way in the notebook, in place. So, before the cell::

    kernel: walk the namespace -> Registry (every object reachable, by index; tensors' storages)
    fork:   the master inherits the Registry: same objects, same ids
    spawn:  the Registry's objects travel with the shipped variables in one pickle, so index i
            names the worker's copy of the notebook's object i
    master: Snapshot (a shallow copy of every container and __dict__, tensor metadata, a
            digest of every storage and array) -> the cell runs -> diff against the snapshot

The diff is a list of (index, new shallow state) plus the storages whose bytes changed; the
notebook applies it to its own objects (see apply). Pickled references to registered objects
travel as their index (see collect), so unchanged objects never travel and keep their identity.

The boundary (README, "What comes back"): user objects are the namespace's values and
everything reachable from them, except Python modules, functions and classes defined outside
the notebook, and process plumbing (files, locks, sockets, threads, loggers, IPython and
matplotlib objects), which are referenced, never walked.
"""

from __future__ import annotations

import array
import collections
import functools
import pickle
import re
import sys
import types
import zlib
from dataclasses import dataclass, field
from typing import Any

from enot_nb._serialize import pickling
from enot_nb._serialize.pickling import storage_array
from enot_nb._state import pagemap as _pagemap

# Names IPython binds in the namespace for itself: never shipped, compared or brought back.
_IPYTHON_NAME = re.compile(
    r"^(_|__|___|_i|_ii|_iii|_i\d+|_\d+|_dh|_oh|_ih|In|Out|exit|quit|"
    r"get_ipython|__\w+__)$"
)

_ATOMS = (type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis), type(NotImplemented), slice)
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
    types.GeneratorType,
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


def is_user_name(name: str, hidden: Any = ()) -> bool:
    """A namespace name that belongs to the user (not IPython's own)."""
    return isinstance(name, str) and name not in hidden and not _IPYTHON_NAME.match(name)


def user_variables(namespace: dict[str, Any], hidden: Any = ()) -> dict[str, Any]:
    """The namespace's user names and their values (IPython's own left out)."""
    return {n: v for n, v in namespace.items() if is_user_name(n, hidden)}


def defined_in_notebook(obj: Any) -> bool:
    """A function or class the user defined in a cell (its module is the notebook's)."""
    return getattr(obj, "__module__", None) == "__main__"


def kind_of(obj: Any) -> str | None:
    """How the graph treats ``obj``: None for atoms (immutable, never registered)."""
    t = type(obj)
    if t in _ATOMS:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return "tensor"
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):
        return "ndarray"
    if isinstance(obj, _OPAQUE_TYPES):
        return "opaque"
    if _is_rng(obj):
        return "rng"
    if isinstance(obj, types.FunctionType):
        return "function" if defined_in_notebook(obj) else "opaque"
    if isinstance(obj, type):
        return "class" if defined_in_notebook(obj) else "opaque"
    if isinstance(obj, types.MethodType):
        return "method"
    if isinstance(obj, types.CellType):
        return "cell"
    if isinstance(obj, dict):
        return "dict"
    if isinstance(obj, list):
        return "list"
    if isinstance(obj, collections.deque):
        return "deque"
    if isinstance(obj, set):
        return "set"
    if isinstance(obj, (tuple, frozenset)):
        return "tuple"
    if isinstance(obj, bytearray):
        return "bytearray"
    if isinstance(obj, array.array):
        return "array"
    if isinstance(obj, functools.partial):
        return "partial"
    module = getattr(t, "__module__", "") or ""
    if module.split(".", 1)[0] in _PLUMBING_MODULES:
        return "opaque"
    if hasattr(obj, "__dict__") or _slot_names(t):
        return "object"
    return "opaque"


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


def rng_state(obj: Any) -> Any:
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        return obj.bit_generator.state
    if numpy is not None and isinstance(obj, numpy.random.RandomState):
        return obj.get_state()
    if hasattr(obj, "get_state"):  # torch.Generator
        return obj.get_state()
    return obj.getstate()


def set_rng_state(obj: Any, state: Any) -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        obj.bit_generator.state = state
    elif numpy is not None and isinstance(obj, numpy.random.RandomState):
        obj.set_state(state)
    elif hasattr(obj, "set_state"):
        obj.set_state(state)
    else:
        obj.setstate(state)


def _slot_names(t: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in getattr(t, "__mro__", ()):
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [s for s in slots if s not in ("__dict__", "__weakref__")]
    return tuple(names)


def _object_dict(obj: Any) -> dict | None:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None
    return d if type(d) is dict else None


def _slots(obj: Any) -> dict[str, Any]:
    values = {}
    for name in _slot_names(type(obj)):
        try:
            values[name] = object.__getattribute__(obj, name)
        except AttributeError:
            pass
    return values


def class_attributes(cls: type) -> dict[str, Any]:
    return {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}


def children(obj: Any, kind: str) -> list[tuple[str, Any]]:
    """The objects ``obj`` refers to, each with the step of a path to it (for messages)."""
    if kind == "dict":
        steps = [(f"[{k!r}]", v) for k, v in list(obj.items())] + [("<key>", k) for k in list(obj)]
        factory = getattr(obj, "default_factory", None)
        if factory is not None:
            steps.append((".default_factory", factory))
    elif kind in ("list", "deque", "tuple"):
        steps = [(f"[{i}]", v) for i, v in enumerate(list(obj))]
    elif kind == "set":
        steps = [("<item>", v) for v in list(obj)]
    elif kind == "object":
        steps = _attribute_steps(obj)
    elif kind == "tensor":
        grad = obj.grad if obj.is_leaf else None
        steps = [(".grad", grad)] if grad is not None else []
        steps += [(f".{k}", v) for k, v in (_object_dict(obj) or {}).items()]
    elif kind == "function":
        steps = [(".__defaults__", obj.__defaults__), (".__kwdefaults__", obj.__kwdefaults__)]
        steps += [(f".<closure {i}>", c) for i, c in enumerate(obj.__closure__ or ())]
        steps += [(f".{k}", v) for k, v in obj.__dict__.items()]
    elif kind == "class":
        steps = [(f".{k}", v) for k, v in class_attributes(obj).items()]
    elif kind == "method":
        steps = [(".__self__", obj.__self__), (".__func__", obj.__func__)]
    elif kind == "ndarray" and obj.dtype.hasobject:  # an object array holds Python objects
        steps = [(f"[{i}]", v) for i, v in enumerate(obj.ravel(order="K").tolist())]
    elif kind == "partial":  # never changes itself; what it holds may
        steps = [(".func", obj.func), (".args", obj.args), (".keywords", obj.keywords)]
        steps += _attribute_steps(obj)
    elif kind == "cell":
        try:
            steps = [(".cell_contents", obj.cell_contents)]
        except ValueError:
            steps = []
    else:
        steps = []
    if kind in ("dict", "list", "deque", "set"):
        steps += _attribute_steps(obj)
    return steps


def _attribute_steps(obj: Any) -> list[tuple[str, Any]]:
    steps = [(f".{k}", v) for k, v in (_object_dict(obj) or {}).items()]
    return steps + [(f".{k}", v) for k, v in _slots(obj).items()]


@dataclass
class Registry:
    """Every object reachable from the namespace, by index; index 0 is the namespace itself."""

    objects: list[Any] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    parents: list[tuple[int, str]] = field(default_factory=list)
    """How each object was first reached: (index of the parent, step); (-1, name) for roots."""
    index: dict[int, int] = field(default_factory=dict)
    storages: list[Any] = field(default_factory=list)
    """The untyped storages of the registered tensors, in order of first use."""
    storage_index: dict[int, int] = field(default_factory=dict)
    notebook_functions: list[Any] = field(default_factory=list)

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

    def _add(self, obj: Any, kind: str, parent: int, step: str) -> int:
        i = len(self.objects)
        self.objects.append(obj)
        self.kinds.append(kind)
        self.parents.append((parent, step))
        self.index[id(obj)] = i
        if kind == "tensor":
            self._add_storage(obj)
        elif kind == "function":
            self.notebook_functions.append(obj)
        return i

    def _add_storage(self, tensor: Any) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, meta-less or exotic tensors
            return
        if self.find_storage(storage) is None:
            self.storage_index[id(storage)] = len(self.storages)
            self.storages.append(storage)

    @classmethod
    def of_user_variables(cls, namespace: dict[str, Any], hidden: Any = ()) -> Registry:
        """Walk everything the namespace's user variables reach."""
        return cls.of_namespace(namespace, list(user_variables(namespace, hidden)))

    @classmethod
    def of_namespace(cls, namespace: dict[str, Any], names: list[str]) -> Registry:
        """Walk the objects reachable from ``namespace[name]`` for each of ``names``."""
        registry = cls()
        registry._add(namespace, "namespace", -1, "")
        registry.extend(names, namespace)
        return registry

    def extend(self, names: list[str], namespace: dict[str, Any]) -> None:
        """Walk more roots (breadth first, so paths are short)."""
        queue: collections.deque[int] = collections.deque()
        for name in names:
            self._visit(namespace[name], 0, name, queue)
        while queue:
            i = queue.popleft()
            try:
                steps = children(self.objects[i], self.kinds[i])
            except Exception:  # noqa: BLE001 - an object that resists inspection is left opaque
                continue
            for step, child in steps:
                self._visit(child, i, step, queue)

    def _visit(self, obj: Any, parent: int, step: str, queue: collections.deque[int]) -> None:
        if type(obj) in _ATOMS or self.find(obj) is not None:
            return
        try:
            kind = kind_of(obj)
        except Exception:  # noqa: BLE001 - an object that resists inspection is left untracked
            kind = "opaque"
        if kind is None:
            return
        i = self._add(obj, kind, parent, step)
        if kind != "opaque":
            queue.append(i)

    @classmethod
    def of_objects(cls, objects: list[Any]) -> Registry:
        """The registry of a spawned worker: the shipped copies, at the notebook's indices."""
        registry = cls()
        for obj in objects:
            kind = "namespace" if not registry.objects else (kind_of(obj) or "opaque")
            registry._add(obj, kind, -1, "")
        return registry


# ----------------------------------------------------------------------------- snapshot, diff


def digest(buffer: Any) -> tuple[int, int]:
    """A content digest of a memory area (crc32 runs at ~4 GB/s here)."""
    view = memoryview(buffer).cast("B")
    return view.nbytes, zlib.crc32(view)


def _storage_area(storage: Any) -> tuple[int, int]:
    return (storage.data_ptr(), storage.nbytes()) if storage.device.type == "cpu" else (0, 0)


def _storage_digests(storages: list[Any]) -> list[tuple]:
    cpu = [j for j, s in enumerate(storages) if s.device.type == "cpu"]
    found = dict(zip(cpu, _area_digests([_storage_area(storages[j]) for j in cpu], [storages[j] for j in cpu])))
    return [found[j] if j in found else ("device", _device_digest(s)) for j, s in enumerate(storages)]


def _device_digest(storage: Any) -> tuple:
    return (storage.data_ptr(), storage.nbytes(), digest(storage_array(storage)))


def _changed_storages(storages: list[Any], before: list[tuple]) -> list[int]:
    cpu = [j for j, b in enumerate(before) if b[0] != "device" and storages[j].device.type == "cpu"]
    flags = dict(
        zip(
            cpu,
            _areas_changed(
                [_storage_area(storages[j]) for j in cpu], [storages[j] for j in cpu], [before[j] for j in cpu]
            ),
        )
    )
    changed = []
    for j, storage in enumerate(storages):
        if before[j][0] == "device":
            if ("device", _device_digest(storage)) != before[j]:
                changed.append(j)
        elif flags.get(j, True):
            changed.append(j)
    return changed


def _array_digest(array: Any) -> tuple:
    import numpy

    if array.dtype.hasobject:
        return (array.shape, array.strides, array.dtype, tuple(map(id, array.ravel().tolist())))
    if array.flags.c_contiguous:
        area = (array.__array_interface__["data"][0], array.nbytes)
        return (array.shape, array.strides, array.dtype, *_area_digests([area], [array])[0])
    return (array.shape, array.strides, array.dtype, digest(numpy.ascontiguousarray(array).view(numpy.uint8).ravel()))


def _array_changed(array: Any, before: tuple) -> bool:
    if array.dtype.hasobject or not array.flags.c_contiguous:
        return before != _array_digest(array)
    area = (array.__array_interface__["data"][0], array.nbytes)
    return (array.shape, array.strides, array.dtype) != before[:3] or _areas_changed([area], [array], [before[3:]])[0]


def _bytes_of(obj: Any) -> Any:
    """A flat uint8 view of a CPU storage or contiguous array."""
    import numpy

    if isinstance(obj, numpy.ndarray):  # subclasses too (masked arrays, memmaps): their data
        return numpy.asarray(obj).reshape(-1).view(numpy.uint8)
    return storage_array(obj)


# Areas this large are not scanned before the cell: in a forked or spawned worker nothing has
# written their interior pages yet (they are the kernel's, or a memfd's), and assuming so can
# only make an area look changed, never hide a change. Saves reading 4 MB of pagemap per 2 GiB.
SCAN_MAX = 1 << 20


def _area_digests(areas: list[tuple[int, int]], owners: list[Any]) -> list[tuple]:
    """What tells later whether an area's bytes changed: where pagemap works, the pages this
    process already owns (with a digest of just their bytes); elsewhere a digest of it all."""
    # Only torch storages: a spawned worker's NumPy arrays arrive inside the pickle, already its own.
    skip = [area[1] >= SCAN_MAX and not _is_array(owner) for area, owner in zip(areas, owners)]
    scanned = [(0, 0) if skipped else area for area, skipped in zip(areas, skip)]
    masks = _pagemap.own_pages(scanned) if _pagemap.supported() else None
    digests = []
    for j, (area, owner) in enumerate(zip(areas, owners)):
        if masks is not None and skip[j]:
            masks[j] = _no_pages(area)
        if masks is None or not area[1]:
            digests.append(("digest", *area, digest(_bytes_of(owner)) if area[1] else (0, 0)))
        else:
            # The first and last pages may be shared with neighbours, which the cell may write:
            # their bytes are compared, like the pages already this process's own.
            mask = masks[j].copy()
            mask[0] = mask[-1] = True
            digests.append(("pages", *area, mask, _digest_pages(area, owner, mask)))
    return digests


def _is_array(obj: Any) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(obj, numpy.ndarray)


def _no_pages(area: tuple[int, int]) -> Any:
    import numpy

    first, last = area[0] // _pagemap.PAGE, (area[0] + area[1] - 1) // _pagemap.PAGE
    return numpy.zeros(last - first + 1, dtype=bool)


def _digest_pages(area: tuple[int, int], owner: Any, mask: Any) -> tuple:
    if not mask.any():
        return (0, 0)
    data = _bytes_of(owner)
    page, start = _pagemap.PAGE, area[0] // _pagemap.PAGE * _pagemap.PAGE
    crc, total = 0, 0
    for index in mask.nonzero()[0]:
        low = max(0, start + int(index) * page - area[0])
        chunk = data[low : start + (int(index) + 1) * page - area[0]]
        crc, total = zlib.crc32(chunk, crc), total + chunk.nbytes
    return (total, crc)


def _areas_changed(areas: list[tuple[int, int]], owners: list[Any], before: list[tuple]) -> list[bool]:
    paged = [j for j, b in enumerate(before) if b[0] == "pages" and tuple(b[1:3]) == areas[j]]
    if paged and _pagemap.shares_pages_with_children():
        paged = []  # pages cannot tell now: every such area counts as changed (and is sent)
    masks = _pagemap.own_pages([areas[j] for j in paged]) if paged else []
    changed = [True] * len(areas)
    for j, mask in zip(paged, masks or [None] * len(paged)):
        was = before[j][3]
        changed[j] = (
            mask is None or bool((mask & ~was).any()) or _digest_pages(areas[j], owners[j], was) != before[j][4]
        )
    for j, b in enumerate(before):
        if b[0] == "digest":
            changed[j] = tuple(b[1:3]) != areas[j] or b[3] != (digest(_bytes_of(owners[j])) if areas[j][1] else (0, 0))
    return changed


def shallow_state(obj: Any, kind: str) -> Any:
    """What a change to ``obj`` itself (not to the objects it refers to) would change."""
    if kind == "dict":
        return (list(obj.items()), getattr(obj, "default_factory", None), _attrs(obj))
    if kind in ("list", "deque", "set"):
        return (list(obj), _attrs(obj))
    if kind in ("object", "partial"):  # a partial's own state cannot change, its attributes can
        return (type(obj), _attrs(obj))
    if kind == "tensor":
        return tensor_meta(obj)
    if kind == "ndarray":
        return _array_digest(obj)
    if kind in ("bytearray", "array"):
        return digest(obj)
    if kind == "function":
        return (obj.__code__, obj.__defaults__, obj.__kwdefaults__, dict(obj.__dict__))
    if kind == "class":
        return class_attributes(obj)
    if kind == "cell":
        try:
            return (obj.cell_contents,)
        except ValueError:
            return ()
    if kind == "rng":
        return pickle.dumps(rng_state(obj))  # compared as bytes; the state itself is sent fresh
    return None


def _attrs(obj: Any) -> tuple[dict | None, dict]:
    d = _object_dict(obj)
    return (dict(d) if d is not None else None, _slots(obj))


def tensor_meta(t: Any) -> tuple:
    try:
        storage = t.untyped_storage()
        layout = (storage, t.storage_offset(), tuple(t.shape), t.stride())
    except (RuntimeError, NotImplementedError):
        storage, layout = None, (None, 0, tuple(t.shape), None)
    return (
        type(t),
        *layout,
        t.dtype,
        t.device,
        t.requires_grad,
        t.grad if t.is_leaf else None,
        dict(_object_dict(t) or {}),
    )


def same_value(a: Any, b: Any) -> bool:
    """Whether a slot still holds the same value: the same object, or an equal atom (two equal
    floats or strings, dtypes or devices, are the same value). A new list equal to the old one is
    not the same value: other references still see the old one."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) in _ATOMS:
        return a == b
    return type(a).__name__ in ("dtype", "device") and type(a).__module__.split(".")[0] in ("torch", "numpy") and a == b


def _same_pairs(a: Any, b: Any) -> bool:
    """Two sequences of (key, value) pairs, in order."""
    a, b = list(a), list(b)
    return len(a) == len(b) and all(same_value(ka, kb) and same_value(va, vb) for (ka, va), (kb, vb) in zip(a, b))


def _same_dict(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None:
        return a is b
    return _same_pairs(a.items(), b.items())


def _same_attrs(a: tuple, b: tuple) -> bool:
    return _same_dict(a[0], b[0]) and _same_dict(a[1], b[1])


def _same_items(a: list, b: list) -> bool:
    return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))


def same_state(kind: str, a: Any, b: Any) -> bool:
    """Whether an object's shallow state (see shallow_state) is unchanged: its slots hold the
    same values; what those values hold is their own state."""
    if kind == "dict":
        return _same_pairs(a[0], b[0]) and same_value(a[1], b[1]) and _same_attrs(a[2], b[2])
    if kind in ("list", "deque"):
        return _same_items(a[0], b[0]) and _same_attrs(a[1], b[1])
    if kind == "set":
        return {id(x) for x in a[0]} == {id(x) for x in b[0]} and _same_attrs(a[1], b[1])
    if kind in ("object", "partial"):
        return a[0] is b[0] and _same_attrs(a[1], b[1])
    if kind == "tensor":
        return (
            a[0] is b[0]
            and a[1] is b[1]
            and a[2:5] == b[2:5]
            and a[5] == b[5]
            and a[6] == b[6]
            and a[7] == b[7]
            and a[8] is b[8]
            and _same_dict(a[9], b[9])
        )
    if kind == "function":
        return a[0] is b[0] and a[1] is b[1] and a[2] is b[2] and _same_dict(a[3], b[3])
    if kind == "class":
        return _same_dict(a, b)
    if kind == "cell":
        return _same_items(list(a), list(b))
    return a == b


@dataclass
class Snapshot:
    """The master's record of the registry before the cell."""

    states: list[Any]
    storages: list[tuple]

    @classmethod
    def take(cls, registry: Registry) -> Snapshot:
        states = []
        for obj, kind in zip(registry.objects, registry.kinds):
            try:
                states.append(shallow_state(obj, kind))
            except Exception:  # noqa: BLE001 - left untracked, as an opaque object
                states.append(None)
        return cls(states, _storage_digests(registry.storages))

    def changed_objects(self, registry: Registry) -> list[int]:
        changed = []
        for i, (obj, kind) in enumerate(zip(registry.objects, registry.kinds)):
            before = self.states[i]
            if before is None or kind in ("namespace", "opaque", "method", "tuple"):
                continue
            try:
                if kind == "ndarray":
                    if _array_changed(obj, before):
                        changed.append(i)
                    continue
                now = shallow_state(obj, kind)
            except Exception:  # noqa: BLE001 - an object that resists inspection is left untracked
                continue
            if not same_state(kind, before, now):
                changed.append(i)
        return changed

    def changed_storages(self, registry: Registry) -> list[int]:
        return _changed_storages(registry.storages, self.storages)


# ----------------------------------------------------------------------------- spawn: what to ship


def names_used(code: str) -> set[str]:
    """Every name the cell reads or writes (a cheap, safe over-approximation)."""
    import ast

    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def hidden_names(namespace: dict[str, Any]) -> Any:
    shell = namespace.get("get_ipython")
    try:
        return shell().user_ns_hidden if callable(shell) else ()
    except Exception:  # noqa: BLE001 - not IPython's
        return ()


def global_names(function: Any) -> set[str]:
    """The global names a function's code (and the code nested in it) may read."""
    names, todo = set(), [function.__code__]
    while todo:
        code = todo.pop()
        names.update(code.co_names)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def shippable_namespace(namespace: dict[str, Any], code: str) -> tuple[dict[str, Any], dict[str, str], Registry]:
    """What spawned workers need: the variables the cell uses, and those the notebook's functions
    it uses read (to any depth), that can be pickled; those that cannot (with why); and the
    registry of every object they reach."""
    hidden = hidden_names(namespace)
    registry = Registry.of_namespace(namespace, [])
    values: dict[str, Any] = {}
    left_out: dict[str, str] = {}
    todo, seen_functions = set(names_used(code)), 0
    while todo:
        names = sorted(
            n for n in todo if n in namespace and is_user_name(n, hidden) and n not in values and n not in left_out
        )
        todo = set()
        problems = pickling.unpicklable({n: namespace[n] for n in names})
        left_out.update(problems)
        fresh = [n for n in names if n not in problems]
        values.update({n: namespace[n] for n in fresh})
        registry.extend(fresh, namespace)
        for function in registry.notebook_functions[seen_functions:]:
            todo |= global_names(function)
        seen_functions = len(registry.notebook_functions)
    return values, left_out, registry


def shippable_objects(registry: Registry, namespace: dict[str, Any]) -> list[Any]:
    """The registry's objects as they travel with the shipped variables: index for index, None
    where one cannot be pickled on its own."""
    ship = {"namespace": namespace, "pickler_class": pickling.ShipPickler}
    objects = list(registry.objects)
    try:
        pickling.dry_run(objects, **ship)
    except Exception:  # noqa: BLE001 - e.g. a lock that its owner's __getstate__ leaves out
        for i in range(1, len(objects)):
            if pickling.unpicklable({"": objects[i]}, **ship):
                objects[i] = None
    return objects
