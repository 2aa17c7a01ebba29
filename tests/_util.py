"""Helpers for tests that start real processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

HELPERS = Path(__file__).parent / "helpers"
METHODS = ["fork", "spawn"]  # the start methods every behaviour must hold under


def _torch_has_public_fsdp2() -> bool:
    # By version, not by importing torch.distributed.fsdp: forked workers would inherit it, and an
    # imported FSDP makes every rank ask whether a module is sharded.
    import torch

    return torch.__version__ >= "2.6"


needs_fsdp2 = pytest.mark.skipif(
    not _torch_has_public_fsdp2(),
    reason="FSDP2 (torch.distributed.fsdp.fully_shard, FSDPModule) is public from torch 2.6, which enot_nb's "
    "support for sharded modules needs; this torch is older",
)
"""For the tests of FSDP2 modules: run on every torch from 2.6 (the compatibility job runs older ones)."""


def press_before_line(k: int | None, in_scope, where: list[str] | None = None):
    """A tracer for this thread that raises KeyboardInterrupt, as a stop press does, before the
    k-th line it sees in code objects ``in_scope(code)`` accepts; returns (lines seen, tracer).
    Not where a real press is never delivered: where presses are held (interrupts_deferred), and
    on a bare ``try:`` (a no-op instruction: the interpreter looks for presses at calls and
    loops). ``where`` gets "file:line" of the press."""
    import linecache
    import signal

    seen = [0]

    def local(frame, event, arg):
        if event == "line" and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() != "try:":
            seen[0] += 1
            if seen[0] == k and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                if where is not None:
                    where.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if in_scope(frame.f_code) else None

    return seen, tracer


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_state(pid: int) -> str | None:
    """The one-letter state of a process ("R", "S", "Z", ...) from /proc; None if it is gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def parent_of(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def descendants(pid: int | None = None) -> list[int]:
    """Pids of every living (not zombie) descendant of ``pid`` (this process by default), from /proc."""
    pid = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(int(entry))
        if fields is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> list[str]:
    """The command line of ``pid`` (empty once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [arg.decode(errors="replace") for arg in f.read().split(b"\0") if arg]
    except OSError:
        return []


def is_fork_server_of(pid: int, owners: set[int]) -> bool:
    """The fork server and the watchdog are by-design helpers that live as long as their owner
    (tested apart)."""
    args = " ".join(cmdline(pid))
    helper = "enot_nb._worker.forkserver" in args or "enot_nb/_processes/watchdog.py" in args
    return helper and parent_of(pid) in owners


def alive(pid: int) -> bool:
    """Running (a zombie is dead, only not yet reaped)."""
    return process_state(pid) not in (None, "Z")


LEAK_GRACE = 60.0
"""Seconds a process gets to end before it counts as left behind: a leak detector's grace, not a
speed bound (a stop's own waits take a few seconds; a loaded machine must not fail the check)."""


def ended_within(listed: Callable[[], list[int]], grace: float) -> list[int]:
    """The pids ``listed()`` still gives after waiting, on each one's pidfd (an event, no
    polling), for them to end, ``grace`` seconds at most: what is left behind."""
    import select
    import time

    deadline = time.monotonic() + grace
    while True:
        left = listed()
        if not left or time.monotonic() > deadline:
            return left
        try:
            fd = os.pidfd_open(left[0])
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)


def wait_gone(pids: list[int], reaped: bool = False) -> float:
    """Seconds until every pid has ended, waited for on each one's pidfd (readable once the
    process has ended): the test's own timeout bounds the wait, no clock here (a loaded machine
    only makes it slower). ``reaped``: until no zombie of them is left either (no event tells
    that: its state is read every 10 ms)."""
    import select
    import time

    start = time.monotonic()
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            continue  # gone already
    try:
        for fd in fds:
            select.select([fd], [], [])
    finally:
        for fd in fds:
            os.close(fd)
    while reaped and any(process_state(p) is not None for p in pids):
        time.sleep(0.01)
    return time.monotonic() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for every process; on timeout kill them all. Returns their combined outputs."""
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outputs


def read_ranks(out_dir: Path, world_size: int) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def record_figure(key: str, value: object) -> None:
    """Append a measured figure to $ENOT_NB_RELIABILITY_FIGURES (for RELIABILITY.md), if set."""
    path = os.environ.get("ENOT_NB_RELIABILITY_FIGURES")
    if not path:
        return
    figures = json.loads(Path(path).read_text()) if os.path.exists(path) else {}
    figures.setdefault(key, []).append(value)
    Path(path).write_text(json.dumps(figures, indent=1))
