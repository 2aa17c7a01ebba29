"""The picklers between the notebook and its workers, one per direction, and dry runs.

``TensorPickler`` is cloudpickle that keeps tensor aliasing, NumPy and torch memory that is
shared, and the notebook's functions bound to the notebook's globals. What differs by direction
is in the subclasses' overrides:

    ShipPickler     notebook -> spawned workers: large storages through the launch's memfd
                    (see shm), devices kept, arrays that own their memory still own it
    ResultPickler   a worker -> the notebook: storage bytes out of band, CUDA copied to the CPU
    DryRun + either only whether it would pickle (and how many tensors are off the CPU); no
                    data is touched, nothing is made

Nothing from outside the worker set is ever unpickled: ``loads_shipped`` runs in workers on
what the kernel pickled, the kernel loads only what its own workers wrote.
"""

from __future__ import annotations

import functools
import io
import linecache
import os
import pickle
import sys
import types
import warnings
import weakref
from collections import ChainMap
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, cast

import cloudpickle

from enot_nb._serialize import tensors
from enot_nb._serialize.shm import SHM_MIN_BYTES, SharedFile
from enot_nb._serialize.tensors import Reduction, _rebuild_storage, _storage_from_shared, storage_array

if TYPE_CHECKING:
    import numpy

PROTOCOL = 5

Reducer = Callable[[Any], Reduction]


