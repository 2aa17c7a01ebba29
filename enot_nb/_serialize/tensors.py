"""Tensors, storages and NumPy arrays as pickles carry them: the reducers and the rebuilders.

A tensor travels as its untyped storage (pickled once, however many tensors view it) plus its
view of it (offset, size, stride, dtype), so a view and its base share one storage after the
round trip. A NumPy array and a torch storage that are one memory (``torch.from_numpy``,
``tensor.numpy()``) stay one memory: whichever of the two is met first travels, the other is
rebuilt over it (``MemoryOwners``). A NumPy view travels as a view of the array that owns its
memory.

The rebuild functions are named in pickles (results files saved by ``--export`` among them):
their names stay, and where one moves, ``renamed`` maps its old module to the new one.
"""

from __future__ import annotations

import bisect
import pickle
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, cast

from enot_nb._serialize.shm import SHARED_FD, map_private

if TYPE_CHECKING:
    import numpy
    import torch

Reduction = str | tuple[Any, ...]
"""What a reducer returns: (a rebuild function, its arguments[, state, ..., a state setter]),
or the name of a global."""


# ----------------------------------------------------------------------------- storages


def storage_array(storage: torch.UntypedStorage) -> numpy.ndarray:
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

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage
        self.__array_interface__ = {
            "data": (storage.data_ptr(), False),
            "shape": (storage.nbytes(),),
            "typestr": "|u1",
            "version": 3,
        }


def _rebuild_storage(buffer: Any, device: str = "cpu") -> torch.UntypedStorage:
    import numpy
    import torch

    # A copy of its own, allocated by torch, however large: a view of the result's mapping
    # would pin the whole result (every other tensor of the cell) for as long as this one is
    # kept, cost its pages twice once written, and could never be resized. One memory copy.
    view = memoryview(buffer).cast("B")
    storage = torch.UntypedStorage(view.nbytes)
    if view.nbytes:
        storage_array(storage)[:] = numpy.frombuffer(view, dtype=numpy.uint8)
    return _to_device(storage, device)


def bytes_view(buffer: Any) -> torch.Tensor:
    """A uint8 tensor over a buffer's bytes, no copy, only to be read from (e.g. copied into a
    notebook storage) and dropped: what pins nothing once the copy is done."""
    import warnings

    import torch

    view = memoryview(buffer).cast("B")
    if not view.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only buffer (in band): only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)


def _storage_from_shared(offset: int, nbytes: int, device: str = "cpu") -> torch.UntypedStorage:
    import torch

    area = map_private(SHARED_FD[0], nbytes, offset)  # copy-on-write: the workers share it
    return _to_device(torch.frombuffer(area, dtype=torch.uint8).untyped_storage(), device)


def _to_device(storage: torch.UntypedStorage, device: str) -> torch.UntypedStorage:
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return storage
    # UntypedStorage.cuda() returns an UntypedStorage (torch annotates its base class's method).
    return cast("torch.UntypedStorage", storage.cuda(torch.device(device).index))


# ----------------------------------------------------------------------------- tensors


UNREADABLE = (RuntimeError, NotImplementedError, ValueError)
"""What torch raises where a tensor has no storage or strided view that can be read: a sparse
tensor (its indices and values have theirs), an uninitialized parameter of a lazy module
(ValueError), other exotic tensors."""


def storage_of(tensor: Any) -> torch.UntypedStorage | None:
    """A tensor's untyped storage, or None where it has none that can be read (UNREADABLE)."""
    try:
        return tensor.untyped_storage()
    except UNREADABLE:
        return None


def tensor_storages(tensor: Any) -> list[torch.UntypedStorage]:
    """The storages that hold a tensor's values: its own, or a sparse tensor's parts' (see
    sparse_parts); none where none can be read."""
    storage = storage_of(tensor)
    if storage is not None:
        return [storage]
    return [s for s in map(storage_of, sparse_parts(tensor)) if s is not None]


