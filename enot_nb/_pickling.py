"""Pickling between the notebook and spawned workers: large tensors through shared memory.

A CPU tensor of ``SHM_MIN_BYTES`` or more is copied once into an anonymous shared-memory file
(memfd) instead of into the pickle; the file descriptor travels beside the pickle (to the fork
server over a Unix socket, then inherited by the workers) and each worker maps it copy-on-write:
one memory copy in all, however many workers read it, and nothing large goes through a pipe.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import struct
import threading
from typing import Any

import cloudpickle

SHM_MIN_BYTES = int(float(os.environ.get("ENOT_NB_SHM_MIN_MB", "1")) * 2**20)

RECEIVED_FDS: list[int] = []
"""In a worker: the shared-memory descriptors that came with the job, by index."""


def _shareable(value: Any) -> bool:
    import torch

    return (
        hasattr(os, "memfd_create")
        and type(value) in (torch.Tensor, torch.nn.Parameter)
        and value.device.type == "cpu"
        and value.layout == torch.strided
        and value.is_contiguous()
        and value.is_leaf
        and value.nbytes >= SHM_MIN_BYTES
    )


def _to_memfd(tensor: Any) -> int:
    import torch

    fd = os.memfd_create("enot_nb-tensor", os.MFD_CLOEXEC)
    os.ftruncate(fd, tensor.nbytes)
    # The one copy; pwrite lets the kernel fill the pages (measured ~10% faster than a mapping).
    _pwrite_all(fd, tensor.detach().reshape(-1).view(torch.uint8).numpy(), 0)
    return fd


def _rebuild(index: int, dtype: Any, shape: tuple, requires_grad: bool, parameter: bool) -> Any:
    import torch

    flat = torch.from_file(f"/proc/self/fd/{RECEIVED_FDS[index]}", shared=False,  # private: copy-on-write
                           size=math.prod(shape), dtype=dtype)
    tensor = flat.view(shape)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


class SharedMemoryPickler(cloudpickle.Pickler):
    """cloudpickle that moves large CPU tensors into memfds (see the module docstring)."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=5)
        self.fds: list[int] = []

    def reducer_override(self, obj: Any) -> Any:
        if _shareable(obj):
            self.fds.append(_to_memfd(obj))
            import torch

            return _rebuild, (len(self.fds) - 1, obj.dtype, tuple(obj.shape), obj.requires_grad,
                              isinstance(obj, torch.nn.Parameter))
        return super().reducer_override(obj)


def dumps(obj: Any) -> tuple[bytes, list[int]]:
    """Pickle ``obj``; returns the bytes and the shared-memory descriptors they refer to.

    The caller owns the descriptors and closes them once the workers have started.
    """
    buffer = io.BytesIO()
    pickler = SharedMemoryPickler(buffer)
    try:
        pickler.dump(obj)
    except BaseException:
        close_all(pickler.fds)
        raise
    return buffer.getvalue(), pickler.fds


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def release_later(fds: list[int]) -> None:
    """Close shared-memory descriptors off the caller's path: freeing 2 GiB of memfd pages
    takes about 0.25 s here, which the notebook need not wait for."""
    if fds:
        threading.Thread(target=close_all, args=(fds,), name="enot_nb-release", daemon=True).start()


class _Discard(io.RawIOBase):
    def write(self, data: Any) -> int:
        return len(memoryview(data))


class _DryRunPickler(cloudpickle.Pickler):
    """Checks picklability without paying for tensor data (tensors always pickle); counts the
    tensors that a ResultPickler would move off an accelerator."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=5)
        self.off_cpu = 0

    def reducer_override(self, obj: Any) -> Any:
        import torch

        _refuse_process_bound(obj)
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and (obj.is_leaf or not obj.requires_grad):
            self.off_cpu += obj.device.type not in ("cpu", "meta")
            return tuple, ()
        return super().reducer_override(obj)


def dry_run(obj: Any) -> int:
    """Raise if ``obj`` cannot be pickled; return how many of its tensors are off the CPU."""
    pickler = _DryRunPickler()
    pickler.dump(obj)
    return pickler.off_cpu


def unpicklable(values: dict[str, Any]) -> dict[str, str]:
    """The names whose values cannot be pickled, each with the reason."""
    problems = {}
    for name, value in values.items():
        try:
            dry_run(value)
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
        raise TypeError("DistributedDataParallel is bound to the workers' process group; its "
                        ".module (your model) comes back instead when the cell uses it")


def _from_buffer(buffer: Any, dtype: Any, shape: tuple, requires_grad: bool, parameter: bool) -> Any:
    import torch

    raw = memoryview(buffer).cast("B")
    if len(raw):
        flat = torch.frombuffer(raw, dtype=torch.uint8)
        tensor = flat.view(dtype).view(shape)
    else:
        tensor = torch.empty(shape, dtype=dtype)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


class ResultPickler(cloudpickle.Pickler):
    """Pickles a worker's result: tensor data out of band (no copy into the pickle), CUDA
    tensors moved to the CPU (the launching process must not initialize CUDA)."""

    def __init__(self, file: Any, buffer_callback: Any) -> None:
        super().__init__(file, protocol=5, buffer_callback=buffer_callback)
        self.moved_to_cpu = 0

    def reducer_override(self, obj: Any) -> Any:
        import torch

        _refuse_process_bound(obj)
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.layout == torch.strided \
                and obj.device.type != "meta" and (obj.is_leaf or not obj.requires_grad):
            if obj.device.type != "cpu":
                self.moved_to_cpu += 1
            data = obj.detach().cpu().contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
            return _from_buffer, (pickle.PickleBuffer(raw), obj.dtype, tuple(obj.shape),
                                  obj.requires_grad, isinstance(obj, torch.nn.Parameter))
        return super().reducer_override(obj)


def dump_result(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle a result; tensor data stays in the returned buffers (not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    ResultPickler(stream, buffers.append).dump(obj)
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
    area = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(area)
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
    ResultPickler(stream, None).dump(obj)
    return stream.getvalue()