class TensorPickler(cloudpickle.Pickler):
    """cloudpickle that keeps tensor aliasing (a view and its base share one storage after the
    round trip), sends storage bytes out of band, and keeps the notebook's functions bound to the
    notebook's globals. Exact types go through ``dispatch_table`` (copyreg style: ours first,
    then cloudpickle's, then copyreg's); ``reducer_override`` keeps what the table cannot hold.

    Subclasses say where storages' bytes go (``_storage_by_value``) and may keep more of an
    array's memory (``_reduce_array_memory``).
    """

    def __init__(self, file: Any, buffer_callback: Any = None, namespace: dict | None = None) -> None:
        self.namespace = namespace
        """Functions whose globals are this dict are the notebook's: rebuilt on its globals."""
        self.off_cpu = 0
        """How many of the tensors met are off the CPU (a dry run reports it)."""
        self._function_cells: set[int] = set()
        self._lines: dict[str, Any] = {}  # a cell file's lines, by file (see _cell_lines)
        self._memory = tensors.MemoryOwners(self.known_arrays, self.known_storages)
        # pickle reads dispatch_table once, when the pickler is made: it must be set first.
        self.dispatch_table = ChainMap(self._reducers(), *cloudpickle.Pickler.dispatch_table.maps)
        super().__init__(file, protocol=PROTOCOL, buffer_callback=buffer_callback)

    def is_known(self, array: Any, root: Any) -> Any:
        """An array the receiver holds whose memory holds ``array`` (a view of ``root``), or
        None."""
        return None

    def known_arrays(self) -> list[Any]:
        """The NumPy arrays the receiver already holds (they travel as references)."""
        return []

    def view_of(self, owner: Any) -> Any:
        """An array the receiver holds that views ``owner``'s memory (``owner`` owns it), or
        None: the receiver holds all of ``owner``'s memory as that view's root."""
        return None

    def strided_known(self, root: Any) -> list[Any]:
        """The strided arrays the receiver holds over ``root``'s memory (see reduce_view_within)."""
        return []

    def known_storages(self) -> list[Any]:
        """The torch storages the receiver already holds (they travel as references)."""
        return []

    def _reducers(self) -> dict[type, Reducer]:
        """This pickler's entries of the dispatch table, by exact type. Only types that exist
        here can be met: torch's and NumPy's are looked up in sys.modules, never imported."""
        table: dict[type, Reducer] = {
            types.CellType: self._reduce_cell,
            weakref.ReferenceType: self._reduce_weakref,
            functools._lru_cache_wrapper: self._reduce_lru_cache,
            types.CodeType: self._reduce_code,
        }
        torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
        if torch is not None:
            table[torch.UntypedStorage] = self._reduce_storage
        if numpy is not None:
            table[numpy.ndarray] = self._reduce_array
        return table

    def reducer_override(self, obj: Any) -> Any:
        """Tensors, the notebook's functions, and a refusal; NotImplemented for the rest.

        pickle calls this for every object but the builtin atoms and containers, before it saves
        a function or a class by name and before it looks the dispatch table up; the table
        matches exact types only. So here is only what must win over the table and over pickle's
        own saving, or what matches a subclass: tensors (torch.Tensor, Parameter and the
        notebook's subclasses), the notebook's functions (pickle would save them by name,
        cloudpickle with a copy of their globals), DistributedDataParallel and its subclasses
        (refused), then cloudpickle's classes and functions by value.
        """
        if tensors.travels_by_view(obj):
            self.off_cpu += obj.device.type != "cpu"
            return tensors.reduce_tensor(obj)
        if type(obj) is types.FunctionType and self.namespace is not None and obj.__globals__ is self.namespace:
            return self._reduce_function(obj)
        _refuse_process_bound(obj)
        reduced = super().reducer_override(obj)
        if isinstance(obj, type) and "__slots__" in obj.__dict__ and type(reduced) is tuple:
            return _with_slots(obj, reduced)
        return reduced

    def _reduce_code(self, code: types.CodeType) -> Reduction:
        """cloudpickle's reduction of a code object, with the code's own file kept (cloudpickle
        writes ``<dynamic-code>``, which no traceback can name) and, for a file only linecache
        holds (a notebook cell), its lines, so that the receiver's tracebacks show the cell and
        its line as the notebook's do."""
        rebuild, args = cast(tuple, _CLOUDPICKLE_CODE(code))
        if len(args) <= _FILENAME_ARG or args[_FILENAME_ARG] != "<dynamic-code>":
            return rebuild, args  # a cloudpickle that lays the code out otherwise: as it does
        args = (*args[:_FILENAME_ARG], code.co_filename, *args[_FILENAME_ARG + 1 :])
        lines = self._cell_lines(code.co_filename)
        return (rebuild, args) if lines is None else (_code_with_lines, (rebuild, args, code.co_filename, lines))

    def _cell_lines(self, filename: str) -> list[str] | None:
        """The lines of a file that only this process's linecache holds (IPython puts each cell
        there), one list per file (pickled once); None for a file on disk, or unknown."""
        lines = self._lines.get(filename, _UNKNOWN)
        if lines is _UNKNOWN:
            entry = linecache.cache.get(filename)
            lines = entry[2] if entry is not None and len(entry) == 4 and not os.path.exists(filename) else None
            self._lines[filename] = lines
        return lines

    def _reduce_storage(self, storage: Any) -> Reduction:
        within = self._memory.storage_within(storage)
        if within is not None:
            return tensors._storage_over_storage, (*within, storage.nbytes())
        held = self._memory.array_holding(storage)
        if held is not None:
            return tensors._storage_of_array, (*held, storage.nbytes())
        memory = self._memory
        over_known = (
            memory.in_known_owner(storage) or memory.strided_holding(storage) or memory.under_known_array(storage)
        )
        return self._storage_by_value(storage) if over_known is None else over_known

    def _storage_by_value(self, storage: Any) -> Reduction:
        """A storage that is no array's memory, with its bytes."""
        raise NotImplementedError

    def _reduce_array(self, array: Any) -> Reduction:
        root = tensors.array_owner(array)
        if self.is_known(array, root) is None:
            for known in self.strided_known(root):
                within = tensors.reduce_view_within(array, known)
                if within is not None:
                    return within
        if root is not array and self.is_known(array, root) is None:
            held = self._memory.storage_holding_view(array, root)
            if held is not None:
                return tensors.array_over(held[0], array)
        tensor = tensors.tensor_owned(array)
        if tensor is not None and self.is_known(array, tensors.array_owner(array)) is None:
            # its memory is a storage: it travels over that storage (a view of an array the
            # receiver holds goes as that view below: the storage may be one it lacks)
            return tensors.array_over(tensor.untyped_storage(), array)
        view = tensors.reduce_numpy_view(array, self.is_known)
        if view is not None:
            return view
        known_view = self.view_of(array) if root is array else None
        if known_view is not None:  # ``row = a[1]`` went first, with all of ``a``'s memory
            return tensors.array_owning(array, known_view)
        strided = self.strided_known(array) if root is array and not array.dtype.hasobject else []
        if strided:  # ``row = a[::2]`` went first: ``a`` is the receiver's owner of it, if laid out so
            return tensors.owner_of_strided(array, strided[0])
        memory = tensors.contiguous_memory(array)
        reduced = None if memory is None else self._reduce_array_memory(array, memory)
        return array.__reduce_ex__(PROTOCOL) if reduced is None else reduced

    def _reduce_array_memory(self, array: Any, memory: tuple[int, int]) -> Reduction | None:
        """An array with one block of memory of its own: over the storage met before that is
        that memory (``torch.from_numpy(array)``), else noted (a storage met later is rebuilt
        over it) and None: NumPy's own pickling."""
        held = self._memory.storage_holding(memory)
        if held is not None:
            return tensors.array_over(held[0], array)
        under = self._memory.under_known_array_at(*memory)
        if under is not None:  # ``a = t.numpy()`` came back before; ``t`` was ``torch.from_numpy(b)``
            return tensors.array_under_array(*under, array)
        self._memory.add_array(memory, array)
        return None

    def _reduce_cell(self, cell: types.CellType) -> Reduction:
        if id(cell) in self._function_cells:
            return types.CellType, ()  # filled by its function's state (see _set_function_state)
        return _CLOUDPICKLE_CELL(cell)

    def _reduce_weakref(self, ref: weakref.ReferenceType) -> Reduction:
        referent = ref()
        if referent is None:  # raises, as pickle's own attempt would: a dead reference
            return ref.__reduce_ex__(PROTOCOL)
        return _make_weakref, (referent,)

    def _reduce_lru_cache(self, wrapper: Any) -> Reduction:
        """A notebook function wrapped by ``functools.lru_cache`` or ``functools.cache`` travels as
        the function it wraps (by value, see _reduce_function), wrapped again on arrival with the
        same parameters and attributes; its cache does not travel. Any other is pickled by name,
        as pickle would (its wrapper says it is ``module.qualname``)."""
        wrapped = getattr(wrapper, "__wrapped__", None)
        if not (isinstance(wrapped, types.FunctionType) and self.namespace is not None):
            return wrapper.__reduce_ex__(PROTOCOL)
        if wrapped.__globals__ is not self.namespace:
            return wrapper.__reduce_ex__(PROTOCOL)
        parameters = wrapper.cache_parameters()
        return _make_lru_cache, (wrapped, parameters["maxsize"], parameters["typed"]), dict(wrapper.__dict__)

    def _reduce_function(self, function: types.FunctionType) -> Reduction:
        # The cells themselves travel (empty, filled by the state): one cell shared by two
        # closures, or registered by the object graph, stays one cell.
        self._function_cells.update(map(id, function.__closure__ or ()))
        args = (function.__code__, function.__globals__, function.__name__, function.__closure__)
        return _make_function, args, _function_state(function), None, None, _set_function_state


