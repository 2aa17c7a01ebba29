"""Which collectives a rank issued last, and which it waits in: read from torch's flight recorder
(``TORCH_FR_BUFFER_SIZE``, set for every rank before its group is made) by the helper thread
that dumps the rank's stack (see stacks), while the main thread waits in gloo or NCCL.

The recorder keeps each collective's op, group, sequence number, shapes and dtypes; an entry
not retired is one the rank still waits in, issued where the rank's main thread waits (the
recorder's own frames are not read: see _recorded). Where torch
has no recorder (or it was turned off), each group's sequence number stands in: the table then
says how far each rank got, not in what. The snapshot travels to the kernel as one line after
the stack (``MARKER`` and JSON), where _launch/collective_table compares the ranks.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import sysconfig
import threading
from typing import Any, NamedTuple

MARKER = "enot_nb-collectives "
"""Starts the snapshot's line in a rank's stack dump."""

RECORDED = int(os.environ.get("ENOT_NB_COLLECTIVES_KEPT", "2000"))
"""How many collectives torch's flight recorder keeps per rank (its ``TORCH_FR_BUFFER_SIZE``,
unless the user set that); 0 turns it off (the table then has sequence numbers only)."""

_DTYPES = {
    "Float": "float32",
    "Double": "float64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Long": "int64",
    "Int": "int32",
    "Short": "int16",
    "Char": "int8",
    "Byte": "uint8",
    "Bool": "bool",
}
_LIBRARIES = (os.sep + "torch" + os.sep, os.sep + "enot_nb" + os.sep, os.sep + "site-packages" + os.sep)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


def _users(filename: str) -> bool:
    """Whether a frame's file is the user's: a cell, a script, a module of theirs (not torch's,
    enot_nb's, an installed package's or the standard library's)."""
    return not filename.startswith((_STDLIB, "<frozen")) and not any(part in filename for part in _LIBRARIES)


class Collective(NamedTuple):
    """One collective a rank issued."""

    op: str
    """``all_reduce``, ``broadcast``...; ``?`` where only the sequence number is known."""
    group: str
    """``WORLD``, or the group's name."""
    seq: int
    tensors: str
    """Its inputs' dtypes and shapes (``float32[1024]``), empty where unknown."""
    waiting: bool
    """The rank has not seen it complete."""
    line: tuple[str, int] | None
    """The user's frame that issued it (file, line), innermost first; None where unknown."""

    def named(self) -> str:
        shapes = f", {self.tensors}" if self.tensors else ""
        return f"{self.op} #{self.seq} on {self.group}{shapes}"


class Snapshot(NamedTuple):
    """What a rank reports: its last collective on each group, those it waits in, and where its
    main thread is."""

    recorded: bool
    """From the flight recorder (ops, shapes, lines); False: the groups' sequence numbers only."""
    collectives: list[Collective]
    at: tuple[str, int] | None
    """The main thread's innermost frame of the user's (a cell's, or a script's)."""


def record() -> None:
    """Ask torch to keep this rank's collectives, or none (before its process group is made);
    a value the user set is theirs."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(max(RECORDED, 0)))


def snapshot() -> Snapshot | None:
    """This rank's snapshot (from any thread); None outside a process group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    entries = _recorded()
    collectives = _from_recorder(entries) if entries is not None else _from_sequence_numbers(dist)
    at = _main_thread_at()
    # A collective the rank waits in was issued where its main thread waits.
    return Snapshot(entries is not None, [c._replace(line=at) if c.waiting else c for c in collectives], at)


def forget_so_far() -> None:
    """The world group was made again in this process: the recorder's entries so far are the
    old groups' (whose numbers the new ones start again from), left out from now on."""
    global _FORGOTTEN
    _FORGOTTEN = max((int(e.get("record_id", -1)) for e in _recorded() or []), default=_FORGOTTEN)


_FORGOTTEN = -1
"""The last record id of the groups made before the current world group (see forget_so_far)."""


def timed_out(exc: BaseException) -> Snapshot | None:
    """Where a rank whose collective timed out stood: its last collective (the recorder retires
    it on the error) marked as the one it waited in, issued at the user's frame the error
    passed through; None for any other error."""
    text = str(exc)
    if "imed out" not in text and "timeout" not in text.lower():
        return None
    frames = _traceback_files(exc)
    if not any(os.sep + "distributed" + os.sep in f and os.sep + "torch" + os.sep in f for f, _ in frames):
        return None
    taken = snapshot()
    if taken is None or not taken.collectives:
        return taken
    line = next((frame for frame in reversed(frames) if _users(frame[0])), None)
    latest = taken.collectives[-1]  # the recorder's order: the last one issued
    marked = [c._replace(waiting=True, line=line) if c is latest else c for c in taken.collectives]
    return Snapshot(taken.recorded, marked, line)


def _traceback_files(exc: BaseException) -> list[tuple[str, int]]:
    """The (file, line) of each frame the error passed through, outermost first."""
    found = []
    tb = exc.__traceback__
    while tb is not None:
        found.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return found


def encoded(taken: Snapshot | None) -> str:
    """The snapshot's line (empty for none)."""
    return "" if taken is None else MARKER + json.dumps(taken) + "\n"


def decoded(text: str) -> tuple[str, Snapshot | None]:
    """A rank's dump split: its text without the snapshot's line, and the snapshot (None where
    the dump had none, or one that does not read)."""
    kept, found = [], None
    for line in text.splitlines(keepends=True):
        if line.startswith(MARKER):
            try:
                recorded, collectives, at = json.loads(line[len(MARKER) :])
                found = Snapshot(
                    recorded,
                    [
                        Collective(op, g, seq, t, w, (str(ln[0]), int(ln[1])) if ln else None)
                        for op, g, seq, t, w, ln in collectives
                    ],
                    (str(at[0]), int(at[1])) if at else None,
                )
            except (ValueError, TypeError):
                found = None
        else:
            kept.append(line)
    return "".join(kept), found


def _frame(found: Any) -> tuple[str, int] | None:
    return (str(found[0]), int(found[1])) if found else None


def _recorded() -> list[dict[str, Any]] | None:
    """The flight recorder's entries, oldest first; None where torch has no recorder for this
    backend, or it was told to keep none."""
    if os.environ.get("TORCH_FR_BUFFER_SIZE", "").strip() == "0":
        return None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace  # type: ignore[attr-defined]

        # Without the stack traces: symbolizing them waits on a collective in flight (gloo),
        # holding the GIL, and the rank never gets back. The waiting one's line is the main
        # thread's (see snapshot).
        dumped = pickle.loads(_dump_fr_trace(True, False, False))
    except Exception:  # noqa: BLE001 - an older torch, a backend without one: sequence numbers instead
        return None
    return list(dumped.get("entries") or [])


def _from_recorder(entries: list[dict[str, Any]]) -> list[Collective]:
    """Each group's last collective and every one still waited in, oldest first (those of
    groups made before the current world group left out: see forget_so_far)."""
    made = [_collective(e) for e in entries if int(e.get("record_id", 0)) > _FORGOTTEN]
    last: dict[str, Collective] = {}
    for c in made:
        if c.group not in last or c.seq >= last[c.group].seq:
            last[c.group] = c
    kept = {id(c) for c in last.values()}
    return [c for c in made if c.waiting or id(c) in kept]


def _collective(entry: dict[str, Any]) -> Collective:
    name, desc = (list(entry.get("process_group") or ("?", "?")) + ["?"])[:2]
    group = "WORLD" if desc == "default_pg" else (desc if desc not in ("undefined", "?", "") else f"group {name}")
    op = str(entry.get("profiling_name") or "?").split(":")[-1]
    p2p = bool(entry.get("is_p2p"))
    seq = int(entry.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
    tensors = ", ".join(
        f"{_DTYPES.get(str(dtype), str(dtype).lower())}[{', '.join(map(str, size))}]"
        for size, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or [])
    )
    waiting = not entry.get("retired", False) and entry.get("state") != "completed"
    return Collective(op, group, seq, tensors, waiting, None)


def _from_sequence_numbers(dist: Any) -> list[Collective]:
    """Without a recorder: each group's sequence number (how many collectives it ran)."""
    world = dist.distributed_c10d._world
    found = []
    for group in list(world.pg_map):
        try:
            seq = int(group._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001 - a backend that does not count
            continue
        name = world.pg_names.get(group, "?")
        named = "WORLD" if group is dist.distributed_c10d._get_default_group() else f"group {name}"
        found.append(Collective("?", named, seq, "", False, None))
    return found


def _main_thread_at() -> tuple[str, int] | None:
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        filename = frame.f_code.co_filename
        if _users(filename):
            return filename, frame.f_lineno
        frame = frame.f_back
    return None