def sparse_parts(tensor: Any) -> tuple[torch.Tensor, ...]:
    """A sparse tensor's indices and values, strided tensors over the storages that hold it, in
    the order its layout's constructor takes them (see sparse_tensor); () for other tensors."""
    import torch

    layout = tensor.layout
    if layout == torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return tensor.ccol_indices(), tensor.row_indices(), tensor.values()
    return ()


def coalesced(tensor: torch.Tensor) -> bool:
    """Whether a sparse COO tensor is coalesced (False for other layouts: they have no such flag)."""
    import torch

    return tensor.layout == torch.sparse_coo and tensor.is_coalesced()


def sparse_tensor(
    layout: torch.layout, parts: list[torch.Tensor], size: tuple[int, ...], coalesced: bool
) -> torch.Tensor:
    """The sparse tensor of ``layout`` over ``parts`` (sparse_parts' order), sharing their memory.
    Its invariants are not checked again (they held for the tensor the parts came from), as
    torch's own unpickling does not: and so torch does not warn that the checks are off."""
    import torch

    if layout == torch.sparse_coo:
        indices, values = parts
        return torch.sparse_coo_tensor(indices, values, size, is_coalesced=coalesced, check_invariants=False)
    compressed, plain, values = parts
    return torch.sparse_compressed_tensor(compressed, plain, values, size, layout=layout, check_invariants=False)


class TensorBits(NamedTuple):
    """What a tensor's storage and view do not say about its values: a conjugate view
    (``z.conj()``, ``z.mH``) reads its storage conjugated, a negative view (``torch._neg_view``)
    negated; an inference tensor (made under ``torch.inference_mode()``) is one autograd never
    records. Flags of the tensor, not of its bytes: they travel beside its view."""

    conj: bool = False
    neg: bool = False
    inference: bool = False


PLAIN = TensorBits()


def tensor_bits(tensor: torch.Tensor) -> TensorBits:
    return TensorBits(tensor.is_conj(), tensor.is_neg(), tensor.is_inference())


class TensorHooks(NamedTuple):
    """A tensor's hook dicts, each None where it has none: ``register_hook``'s
    (``_backward_hooks``) and ``register_post_accumulate_grad_hook``'s; and the ids of the hooks
    in them (``RemovableHandle`` numbers hooks from one counter per process)."""

    backward: Any
    post_accumulate_grad: Any
    ids: tuple[int, ...]


def tensor_hooks(tensor: torch.Tensor) -> TensorHooks:
    backward, post = tensor._backward_hooks, tensor._post_accumulate_grad_hooks
    return TensorHooks(backward, post, hook_ids(backward, post))


def hook_ids(*dicts: Any) -> tuple[int, ...]:
    """The ids of the hooks in a tensor's hook dicts (see TensorHooks)."""
    if not any(dicts):
        return ()
    return tuple(k for hooks in dicts if hooks for k in hooks if type(k) is int)


def set_tensor_hooks(tensor: torch.Tensor, hooks: TensorHooks) -> None:
    """Give a tensor these hook dicts (setting one is what registers it with autograd), and move
    this process's hook counter past their ids: they were numbered by another process's counter,
    and a hook registered here later with the same id would replace one of them."""
    from torch.utils.hooks import RemovableHandle

    if tensor._backward_hooks is not hooks.backward:
        tensor._backward_hooks = hooks.backward
    if tensor._post_accumulate_grad_hooks is not hooks.post_accumulate_grad:
        tensor._post_accumulate_grad_hooks = hooks.post_accumulate_grad
    if hooks.ids:
        RemovableHandle.next_id = max(RemovableHandle.next_id, max(hooks.ids) + 1)


def travels_by_view(tensor: Any) -> bool:
    """Whether ``tensor`` (any object) is a tensor that travels as a view of its storage: a
    strided torch.Tensor, Parameter or Python subclass (exotic tensors keep torch's pickling, and
    so do quantized ones: their scales and zero points are no part of a view)."""
    import torch

    t = type(tensor)
    return (
        (t in (torch.Tensor, torch.nn.Parameter) or _plain_subclass(t))
        and tensor.layout == torch.strided
        and tensor.device.type != "meta"
        and not tensor.is_quantized
    )