class ResultPickler(TensorPickler):
    """A worker -> the notebook: storage bytes out of band (into the result memfd), storages
    off the CPU copied to it (the notebook may have no GPU)."""

    def _storage_by_value(self, storage: Any) -> Reduction:
        return _rebuild_storage, (_out_of_band(storage_array(storage)), "cpu")

    def _reduce_array_memory(self, array: Any, memory: tuple[int, int]) -> Reduction | None:
        reduced = super()._reduce_array_memory(array, memory)
        if reduced is None and not array.dtype.hasobject:
            # Rebuilt as a copy of its own: NumPy's pickling would leave it a view of the
            # result's mapping, pinning the whole result while it is kept (and not resizable).
            return _owned(array)
        return reduced


class ShipPickler(TensorPickler):
    """Notebook -> spawned workers: storages of ``SHM_MIN_BYTES`` or more through the launch's
    one memfd (made when the first is met; its descriptor is appended to ``owned_fds`` then),
    each storage on its own device, arrays that own their memory still own it in the worker.
    The notebook's namespace dict travels as a reference to the worker's own namespace (pickle
    never calls reducer_override for a dict, so a persistent id)."""

    def __init__(self, file: Any, buffer_callback: Any = None, namespace: dict | None = None) -> None:
        super().__init__(file, buffer_callback=buffer_callback, namespace=namespace)
        self.shared: SharedFile | None = None
        self.owned_fds: list[int] = []  # where the shared file's descriptor is recorded

    def persistent_id(self, obj: Any) -> Any:
        return "namespace" if obj is self.namespace and obj is not None else None

    def _storage_by_value(self, storage: Any) -> Reduction:
        device = str(storage.device)
        data = storage_array(storage)
        if data.nbytes >= SHM_MIN_BYTES and hasattr(os, "memfd_create"):
            if self.shared is None:
                self.shared = SharedFile(self.owned_fds)
            return _storage_from_shared, (self.shared.add(data), data.nbytes, device)
        return _rebuild_storage, (_out_of_band(data), device)

    def _reduce_array_memory(self, array: Any, memory: tuple[int, int]) -> Reduction | None:
        reduced = super()._reduce_array_memory(array, memory)
        if reduced is None and array.flags.owndata and not array.dtype.hasobject:
            return _owned(array)  # the worker's copy owns its memory too, as the notebook's (resize())
        return reduced


