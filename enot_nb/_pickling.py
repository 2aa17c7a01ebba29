"""Pickling between the notebook and spawned workers: large tensors through shared memory.

A CPU tensor of ``SHM_MIN_BYTES`` or more is copied once into an anonymous shared-memory file
(memfd) instead of into the pickle; the file descriptor travels beside the pickle (to the fork
server over a Unix socket, then inherited by the workers) and each worker maps it copy-on-write:
one memory copy in all, however many workers read it, and nothing large goes through a pipe.
"""

from __future__ import annotations

import io
import math
import os
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
    target = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=tensor.numel(), dtype=tensor.dtype)
    target.copy_(tensor.detach().view(-1))  # the one copy
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


class _Discard(io.RawIOBase):
    def write(self, data: Any) -> int:
        return len(memoryview(data))


class _DryRunPickler(cloudpickle.Pickler):
    """Checks picklability without paying for tensor data (tensors always pickle)."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.is_leaf:
            return tuple, ()
        return super().reducer_override(obj)


def unpicklable(values: dict[str, Any]) -> dict[str, str]:
    """The names whose values cannot be pickled, each with the reason."""
    problems = {}
    for name, value in values.items():
        try:
            _DryRunPickler(_Discard(), protocol=5).dump(value)
        except Exception as err:  # noqa: BLE001 - any failure means it cannot be sent
            problems[name] = f"{type(value).__name__} cannot be pickled ({err})"
    return problems
