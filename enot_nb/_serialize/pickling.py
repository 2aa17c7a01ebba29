"""Pickling between the notebook and its workers: tensor aliasing kept, tensor bytes out of band.

To spawned workers: a CPU storage of ``SHM_MIN_BYTES`` or more is copied once into one
anonymous shared-memory file (memfd) per launch, at a page-aligned offset, instead of into the
pickle; the one descriptor travels beside the pickle (to the fork server, then inherited by the
workers) and each worker maps its part copy-on-write: one memory copy in all, however many
workers read it and however many tensors there are, and nothing large goes through a pipe.

Back from a worker: tensor bytes go out of band into a result memfd that the notebook maps
privately. Mappings are made with libc's mmap, which (unlike Python's mmap module) keeps no
descriptor open: a kept result pins memory, never a file descriptor.
"""

from __future__ import annotations

import bisect
import ctypes
import io
import mmap
import os
import pickle
import struct
import sys
import threading
import types
import warnings
import weakref
from typing import Any

import cloudpickle

from enot_nb._processes.interrupts import interrupts_deferred

SHM_MIN_BYTES = int(float(os.environ.get("ENOT_NB_SHM_MIN_MB", "1")) * 2**20)

SHARED_FD: list[int] = []
"""In a spawned worker: the memfd of the shipped tensors, if any came."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def map_private(fd: int, length: int, offset: int = 0) -> Any:
    """A private, writable (copy-on-write) mapping of ``fd``; unmapped when no longer referenced,
    and holding no descriptor (Python's mmap keeps a duplicate of the fd open)."""
    if length == 0:
        return bytearray()
    address = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    if address in (None, _MAP_FAILED):
        errno_ = ctypes.get_errno()
        raise OSError(errno_, f"mmap of {length} bytes failed: {os.strerror(errno_)}")
    area = (ctypes.c_char * length).from_address(address)
    weakref.finalize(area, _libc.munmap, address, length)
    return area


class _SharedFile:
    """The one memfd of a launch's shipped tensors, filled as the pickler meets them."""

    def __init__(self, owned: list[int]) -> None:
        self.size = 0
        with interrupts_deferred():  # made and recorded for its owner as one step
            self.fd = os.memfd_create("enot_nb-tensor", os.MFD_CLOEXEC)
            owned.append(self.fd)

    def add(self, data: Any) -> int:
        """Copy ``data`` in at the next page boundary; returns its offset."""
        offset = -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE
        self.size = offset + data.nbytes
        os.ftruncate(self.fd, self.size)
        # The one copy; pwrite lets the kernel fill the pages (measured ~10% faster than a mapping).
        _pwrite_all(self.fd, data, offset)
        return offset


# ----------------------------------------------------------------------------- tensors


def _rebuild_storage(buffer: Any, device: str = "cpu") -> Any:
    import numpy
    import torch

    view = memoryview(buffer).cast("B")
    if view.readonly or view.nbytes < SHM_MIN_BYTES:
        # In band (the pickle's own bytes), or small: a copy of its own, so that a small tensor
        # kept in the notebook does not pin the whole result mapping it arrived in; allocated
        # by torch, so that it can be resized as any tensor can.
        storage = torch.UntypedStorage(view.nbytes)
        storage_array(storage)[:] = numpy.frombuffer(view, dtype=numpy.uint8)
    else:  # maps the result: no copy, but it cannot be resized
        storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
    return _to_device(storage, device)


def _storage_from_shared(offset: int, nbytes: int, device: str = "cpu") -> Any:
    import torch

    area = map_private(SHARED_FD[0], nbytes, offset)  # copy-on-write: the workers share it
    return _to_device(torch.frombuffer(area, dtype=torch.uint8).untyped_storage(), device)


def _to_device(storage: Any, device: str) -> Any:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return storage
    return storage.cuda(torch.device(device).index)


def _rebuild_tensor(
    storage: Any,
    offset: int,
    size: tuple,
    stride: tuple,
    dtype: Any,
    requires_grad: bool,
    parameter: bool,
    subclass: Any = None,
) -> Any:
    import torch

    tensor = torch.empty(0, dtype=dtype, device=storage.device)
    if storage.nbytes():
        tensor.set_(storage, offset, size, stride)
    else:
        tensor = tensor.new_empty(size)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    tensor.requires_grad_(requires_grad)
    return tensor if subclass is None else tensor.as_subclass(subclass)


def _plain_subclass(t: type) -> bool:
    """A Python subclass of torch.Tensor (x.as_subclass(S)): rebuilt the same way, so that its
    storage is shared as the notebook's is (exotic tensors keep torch's own pickling)."""
    import torch

    return (
        issubclass(t, torch.Tensor) and not issubclass(t, torch.nn.Parameter) and not t.__module__.startswith("torch")
    )


def _set_tensor_state(tensor: Any, state: tuple) -> Any:
    grad, attributes = state
    if grad is not None:
        tensor.grad = grad
    tensor.__dict__.update(attributes)
    return tensor


def _reduce_numpy_view(array: Any, is_known: Any) -> Any:
    """A NumPy view travels as a view of the array that owns its memory, or of the nearest
    array the notebook already holds (aliasing kept)."""
    root = array_owner(array)
    known = is_known(array, root)
    root = root if known is None else known
    if root is array or not root.flags.c_contiguous:
        return None
    offset = array.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return _numpy_view, (root, offset, array.shape, array.strides, array.dtype)


def array_owner(array: Any) -> Any:
    """The NumPy array that owns the memory ``array`` views (itself if it owns it)."""
    import numpy

    while isinstance(array.base, numpy.ndarray):
        array = array.base
    return array


def _numpy_view(root: Any, offset: int, shape: tuple, strides: tuple, dtype: Any) -> Any:
    import numpy

    return numpy.ndarray(shape, dtype, buffer=root, offset=offset, strides=strides)


def _array_of_storage(storage: Any, offset: int, shape: tuple, strides: tuple, dtype: Any) -> Any:
    """A NumPy array over a tensor's memory (``tensor.numpy()``), rebuilt over the storage."""
    import numpy
    import torch

    # Through Tensor.numpy(), not storage_array(): the storage then cannot be resized under the
    # array, as after the cell's own t.numpy().
    flat = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return numpy.ndarray(shape, dtype, buffer=flat, offset=offset, strides=strides)


def _owned_array(buffer: Any, dtype: Any, shape: tuple, order: str) -> Any:
    import numpy

    array = numpy.empty(shape, dtype, order=order)
    numpy.ravel(array, order="K").view(numpy.uint8)[:] = numpy.frombuffer(buffer, dtype=numpy.uint8)
    return array


def _storage_of_array(root: Any, offset: int, nbytes: int) -> Any:
    """A tensor storage over a NumPy array's memory (``torch.from_numpy``), rebuilt over it."""
    import numpy
    import torch

    flat = numpy.ravel(root, order="K").view(numpy.uint8)[offset : offset + nbytes]
    if not flat.flags.writeable:  # torch would warn; the memory cannot be shared anyway
        flat = flat.copy()
    return torch.from_numpy(flat).untyped_storage()


def _tensor_owned(array: Any) -> Any:
    """The tensor whose memory a NumPy array views (``tensor.numpy()``, ``np.asarray(t)``), or
    None."""
    import torch

    base = array_owner(array).base
    return base if isinstance(base, torch.Tensor) and base.device.type == "cpu" else None


class MemoryMap:
    """Objects by the address range of their memory, for "which one holds this range" lookups:
    ``torch.from_numpy`` leaves no Python reference between a tensor and its array."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._entries: list[tuple[int, int, Any]] = []

    def add(self, start: int, size: int, obj: Any) -> None:
        i = bisect.bisect_right(self._starts, start)
        self._starts.insert(i, start)
        self._entries.insert(i, (start, start + size, obj))

    def holding(self, start: int, size: int) -> tuple[Any, int] | None:
        """The object whose memory holds ``size`` bytes from ``start``, and the offset."""
        i = bisect.bisect_right(self._starts, start)
        for first, end, obj in reversed(self._entries[max(0, i - 8) : i]):  # nested views: a few
            if start + size <= end:
                return obj, start - first
        return None


def _contiguous_memory(array: Any) -> tuple[int, int] | None:
    """Where a NumPy array's memory is, if it is one contiguous block (callers have checked that
    it is not a tensor's: that memory travels as the storage)."""
    if not array.nbytes or not (array.flags.c_contiguous or array.flags.f_contiguous):
        return None
    return array.__array_interface__["data"][0], array.nbytes


def _make_weakref(referent: Any) -> Any:
    return weakref.ref(referent)


def _make_function(code: Any, globals_: dict, name: str, closure: tuple | None) -> Any:
    return types.FunctionType(code, globals_, name, None, closure)


def _set_function_state(function: Any, state: dict) -> Any:
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


class TensorPickler(cloudpickle.Pickler):
    """cloudpickle that keeps tensor aliasing (a view and its base share one storage after the
    round trip), sends storage bytes out of band, and keeps the notebook's functions bound to the
    notebook's globals.

    Modes: ``"ship"`` (notebook -> spawned workers: large storages through memfds), ``"result"``
    (a worker -> the notebook: storage bytes out of band, CUDA moved to the CPU), ``"dry"`` (only
    checks what would pickle; no data is touched).
    """

    def __init__(self, file: Any, mode: str, buffer_callback: Any = None, namespace: dict | None = None) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self.mode = mode
        self.shared: _SharedFile | None = None
        self.owned_fds: list[int] = []  # where the shared file's descriptor is recorded
        self.off_cpu = 0
        self.namespace = namespace
        """Functions whose globals are this dict are the notebook's: rebuilt on its globals."""
        self._function_cells: set[int] = set()
        # NumPy arrays and torch storages sharing memory stay one memory: whichever of the two
        # is met first travels, the other is rebuilt over it.
        self._array_memory: MemoryMap | None = None
        self._storages = MemoryMap()

    def is_known(self, array: Any, root: Any) -> Any:
        """An array the receiver holds whose memory holds ``array`` (a view of ``root``), or
        None."""
        return None

    def known_arrays(self) -> list[Any]:
        """The NumPy arrays the receiver already holds (they travel as references)."""
        return []

    def reducer_override(self, obj: Any) -> Any:
        import torch

        t = type(obj)
        if (
            (t in (torch.Tensor, torch.nn.Parameter) or _plain_subclass(t))
            and obj.layout == torch.strided
            and obj.device.type != "meta"
        ):
            return self._reduce_tensor(obj)
        if t is torch.UntypedStorage:
            return self._reduce_storage(obj)
        if t is types.FunctionType and self.namespace is not None and obj.__globals__ is self.namespace:
            return self._reduce_function(obj)
        if type(obj).__name__ == "ndarray" and type(obj).__module__ == "numpy":
            tensor = _tensor_owned(obj)
            if tensor is not None:  # its memory is a storage: it travels over that storage
                return self._array_over(tensor.untyped_storage(), obj)
            view = _reduce_numpy_view(obj, self.is_known)
            if view is not None:
                return view
            memory = _contiguous_memory(obj)
            if memory is not None and self.mode != "dry":
                held = self._storages.holding(*memory)  # torch.from_numpy(obj), met before
                if held is not None:
                    return self._array_over(held[0], obj)
                self._array_map().add(*memory, obj)
                if self.mode == "ship" and obj.flags.owndata and not obj.dtype.hasobject:
                    # The worker's copy owns its memory too, as the notebook's does (resize()).
                    order = "C" if obj.flags.c_contiguous else "F"
                    return _owned_array, (pickle.PickleBuffer(obj), obj.dtype, obj.shape, order)
        if t is types.CellType and id(obj) in self._function_cells:
            return types.CellType, ()
        if t is weakref.ReferenceType and obj() is not None:
            return _make_weakref, (obj(),)
        _refuse_process_bound(obj)
        return super().reducer_override(obj)

    def _reduce_tensor(self, tensor: Any) -> Any:
        import torch

        self.off_cpu += tensor.device.type != "cpu" and self.mode != "ship"
        args = (
            tensor.untyped_storage(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor.requires_grad,
            type(tensor) is torch.nn.Parameter,
            type(tensor) if type(tensor) not in (torch.Tensor, torch.nn.Parameter) else None,
        )
        attributes = dict(getattr(tensor, "__dict__", {}))
        grad = tensor.grad if tensor.is_leaf else None
        if grad is None and not attributes:
            return _rebuild_tensor, args
        return _rebuild_tensor, args, (grad, attributes), None, None, _set_tensor_state

    def _reduce_storage(self, storage: Any) -> Any:
        device = str(storage.device) if self.mode == "ship" else "cpu"
        if self.mode == "dry":
            return _rebuild_storage, (b"",)
        held = self._array_holding(storage)
        if held is not None:
            return _storage_of_array, (*held, storage.nbytes())
        data = storage_array(storage)
        if self.mode == "ship" and data.nbytes >= SHM_MIN_BYTES and hasattr(os, "memfd_create"):
            if self.shared is None:
                self.shared = _SharedFile(self.owned_fds)
            return _storage_from_shared, (self.shared.add(data), data.nbytes, device)
        raw = data if data.nbytes else b""
        return _rebuild_storage, (pickle.PickleBuffer(raw), device)

    def _array_holding(self, storage: Any) -> tuple[Any, int] | None:
        """The NumPy array (and offset) whose memory a storage made by ``torch.from_numpy`` is,
        if the receiver holds it or it was met before; else the storage is noted, and an array
        met later is rebuilt over it. Only storages that cannot be resized can be an array's."""
        if storage.device.type != "cpu" or storage.resizable() or "numpy" not in sys.modules or not storage.nbytes():
            return None
        held = self._array_map().holding(storage.data_ptr(), storage.nbytes())
        if held is None:
            self._storages.add(storage.data_ptr(), storage.nbytes(), storage)
        return held

    def _array_map(self) -> MemoryMap:
        if self._array_memory is None:
            self._array_memory = MemoryMap()
            for array in self.known_arrays():
                memory = _contiguous_memory(array) if _tensor_owned(array) is None else None
                if memory is not None:
                    self._array_memory.add(*memory, array)
        return self._array_memory

    def _array_over(self, storage: Any, array: Any) -> Any:
        offset = array.__array_interface__["data"][0] - storage.data_ptr()
        return _array_of_storage, (storage, offset, array.shape, array.strides, array.dtype)

    def _reduce_function(self, function: Any) -> Any:
        closure = function.__closure__
        contents = []
        for cell in closure or ():
            try:
                contents.append(cell.cell_contents)
            except ValueError:
                contents.append(_EMPTY_CELL)
        state = {
            "__defaults__": function.__defaults__,
            "__kwdefaults__": function.__kwdefaults__,
            "__qualname__": function.__qualname__,
            "__module__": function.__module__,
            "__doc__": function.__doc__,
            "__annotations__": function.__annotations__,
            "__dict__": dict(function.__dict__),
            "closure_contents": contents,
        }
        # The cells themselves travel (empty, filled by the state): one cell shared by two
        # closures, or registered by the object graph, stays one cell.
        self._function_cells.update(map(id, closure or ()))
        args = (function.__code__, function.__globals__, function.__name__, closure)
        return _make_function, args, state, None, None, _set_function_state


def storage_array(storage: Any) -> Any:
    """The bytes of an untyped storage as a NumPy uint8 array (no copy on the CPU). Not through
    ``Tensor.numpy()``: that marks the storage as never resizable again, and the user's
    ``t.resize_()`` would then fail."""
    import numpy
    import torch

    if storage.device.type != "cpu":
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).cpu().numpy()
    if not storage.nbytes():
        return numpy.empty(0, dtype=numpy.uint8)
    return numpy.asarray(_StorageMemory(storage))


class _StorageMemory:
    """A storage's bytes as NumPy sees them (the array keeps this, so the storage, alive)."""

    __slots__ = ("__array_interface__", "storage")

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.__array_interface__ = {
            "data": (storage.data_ptr(), False),
            "shape": (storage.nbytes(),),
            "typestr": "|u1",
            "version": 3,
        }


class ShipPickler(TensorPickler):
    """Notebook -> spawned workers: the notebook's namespace dict travels as a reference to the
    worker's own namespace (pickle never calls reducer_override for a dict, so a persistent id)."""

    def __init__(
        self, file: Any, mode: str = "ship", buffer_callback: Any = None, namespace: dict | None = None
    ) -> None:
        super().__init__(file, mode, buffer_callback=buffer_callback, namespace=namespace)

    def persistent_id(self, obj: Any) -> Any:
        return "namespace" if obj is self.namespace and obj is not None else None


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


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def release_later(fds: list[int]) -> None:
    """Close shared-memory descriptors off the caller's path: freeing 2 GiB of memfd pages
    takes about 0.25 s here, which the notebook need not wait for."""
    if fds:
        threading.Thread(target=close_all, args=(fds,), name="enot_nb-release", daemon=True).start()


def _ignore(_: Any) -> None:
    pass


class _Discard(io.RawIOBase):
    def write(self, data: Any) -> int:
        return len(memoryview(data))


def dry_run(obj: Any, pickler_class: Any = None, **kwargs: Any) -> int:
    """Raise if ``obj`` cannot be pickled; return how many of its tensors are off the CPU."""
    pickler = (pickler_class or TensorPickler)(_Discard(), "dry", buffer_callback=_ignore, **kwargs)
    pickler.dump(obj)
    return pickler.off_cpu


def unpicklable(values: dict[str, Any], **kwargs: Any) -> dict[str, str]:
    """The names whose values cannot be pickled, each with the reason."""
    problems = {}
    for name, value in values.items():
        try:
            dry_run(value, **kwargs)
        except Exception as err:  # noqa: BLE001 - any failure means it cannot be sent
            problems[name] = f"{type(value).__name__} cannot be pickled ({err})"
    return problems


# ----------------------------------------------------------------------------- results back


_ALIGN = 64
_RESULT_HEADER = struct.Struct("<QQ")  # length of the main pickle, number of buffers


def _refuse_process_bound(obj: Any) -> None:
    import torch

    if isinstance(obj, torch.nn.parallel.DistributedDataParallel):
        # It pickles, but unpickling needs the process group of the run that made it.
        raise TypeError(
            "DistributedDataParallel is bound to the workers' process group; its "
            ".module (your model) comes back instead when the cell uses it"
        )


def dump_result(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle a result; tensor data stays in the returned buffers (not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    TensorPickler(stream, "result", buffer_callback=buffers.append).dump(obj)
    return stream.getvalue(), buffers


def write_result(fd: int, main: bytes, buffers: list[pickle.PickleBuffer]) -> int:
    """Lay the result out in a memfd (header, pickle, 64-byte aligned buffers); returns its size."""
    raws = [b.raw() for b in buffers]
    layout = _layout(len(main), raws)
    header = _RESULT_HEADER.pack(len(main), len(raws))
    header += struct.pack(f"<{2 * len(raws)}Q", *(x for pair in layout for x in pair))
    start = _data_start(len(raws))
    total = layout[-1][0] + layout[-1][1] if layout else start + len(main)
    os.ftruncate(fd, total)
    _pwrite_all(fd, header, 0)
    _pwrite_all(fd, main, start)
    for raw, (offset, _) in zip(raws, layout):
        _pwrite_all(fd, raw, offset)
    return total


def _data_start(count: int) -> int:
    return _RESULT_HEADER.size + 16 * count


def _layout(main_length: int, raws: list[memoryview]) -> list[tuple[int, int]]:
    offset = _data_start(len(raws)) + main_length
    layout = []
    for raw in raws:
        offset = -(-offset // _ALIGN) * _ALIGN
        layout.append((offset, raw.nbytes))
        offset += raw.nbytes
    return layout


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def read_result(fd: int, size: int) -> Any:
    """Load a result written by write_result; tensors map its pages (copy-on-write, no copy)."""
    if size == 0:
        raise EOFError("the result file is empty")
    view = memoryview(map_private(fd, size)).cast("B")
    main_length, count = _RESULT_HEADER.unpack_from(view)
    pairs = struct.unpack_from(f"<{2 * count}Q", view, _RESULT_HEADER.size)
    start = _data_start(count)
    buffers = [view[pairs[2 * i] : pairs[2 * i] + pairs[2 * i + 1]] for i in range(count)]
    return pickle.loads(view[start : start + main_length], buffers=buffers)


def result_fd() -> int | None:
    """A fresh memfd for rank 0's result, or None where memfds do not exist."""
    return os.memfd_create("enot_nb-result", os.MFD_CLOEXEC) if hasattr(os, "memfd_create") else None


def dump_inline(obj: Any) -> bytes:
    """Where no memfd exists: the result pickled with its tensor data in band."""
    stream = io.BytesIO()
    TensorPickler(stream, "result").dump(obj)
    return stream.getvalue()