class DryRun(TensorPickler):
    """Mixed in before a pickler class (see dry_run): what would pickle, with no data touched
    and nothing made (no memfd, no bytes copied, no memory noted)."""

    def _reduce_storage(self, storage: Any) -> Reduction:
        return _rebuild_storage, (b"",)

    def _reduce_array_memory(self, array: Any, memory: tuple[int, int]) -> Reduction | None:
        return None


_DRY: dict[type[TensorPickler], type[TensorPickler]] = {}


def _dry(pickler_class: type[TensorPickler]) -> type[TensorPickler]:
    """``pickler_class`` with DryRun's overrides first (made once per class)."""
    if pickler_class not in _DRY:
        _DRY[pickler_class] = type(f"Dry{pickler_class.__name__}", (DryRun, pickler_class), {})
    return _DRY[pickler_class]


def _owned(array: Any) -> Reduction:
    """A contiguous array rebuilt as an array that owns a copy of its bytes (out of band)."""
    order: Literal["C", "F"] = "C" if array.flags.c_contiguous else "F"
    return tensors._owned_array, (pickle.PickleBuffer(array), array.dtype, array.shape, order)


def _out_of_band(data: numpy.ndarray) -> pickle.PickleBuffer:
    """A storage's bytes (see storage_array) as a buffer that can travel out of band."""
    # numpy declares the buffer protocol (__buffer__) to type checkers for Python 3.12+ only.
    return pickle.PickleBuffer(data if data.nbytes else b"")  # type: ignore[arg-type]


_CLOUDPICKLE_CELL: Reducer = cloudpickle.Pickler.dispatch_table[types.CellType]
_CLOUDPICKLE_CODE: Reducer = cloudpickle.Pickler.dispatch_table[types.CodeType]
_FILENAME_ARG = 10
"""co_filename's place among the code constructor's arguments (Python 3.10 to 3.13)."""
_UNKNOWN = object()


def _code_with_lines(rebuild: Any, args: tuple, filename: str, lines: list[str]) -> types.CodeType:
    """A code object whose file only the sender's linecache held: its lines go into this
    process's linecache (where it has none for that file), so that tracebacks show them."""
    linecache.cache.setdefault(filename, (sum(map(len, lines)), None, list(lines), filename))
    return rebuild(*args)


"""The entry ours chains to for the cells that are no function's of the notebook."""


def _with_slots(cls: type, reduced: tuple) -> tuple:
    """A class pickled by value keeps its ``__slots__``: cloudpickle (3.1) makes the class first
    without them and sets ``__slots__`` later as a plain attribute, so the copy has no slot
    descriptors (its instances hold the attributes in a ``__dict__``, ``del obj.a`` and
    ``getattr(cls, 'a')`` fail). Here they are among the arguments the class is made with."""
    make, args, *rest = reduced
    if make is not _MAKE_SKELETON_CLASS:
        return reduced
    type_constructor, name, bases, type_kwargs, *more = args
    return (
        make,
        (type_constructor, name, bases, {**type_kwargs, "__slots__": cls.__dict__["__slots__"]}, *more),
        *rest,
    )


_MAKE_SKELETON_CLASS = cloudpickle.cloudpickle._make_skeleton_class


def _refuse_process_bound(obj: Any) -> None:
    import torch

    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        # It pickles, but unpickling needs the process group of the run that made it.
        raise TypeError(
            "DistributedDataParallel is bound to the workers' process group; its "
            ".module (your model) comes back instead when the cell uses it"
        )
    # An older torch has a torch.distributed.tensor without DTensor (then in torch.distributed._tensor)
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if isinstance(dtensor, type) and isinstance(obj, dtensor):
        # It pickles as its local shard, which the notebook would hold as a tensor of the whole
        # shape with no memory (a module sharded by FSDP2 in a session: its ranks keep it sharded).
        raise TypeError(
            "a DTensor (a module sharded by FSDP2) is bound to the workers' device mesh: a one-off "
            "cell brings its module back whole; a session's ranks keep it sharded (pull it whole: "
            "%enot_pull NAME)"
        )


