"""The result file: what rank 0 sends back, laid out in a memfd that the notebook maps.

Layout: a header (the main pickle's length, the number of buffers), each buffer's offset and
length, the main pickle, then the out-of-band buffers (tensor bytes), each 64-byte aligned.
The notebook maps the file privately (see shm.map_private) only while it loads it: each tensor
or array that comes back is copied out into memory of its own (allocated by torch or NumPy), and
the bytes of a notebook storage that changed are copied into that storage, so that nothing kept
afterwards pins the mapping (a small tensor kept per cell would otherwise keep every cell's whole
result alive). Where no memfd exists, the result is one pickle with
its tensor data in band (``dump_inline``; also an exported run's results file).
"""

from __future__ import annotations

import io
import os
import pickle
import struct
from typing import Any

from enot_nb._serialize.picklers import ResultPickler
from enot_nb._serialize.shm import map_private, pwrite_all

_ALIGN = 64
_RESULT_HEADER = struct.Struct("<QQ")  # length of the main pickle, number of buffers


def result_fd() -> int | None:
    """A fresh memfd for rank 0's result, or None where memfds do not exist."""
    return os.memfd_create("enot_nb-result", os.MFD_CLOEXEC) if hasattr(os, "memfd_create") else None


def dump_result(obj: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle a result; tensor data stays in the returned buffers (not copied)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    ResultPickler(stream, buffer_callback=buffers.append).dump(obj)
    return stream.getvalue(), buffers


def write_result(fd: int, main: bytes, buffers: list[pickle.PickleBuffer]) -> int:
    """Lay the result out in a memfd (header, pickle, 64-byte aligned buffers); returns its size."""
    raws = [b.raw() for b in buffers]
    layout = _layout(len(main), raws)
    header = _RESULT_HEADER.pack(len(main), len(raws))
    header += struct.pack(f"<{2 * len(raws)}Q", *(x for pair in layout for x in pair))
    start = _data_start(len(raws))
    total = _total(len(main), layout)
    os.ftruncate(fd, total)
    pwrite_all(fd, header, 0)
    pwrite_all(fd, main, start)
    for raw, (offset, _) in zip(raws, layout):
        pwrite_all(fd, raw, offset)
    return total


def size_of(main: bytes, buffers: list[pickle.PickleBuffer]) -> int:
    """The size write_result gives the file for this pickle and these buffers (nothing written:
    a Ray session's task is laid out on each rank's node, see _launch/ray_agent)."""
    raws = [b.raw() for b in buffers]
    return _total(len(main), _layout(len(main), raws))


def _total(main_length: int, layout: list[tuple[int, int]]) -> int:
    return layout[-1][0] + layout[-1][1] if layout else _data_start(len(layout)) + main_length


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


def read_result(fd: int, size: int, raw: bool = False) -> Any:
    """Load a result written by write_result (its mapping is freed once nothing refers to it).
    ``raw``: (the main pickle, its buffers) unloaded, for an unpickler of the caller's."""
    if size == 0:
        raise EOFError("the result file is empty")
    view = memoryview(map_private(fd, size)).cast("B")
    main_length, count = _RESULT_HEADER.unpack_from(view)
    pairs = struct.unpack_from(f"<{2 * count}Q", view, _RESULT_HEADER.size)
    start = _data_start(count)
    buffers = [view[pairs[2 * i] : pairs[2 * i] + pairs[2 * i + 1]] for i in range(count)]
    if raw:
        return bytes(view[start : start + main_length]), buffers
    return pickle.loads(view[start : start + main_length], buffers=buffers)


def dump_inline(obj: Any) -> bytes:
    """The result pickled with its tensor data in band: where no memfd exists, and an exported
    run's results file."""
    stream = io.BytesIO()
    ResultPickler(stream).dump(obj)
    return stream.getvalue()