def _plain_subclass(t: type) -> bool:
    """A Python subclass of torch.Tensor (x.as_subclass(S)): rebuilt the same way, so that its
    storage is shared as the notebook's is (exotic tensors keep torch's own pickling)."""
    import torch

    return (
        issubclass(t, torch.Tensor) and not issubclass(t, torch.nn.Parameter) and not t.__module__.startswith("torch")
    )


def reduce_tensor(tensor: torch.Tensor) -> Reduction:
    """A tensor (see travels_by_view) as its storage and its view of it."""
    import torch

    args: tuple[Any, ...] = (
        tensor.untyped_storage(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor.requires_grad,
        type(tensor) is torch.nn.Parameter,
        type(tensor) if type(tensor) not in (torch.Tensor, torch.nn.Parameter) else None,
    )
    bits = tensor_bits(tensor)
    if bits != PLAIN:
        args += (bits,)
    attributes = dict(getattr(tensor, "__dict__", {}))
    grad = tensor.grad if tensor.is_leaf else None
    hooks = tensor_hooks(tensor)
    if hooks.backward is None and hooks.post_accumulate_grad is None:
        if grad is None and not attributes:
            return _rebuild_tensor, args
        return _rebuild_tensor, args, (grad, attributes), None, None, _set_tensor_state
    return _rebuild_tensor, args, (grad, attributes, hooks), None, None, _set_tensor_state


def _rebuild_tensor(
    storage: torch.UntypedStorage,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
    requires_grad: bool,
    parameter: bool,
    subclass: type[torch.Tensor] | None = None,
    bits: TensorBits = PLAIN,
) -> torch.Tensor:
    import torch

    with torch.inference_mode(bits.inference):
        tensor = torch.empty(0, dtype=dtype, device=storage.device)
        if storage.nbytes():
            tensor.set_(storage, offset, size, stride)
        else:
            tensor = tensor.new_empty(size)
    if bits.conj:
        torch._C._set_conj(tensor, True)
    if bits.neg:
        torch._C._set_neg(tensor, True)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    tensor.requires_grad_(requires_grad)
    return tensor if subclass is None else tensor.as_subclass(subclass)


def _set_tensor_state(tensor: torch.Tensor, state: tuple[Any, ...]) -> torch.Tensor:
    """A rebuilt tensor's grad, attributes and, if it has any, its hooks (a state of two: a
    results file written before hooks travelled)."""
    grad, attributes, *hooks = state
    if grad is not None:
        tensor.grad = grad
    tensor.__dict__.update(attributes)
    if hooks:
        set_tensor_hooks(tensor, hooks[0])
    return tensor


# ----------------------------------------------------------------------------- NumPy arrays


def reduce_numpy_view(array: numpy.ndarray, is_known: Callable[[Any, Any], Any]) -> Reduction | None:
    """A NumPy view travels as a view of the array that owns its memory, or of the nearest
    array the notebook already holds (aliasing kept); None: ``array`` is no such view."""
    root = array_owner(array)
    known = is_known(array, root)
    root = root if known is None else known
    if root is array or not (root.flags.c_contiguous or root.flags.f_contiguous):
        return None
    offset = array.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return _numpy_view, (root, offset, array.shape, array.strides, array.dtype)


def reduce_view_within(array: numpy.ndarray, known: numpy.ndarray) -> Reduction | None:
    """``array`` as a view of ``known``, a strided array the receiver holds, by index: where
    ``array``'s first element is among ``known``'s and the index step of each of its dimensions.
    Bytes between a strided array's elements are not the receiver's to address (its owner may
    be laid out otherwise), so ``array`` goes this way only if every one of its elements is one
    of ``known``'s (same dtype); None: it is not."""
    if array.dtype != known.dtype or not array.size or not known.size:
        return None
    first = _element_index(known, array.__array_interface__["data"][0])
    if first is None:
        return None
    steps: list[tuple[int, ...] | None] = []  # None: a dimension of one, its stride kept as it is
    for size, stride in zip(array.shape, array.strides):
        following = None if size == 1 else _element_index(known, array.__array_interface__["data"][0] + stride)
        if following is None and size != 1:
            return None
        steps.append(None if following is None else tuple(b - a for a, b in zip(first, following)))
    walked = [(size, step) for size, step in zip(array.shape, steps) if step is not None]
    for d, extent in enumerate(known.shape):  # the last element of every dimension is one of known's too
        low = first[d] + sum(min(0, (size - 1) * step[d]) for size, step in walked)
        high = first[d] + sum(max(0, (size - 1) * step[d]) for size, step in walked)
        if low < 0 or high >= extent:
            return None
    return _view_within, (known, first, tuple(steps), array.shape, array.strides, array.dtype)


def _element_index(array: numpy.ndarray, address: int) -> tuple[int, ...] | None:
    """The index of ``array``'s element that starts at ``address``, or None where none does
    (strides taken largest first: exact for any view made by slicing)."""
    index = [0] * array.ndim
    offset = address - array.__array_interface__["data"][0]
    for size, stride in zip(array.shape, array.strides):
        if stride < 0:  # counted from the dimension's last element, the lowest address
            offset -= (size - 1) * stride
    for d in sorted(range(array.ndim), key=lambda d: -abs(array.strides[d])):
        size, stride = array.shape[d], abs(array.strides[d])
        if stride == 0 or size == 1 or offset < 0:
            continue
        i = min(offset // stride, size - 1)
        index[d] = i if array.strides[d] > 0 else size - 1 - i
        offset -= i * stride
    return tuple(index) if offset == 0 else None


def _view_within(
    known: numpy.ndarray,
    first: tuple[int, ...],
    steps: tuple[tuple[int, ...] | None, ...],
    shape: tuple[int, ...],
    strides_of_ones: tuple[int, ...],
    dtype: numpy.dtype,
) -> numpy.ndarray:
    """A view of the receiver's ``known`` (see reduce_view_within), over the array that owns
    its memory (a view's base, as NumPy's own views have)."""
    import numpy

    owner = array_owner(known)
    start = known.__array_interface__["data"][0] + sum(i * k for i, k in zip(first, known.strides))
    strides = tuple(
        kept if step is None else sum(c * k for c, k in zip(step, known.strides))
        for step, kept in zip(steps, strides_of_ones)
    )
    if owner.flags.c_contiguous or owner.flags.f_contiguous:
        offset = start - owner.__array_interface__["data"][0]
        return numpy.ndarray(shape, dtype, buffer=owner, offset=offset, strides=strides)
    return numpy.lib.stride_tricks.as_strided(known[tuple(slice(i, None) for i in first)], shape, strides)


def owner_of_strided(owner: numpy.ndarray, known: numpy.ndarray) -> Reduction:
    """``owner``, which owns the memory of ``known``, a strided array the receiver holds: there,
    the array that owns ``known``'s memory where it is laid out as ``owner`` (shape, strides,
    dtype, and ``known`` at the same place in it), with ``owner``'s bytes written in; else a
    copy of ``owner`` (its bytes travel either way)."""
    layout = (owner.shape, owner.strides, owner.dtype, _address(known) - _address(owner))
    return _owner_of_strided, (known, layout, owner.copy())


def _owner_of_strided(known: numpy.ndarray, layout: tuple[Any, ...], value: numpy.ndarray) -> numpy.ndarray:
    owner = array_owner(known)
    if (owner.shape, owner.strides, owner.dtype, _address(known) - _address(owner)) != layout:
        return value
    if not owner.flags.writeable:
        return owner if owner.tobytes() == value.tobytes() else value
    owner[...] = value
    return owner


def array_owning(owner: numpy.ndarray, view: numpy.ndarray) -> Reduction:
    """``owner``, which owns the memory of ``view``, an array the receiver holds: there, the
    array that owns ``view``'s memory (a view travels with all of its owner's memory,
    reduce_numpy_view), with ``owner``'s bytes written in (a write here outside the view's bytes,
    ``a[0] = 8`` after ``row = a[1:]`` went, is in no record); else a copy of ``owner``."""
    return _array_owning, (view, owner.copy())


def _array_owning(view: numpy.ndarray, value: numpy.ndarray) -> numpy.ndarray:
    owner = array_owner(view)
    if (owner.shape, owner.dtype) != (value.shape, value.dtype):
        return value
    if not owner.flags.writeable:
        return owner if owner.tobytes() == value.tobytes() else value
    owner[...] = value
    return owner


def array_extent(array: Any) -> tuple[int, int]:
    """The addresses of the first and after the last byte an array can reach."""
    start = end = array.__array_interface__["data"][0]
    for size, stride in zip(array.shape, array.strides):
        if size == 0:
            return start, start
        reach = (size - 1) * stride
        start, end = (start + reach, end) if stride < 0 else (start, end + reach)
    return start, end + array.itemsize


def array_owner(array: numpy.ndarray) -> numpy.ndarray:
    """The NumPy array that owns the memory ``array`` views (itself if it owns it)."""
    import numpy

    while isinstance(array.base, numpy.ndarray):
        array = array.base
    return array


def _numpy_view(
    root: numpy.ndarray, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: numpy.dtype
) -> numpy.ndarray:
    import numpy

    # A Fortran-ordered root's memory through its transpose, which is C-ordered over the same
    # bytes (NumPy before 2 exports only C-ordered buffers).
    buffer = root if root.flags.c_contiguous else root.T
    return numpy.ndarray(shape, dtype, buffer=buffer, offset=offset, strides=strides)


def array_over(storage: torch.UntypedStorage, array: numpy.ndarray) -> Reduction:
    """``array``, whose memory is in ``storage``, as a view of that storage."""
    offset = array.__array_interface__["data"][0] - storage.data_ptr()
    return _array_of_storage, (storage, offset, array.shape, array.strides, array.dtype)


def _array_of_storage(
    storage: torch.UntypedStorage, offset: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: numpy.dtype
) -> numpy.ndarray:
    """A NumPy array over a tensor's memory (``tensor.numpy()``), rebuilt over the storage."""
    import numpy
    import torch

    # Through Tensor.numpy(), not storage_array(): the storage then cannot be resized under the
    # array, as after the cell's own t.numpy().
    flat = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    return numpy.ndarray(shape, dtype, buffer=flat, offset=offset, strides=strides)


def _owned_array(buffer: Any, dtype: numpy.dtype, shape: tuple[int, ...], order: Literal["C", "F"]) -> numpy.ndarray:
    import numpy

    array = numpy.empty(shape, dtype, order=order)
    numpy.ravel(array, order="K").view(numpy.uint8)[:] = numpy.frombuffer(buffer, dtype=numpy.uint8)
    return array


def _storage_of_array(root: numpy.ndarray, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A tensor storage over a NumPy array's memory (``torch.from_numpy``), rebuilt over it."""
    import numpy
    import torch

    flat = numpy.ravel(root, order="K").view(numpy.uint8)[offset : offset + nbytes]
    if not flat.flags.writeable:  # torch would warn; the memory cannot be shared anyway
        flat = flat.copy()
    return torch.from_numpy(flat).untyped_storage()


def _storage_in_strided(
    known: numpy.ndarray, offset: int, nbytes: int, layout: tuple[Any, Any, int, int]
) -> torch.UntypedStorage:
    """A storage over the receiver's strided ``known`` array's memory, ``offset`` bytes from
    its lowest address: over the storage of the tensor it views there (``v.numpy()``), where
    that holds those bytes, else over the array that owns it, which must be laid out as the
    sender's (``layout``: shape, strides, offset in the owner, owner's size), as a mirrored one is."""
    import numpy
    import torch

    owner = array_owner(known)
    lowest = array_extent(known)[0]
    tensor = tensor_owned(known)
    if tensor is not None and (known.shape, known.strides) == layout[:2]:
        whole = tensor.untyped_storage()
        start = lowest - whole.data_ptr() + offset
        if 0 <= start and start + nbytes <= whole.nbytes():
            return _storage_over_storage(whole, start, nbytes)
    here = (known.shape, known.strides, lowest - _address(owner), owner.nbytes)
    if here != layout or contiguous_memory(owner) is None:
        raise ValueError(
            "a tensor made by torch.from_numpy over a strided NumPy array cannot be rebuilt over this process's copy "
            "of the array, which is laid out otherwise: make the array contiguous (numpy.ascontiguousarray) "
            "before torch.from_numpy"
        )
    start = lowest - _address(owner) + offset
    flat = numpy.ravel(owner, order="K").view(numpy.uint8)[start : start + nbytes]
    if not flat.flags.writeable:  # torch would warn; the memory cannot be shared anyway
        flat = flat.copy()
    return torch.from_numpy(flat).untyped_storage()


def _storage_of_owner(
    known: numpy.ndarray, offset: int, nbytes: int, layout: tuple[int, int] | None = None, copy: Any = None
) -> torch.UntypedStorage:
    """A storage over the memory of the array that owns the receiver's ``known``, where that is
    laid out as the sender's (``layout``: ``known``'s offset in it, its size; None in pickles
    made before it was checked), else one of its own holding ``copy``'s bytes."""
    import numpy
    import torch

    owner = array_owner(known)
    here = (_address(known) - _address(owner), owner.nbytes)
    if layout is None or (here == tuple(layout) and contiguous_memory(owner) is not None):
        return _storage_of_array(owner, offset, nbytes)
    storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
    storage_array(storage)[:] = numpy.frombuffer(copy, dtype=numpy.uint8)
    return storage


def _storage_under_array(array: numpy.ndarray, offset: int, nbytes: int) -> torch.UntypedStorage:
    """The storage (or the part of it) of the tensor that owns the receiver's ``array``."""
    tensor = tensor_owned(array)
    if tensor is None or tensor.untyped_storage().nbytes() < offset + nbytes:
        raise ValueError(
            "a tensor whose memory a NumPy array views here (tensor.numpy()) cannot be rebuilt over this process's "
            "copy of the array, which is not a view of a tensor: send the tensor before the array"
        )
    whole = tensor.untyped_storage()
    if offset == 0 and nbytes in (0, whole.nbytes()):  # 0: the whole, for an array to lie in
        return whole
    return _storage_over_storage(whole, offset, nbytes)


def array_under_array(known: numpy.ndarray, offset: int, array: numpy.ndarray) -> Reduction:
    """``array``, whose memory lies ``offset`` bytes into the storage of the tensor that owns
    ``known`` (an array the receiver holds), rebuilt over the receiver's (see _storage_under_array)."""
    return _array_under_array, (known, offset, array.nbytes, array.shape, array.strides, array.dtype)


def _array_under_array(
    known: numpy.ndarray, offset: int, nbytes: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any
) -> numpy.ndarray:
    whole = _storage_under_array(known, 0, 0)
    if whole.nbytes() < offset + nbytes:
        raise ValueError("a NumPy array over a tensor's memory lies outside this process's copy of that tensor")
    return _array_of_storage(whole, offset, shape, strides, dtype)


def _address(array: numpy.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _storage_over_storage(storage: torch.UntypedStorage, offset: int, nbytes: int) -> torch.UntypedStorage:
    """A storage over part of another's memory (``torch.from_numpy(t.numpy())``), rebuilt over
    the receiver's: one memory, as where it was made."""
    import torch

    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return torch.from_numpy(whole.numpy()[offset : offset + nbytes]).untyped_storage()


def tensor_owned(array: numpy.ndarray) -> torch.Tensor | None:
    """The tensor whose memory a NumPy array views (``tensor.numpy()``, ``np.asarray(t)``), or
    None."""
    import torch

    base = array_owner(array).base
    return base if isinstance(base, torch.Tensor) and base.device.type == "cpu" else None


def contiguous_memory(array: numpy.ndarray) -> tuple[int, int] | None:
    """Where a NumPy array's memory is, if it is one contiguous block (callers have checked that
    it is not a tensor's: that memory travels as the storage)."""
    if not array.nbytes or not (array.flags.c_contiguous or array.flags.f_contiguous):
        return None
    return array.__array_interface__["data"][0], array.nbytes


# ----------------------------------------------------------------------------- shared memory


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


def may_be_an_arrays(storage: torch.UntypedStorage) -> bool:
    """Whether a storage can be a NumPy array's memory (``torch.from_numpy`` makes one that
    cannot be resized, on the CPU)."""
    cpu = storage.device.type == "cpu"
    return cpu and not storage.resizable() and "numpy" in sys.modules and bool(storage.nbytes())


class MemoryOwners:
    """The NumPy arrays and torch storages a pickler has met, by their memory: whichever of an
    array and a storage that are one memory is met first travels, the other is rebuilt over it.

    ``known_arrays``: the arrays the receiver already holds (they travel as references, and a
    storage over one of them is rebuilt over the receiver's); ``known_storages``: the storages
    it holds (an array over one is rebuilt over the receiver's: ``torch.from_numpy(array)``
    sent in one cell, ``array`` in a later one). Both asked for when first needed."""

    def __init__(
        self, known_arrays: Callable[[], list[Any]], known_storages: Callable[[], list[Any]] = lambda: []
    ) -> None:
        self._known_arrays, self._known_storages = known_arrays, known_storages
        self._arrays: MemoryMap | None = None
        self._strided: MemoryMap | None = None
        self._under: MemoryMap | None = None
        self._owners: MemoryMap | None = None
        self._storages_map: MemoryMap | None = None

    def array_holding(self, storage: torch.UntypedStorage) -> tuple[Any, int] | None:
        """The NumPy array (and offset) whose memory a storage made by ``torch.from_numpy`` is,
        if the receiver holds it or it was met before; else the storage is noted, and an array
        met later is rebuilt over it. Only storages that cannot be resized can be an array's."""
        if not may_be_an_arrays(storage):
            return None
        held = self._array_map().holding(storage.data_ptr(), storage.nbytes())
        if held is None:
            self._storage_map().add(storage.data_ptr(), storage.nbytes(), storage)
        return held

    def strided_holding(self, storage: torch.UntypedStorage) -> Reduction | None:
        """A storage ``torch.from_numpy`` made over a strided array the receiver holds (its
        extent, gaps between the elements included), rebuilt over the receiver's (see
        _storage_in_strided); None where no such array holds it."""
        if not may_be_an_arrays(storage):
            return None
        if self._strided is None:
            self._strided = MemoryMap()
            for array in self._known_arrays():
                owner = array_owner(array)
                if array.size and contiguous_memory(array) is None and contiguous_memory(owner) is not None:
                    start, end = array_extent(array)
                    self._strided.add(start, end - start, array)
        held = self._strided.holding(storage.data_ptr(), storage.nbytes())
        if held is None:
            return None
        known, offset = held
        owner = array_owner(known)
        layout = (known.shape, known.strides, array_extent(known)[0] - _address(owner), owner.nbytes)
        return _storage_in_strided, (known, offset, storage.nbytes(), layout)

    def in_known_owner(self, storage: torch.UntypedStorage) -> Reduction | None:
        """A storage ``torch.from_numpy`` made over the owner of a view the receiver holds
        (``row = a[1:]`` or ``row = a[::2]`` went first, ``torch.from_numpy(a)`` now): rebuilt
        over the receiver's owner of that view, which holds all of the owner's memory where the
        view travelled with it (reduce_numpy_view), laid out as here; else (the view went over a
        storage, or its owner is laid out otherwise) from the bytes that travel beside, a copy
        as before. None where no such view is known. A view of a tensor's memory is
        under_known_array's and strided_holding's (over the tensor's storage)."""
        if not may_be_an_arrays(storage):
            return None
        if self._owners is None:
            self._owners = MemoryMap()
            for array in self._known_arrays():
                owner = array_owner(array)
                memory = contiguous_memory(owner)
                if owner is not array and memory is not None and array.size and tensor_owned(array) is None:
                    self._owners.add(*memory, array)
        held = self._owners.holding(storage.data_ptr(), storage.nbytes())
        if held is None:
            return None
        known, offset = held
        owner = array_owner(known)
        layout = (_address(known) - _address(owner), owner.nbytes)
        copy = pickle.PickleBuffer(storage_array(storage))  # type: ignore[arg-type]
        return _storage_of_owner, (known, offset, storage.nbytes(), layout, copy)

    def under_known_array(self, storage: torch.UntypedStorage) -> Reduction | None:
        """A storage within the memory of the tensor that owns an array the receiver holds
        (``a = t.numpy()`` came back as a view of ``t``'s storage, ``t`` itself not yet sent):
        rebuilt over the receiver's array's tensor, one memory as here; else None."""
        if storage.device.type != "cpu" or not storage.nbytes():
            return None
        held = self.under_known_array_at(storage.data_ptr(), storage.nbytes())
        return None if held is None else (_storage_under_array, (*held, storage.nbytes()))

    def under_known_array_at(self, start: int, nbytes: int) -> tuple[Any, int] | None:
        """The array the receiver holds whose tensor's storage holds these bytes, and the
        offset in it (see under_known_array)."""
        if self._under is None:
            self._under = MemoryMap()
            for array in self._known_arrays():
                tensor = tensor_owned(array)
                if tensor is not None and tensor.untyped_storage().nbytes():
                    under = tensor.untyped_storage()
                    self._under.add(under.data_ptr(), under.nbytes(), array)
        return self._under.holding(start, nbytes)

    def storage_within(self, storage: torch.UntypedStorage) -> tuple[Any, int] | None:
        """Another storage, met before or held by the receiver, whose memory holds all of this
        one's (a storage ``torch.from_numpy`` made over a tensor's memory), and the offset."""
        if storage.device.type != "cpu" or storage.resizable() or not storage.nbytes():
            return None
        held = self._storage_map().holding(storage.data_ptr(), storage.nbytes())
        return held if held is not None and held[0] is not storage else None

    def storage_holding(self, memory: tuple[int, int]) -> tuple[Any, int] | None:
        """The storage met before, or held by the receiver, whose memory holds an array's
        (``torch.from_numpy(array)``)."""
        return self._storage_map().holding(*memory)

    def storage_holding_view(self, view: numpy.ndarray, root: numpy.ndarray) -> tuple[Any, int] | None:
        """The storage met before, or held by the receiver, whose memory holds a view's but not
        all of its owner's (``t = torch.from_numpy(a[1:])`` went first, ``a`` gone by name, the
        view now): the view travels over it, one memory with ``t``, not with a copy of ``a``."""
        start, end = array_extent(view)
        held = self.storage_holding((start, end - start)) if view.size else None
        if held is None:
            return None
        first, last = array_extent(root)
        return held if self.storage_holding((first, last - first)) is None else None

    def _storage_map(self) -> MemoryMap:
        if self._storages_map is None:
            self._storages_map = MemoryMap()
            for storage in self._known_storages():
                if storage is not None and storage.device.type == "cpu" and storage.nbytes():
                    self._storages_map.add(storage.data_ptr(), storage.nbytes(), storage)
        return self._storages_map

    def add_array(self, memory: tuple[int, int], array: numpy.ndarray) -> None:
        self._array_map().add(*memory, array)

    def _array_map(self) -> MemoryMap:
        if self._arrays is None:
            self._arrays = MemoryMap()
            for array in self._known_arrays():  # a tensor's too: its storage may be one the receiver lacks
                memory = contiguous_memory(array)
                if memory is not None:
                    self._arrays.add(*memory, array)
        return self._arrays