# ----------------------------------------------------------------------------- the notebook's functions


def _function_state(function: types.FunctionType) -> dict[str, Any]:
    contents = []
    for cell in function.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:
            contents.append(_EMPTY_CELL)
    return {
        "__defaults__": function.__defaults__,
        "__kwdefaults__": function.__kwdefaults__,
        "__qualname__": function.__qualname__,
        "__module__": function.__module__,
        "__doc__": function.__doc__,
        "__annotations__": function.__annotations__,
        "__dict__": dict(function.__dict__),
        "closure_contents": contents,
    }


def _make_function(
    code: types.CodeType, globals_: dict[str, Any], name: str, closure: tuple[types.CellType, ...] | None
) -> types.FunctionType:
    return types.FunctionType(code, globals_, name, None, closure)


def _set_function_state(function: types.FunctionType, state: dict[str, Any]) -> types.FunctionType:
    contents = state.pop("closure_contents")
    for cell, value in zip(function.__closure__ or (), contents):
        if value is not _EMPTY_CELL:
            cell.cell_contents = value
    attributes = state.pop("__dict__")
    for key, value in state.items():
        setattr(function, key, value)
    function.__dict__.update(attributes)
    return function


class _EmptyCell:
    def __reduce__(self) -> str:
        return "_EMPTY_CELL"


_EMPTY_CELL = _EmptyCell()


def _make_lru_cache(function: types.FunctionType, maxsize: int | None, typed: bool) -> Any:
    return functools.lru_cache(maxsize=maxsize, typed=typed)(function)


def _make_weakref(referent: Any) -> weakref.ReferenceType:
    return weakref.ref(referent)


# ----------------------------------------------------------------------------- to spawned workers


def dumps(obj: Any, owned: list[int], namespace: dict | None = None) -> bytes:
    """Pickle ``obj`` for spawned workers; returns the bytes. The shared-memory descriptor they
    refer to (if any) is appended to ``owned`` the moment it exists: the caller owns it, even if
    the pickling fails or is interrupted, and closes it once the workers have started.
    ``namespace``: the notebook's globals, which the workers' copies of its functions share
    (the worker's namespace dict stands in for it).
    """
    buffer = io.BytesIO()
    pickler = ShipPickler(buffer, namespace=namespace)
    pickler.owned_fds = owned
    pickler.dump(obj)
    return buffer.getvalue()


WORKER_NAMESPACE: dict[str, Any] = {}
"""In a spawned worker, the dict the shipped cell runs in: the notebook's namespace, re-created."""


class _ShippedUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        if pid != "namespace":
            raise pickle.UnpicklingError(f"unknown reference {pid!r}")
        return WORKER_NAMESPACE


def loads_shipped(data: bytes) -> Any:
    """Load what dumps() pickled, in a worker. Rebuilding the notebook's objects can warn (a
    library's deprecated constructor); a local cell would not: those warnings are not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _ShippedUnpickler(io.BytesIO(data)).load()


# ----------------------------------------------------------------------------- dry runs


def _ignore(_: Any) -> None:
    pass


class _Discard(io.RawIOBase):
    def write(self, data: Any) -> int:
        return len(memoryview(data))


def dry_run(obj: Any, pickler_class: type[TensorPickler] | None = None, **kwargs: Any) -> int:
    """Raise if ``obj`` cannot be pickled by ``pickler_class`` (ResultPickler if None, with
    ``kwargs``); return how many of its tensors are off the CPU. Nothing is touched or made."""
    pickler = _dry(pickler_class or ResultPickler)(_Discard(), buffer_callback=_ignore, **kwargs)
    pickler.dump(obj)
    return pickler.off_cpu


def unpicklable(values: dict[str, Any], **kwargs: Any) -> dict[str, str]:
    """The names whose values cannot be pickled, each with the reason (``kwargs``: dry_run's)."""
    problems = {}
    for name, value in values.items():
        try:
            dry_run(value, **kwargs)
        except Exception as err:  # noqa: BLE001 - any failure means it cannot be sent
            problems[name] = f"{type(value).__name__} cannot be pickled ({err})"
    return problems
