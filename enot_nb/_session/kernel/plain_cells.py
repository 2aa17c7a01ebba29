"""The plain cells a notebook ran since a session's last sync: what they can reach is all that can
have changed of the record of what the ranks hold, so the push before the next task compares
only that (see Mirror.compare), and a session cell after plain cells that touched nothing of a
large state costs nothing for it.

IPython's ``pre_run_cell`` event names every cell it runs, stored in its history or not. What a
cell can reach is found as for a distributed cell (reach.reach: its names, and the globals of
the notebook functions it calls, to any depth), with the same fallback: a cell that reads the
namespace by name (``globals()``, ``eval``, a line magic) makes the next push compare it all.
Outside IPython (a ``Session`` over a dict of its own) everything is compared, as before.

A change is never lost because no cell was seen making it. Code can run outside a tracked cell:
a frontend's ``silent=True`` request (IPython fires ``pre_execute`` for it, not
``pre_run_cell``), a comm message handled (a widget's callback), a thread of the user's. Where
any of them ran since the last sync, everything is compared (``Outside``). A name a plain cell
deleted or rebound still counts: its old value is walked too (kept until the next sync).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from enot_nb._state import reach
from enot_nb._state.registry import Registry, is_user_name

_SESSION_CELL = re.compile(r"\s*%%enot_distributed\b(?![^\n]*--fresh)")
"""A session cell; a one-off ``--fresh`` one changes the notebook as a plain cell does."""

_OUTPUT_NAME = re.compile(r"^(_|__|___|_\d+|_oh|Out)$")
"""IPython's names for earlier outputs: hidden from reach, yet a cell writes through them."""

KERNEL_THREADS = ("ipykernel.", "IPython.", "jupyter_client.", "zmq.", "tornado.", "comm.", "enot_nb.", "tqdm.")
"""Modules whose threads never change the user's objects: the kernel's own (its IOPub, control,
heartbeat, history threads), enot_nb's, tqdm's monitor. Any other thread is the user's."""
_GONE = object()


@dataclass
class Outside:
    """A sample of what runs outside tracked cells: the CPU time of each user thread, the comm
    messages handled and the silent runs so far. Two samples tell whether any ran between."""

    threads: dict[int, tuple[str, int]] = field(default_factory=dict)
    comms: int = 0
    silent: int = 0
    started: int = 0
    """User threads started so far (one may start and end between two samples)."""

    @classmethod
    def now(cls, comms: int, silent: int) -> Outside:
        threads = {}
        for thread in threading.enumerate():
            if thread is threading.main_thread() or thread.ident is None or not _users(thread):
                continue
            try:
                cpu = time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
            except (OSError, AttributeError):  # gone meanwhile, or no per-thread clock here
                cpu = -1
            threads[thread.ident] = (thread.name, cpu)
        return cls(threads, comms, silent, THREAD_STARTS.count)

    def ran_since(self, before: Outside) -> str | None:
        """What ran outside the cells since ``before``, in words; None where nothing did."""
        if self.silent != before.silent:
            return "a frontend ran code silently"
        if self.comms != before.comms:
            return "a comm message (a widget) was handled"
        if self.started != before.started:
            return "a thread started"
        for ident, (name, cpu) in self.threads.items():
            if cpu < 0 or before.threads.get(ident, ("", -2))[1] != cpu:
                return f"thread {name!r} ran"
        ended = [name for ident, (name, _) in before.threads.items() if ident not in self.threads]
        return f"thread {ended[0]!r} ran to its end" if ended else None


class ThreadStarts:
    """Counts the user threads started while installed, by ``threading.setprofile``: each new
    thread calls the hook once, which counts it and hands the thread the hook found before."""

    def __init__(self) -> None:
        self.count = 0
        self.users = 0
        self.previous: Any = None

    def install(self) -> None:
        self.users += 1
        current = getattr(threading, "_profile_hook", None)
        if current != self._hook:  # never chained to itself (a bound method: compared by ==)
            self.previous = current
            threading.setprofile(self._hook)

    def uninstall(self) -> None:
        self.users = max(0, self.users - 1)
        if self.users == 0 and getattr(threading, "_profile_hook", None) == self._hook:
            threading.setprofile(self.previous)
            self.previous = None

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        previous = self.previous
        sys.setprofile(previous)  # once per thread: it goes on as it would have
        if _users(threading.current_thread()):
            self.count += 1
        if previous is not None:
            previous(frame, event, arg)


THREAD_STARTS = ThreadStarts()


def _users(thread: threading.Thread) -> bool:
    """Whether ``thread`` runs the user's code (see KERNEL_THREADS)."""
    target = getattr(thread, "_target", None)
    where = getattr(target, "__module__", None) or type(thread).__module__ or ""
    return not where.startswith(KERNEL_THREADS)


@dataclass
class RanCell:
    """A cell run since the last sync."""

    code: str
    ended: int | None = None
    """The last sync as of its end (None while it runs): one that ended before the last sync is
    in the record; one that called a session task goes on after that task's sync, and counts."""
    gone: dict[str, Any] = field(default_factory=dict)
    """The old values of the names it deleted or rebound."""
    names: reach.CodeNames | None = None
    """The names it uses, read once, when it ends (None: while it runs, or if it cannot be
    read: then everything is compared)."""


class PlainCells:
    """The cells run since the last sync (see the module's docstring)."""

    def __init__(self, shell: Any, synced_at: Callable[[], int]) -> None:
        self.shell, self.synced_at = shell, synced_at
        self.ran: list[RanCell] = []
        self._before: dict[str, Any] = {}
        self._in_cell = True  # made in a cell (its post_execute is not a silent run's)
        self.silent_runs = self.comms = 0
        THREAD_STARTS.install()
        self._sample = Outside.now(self.comms, self.silent_runs)
        self._outside: tuple[int, str | None] = (synced_at(), None)
        """The sync the verdict is for, and what ran outside the cells since it (see outside)."""
        shell.events.register("pre_execute", self._pre_execute)
        shell.events.register("pre_run_cell", self._pre_run)
        shell.events.register("post_run_cell", self._post_run)
        shell.events.register("post_execute", self._post_execute)
        self._handlers = _wrap_comm_handlers(shell, self._comm_handled)

    @classmethod
    def of(cls, namespace: dict[str, Any], synced_at: Callable[[], int]) -> PlainCells | None:
        """The notebook's cells, where ``namespace`` is the notebook's own; else None."""
        try:
            from IPython import get_ipython
        except ImportError:
            return None
        shell = get_ipython()
        if shell is None or getattr(shell, "user_ns", None) is not namespace:
            return None
        return cls(shell, synced_at)

    def _pre_execute(self) -> None:
        self._in_cell = False

    def _pre_run(self, info: Any) -> None:
        self._in_cell = True
        self.ran = self._since()
        self._before = dict(self.shell.user_ns)
        self.ran.append(RanCell(getattr(info, "raw_cell", None) or ""))

    def _post_run(self, result: Any) -> None:
        ns, before, self._before = self.shell.user_ns, self._before, {}
        for cell in reversed(self.ran):
            if cell.ended is None:
                cell.ended = self.synced_at()
                cell.gone.update((n, v) for n, v in before.items() if ns.get(n, _GONE) is not v and is_user_name(n))
                cell.names = self._names(cell.code)
                return

    def _names(self, code: str) -> reach.CodeNames | None:
        """The names a cell uses (a session cell's: none here, what it changed is in the record),
        or None where it cannot be read."""
        if _SESSION_CELL.match(code):
            return reach.CodeNames(frozenset())
        try:
            return reach.cell_names(self.shell.transform_cell(code))
        except Exception:  # noqa: BLE001 - a cell we cannot read: everything is compared
            return None

    def _post_execute(self) -> None:
        if not self._in_cell:  # no pre_run_cell: a silent run
            self.silent_runs += 1
        self._in_cell = False

    def _comm_handled(self) -> None:
        self.comms += 1

    def _since(self) -> list[RanCell]:
        now = self.synced_at()
        return [cell for cell in self.ran if cell.ended is None or cell.ended == now]

    def outside(self) -> str | None:
        """What ran outside the tracked cells since the last sync, in words, or None. Compared
        with the sample taken at the last call (at or before the last sync: conservative); a
        verdict holds until the next sync."""
        now = Outside.now(self.comms, self.silent_runs)
        why = now.ran_since(self._sample)
        self._sample = now
        synced, before = self._outside
        self._outside = (self.synced_at(), (before or why) if synced == self.synced_at() else why)
        return self._outside[1]

    def reached(self, namespace: dict[str, Any], hidden: Any) -> Registry | None:
        """A walk of all that the plain cells run since the last sync can reach; None where one
        may reach any name (then everything is compared). Session cells are left out: what
        they changed is in the record."""
        if self.outside() is not None:
            return None
        used: set[str] = set()
        gone: dict[str, Any] = {}
        for cell in self._since():
            names = cell.names if cell.ended is not None else self._names(cell.code)  # (one running)
            if names is None or names.dynamic:
                return None
            used |= names.names
            gone.update(cell.gone)
        found = reach.reach(namespace, "", hidden, found=reach.CodeNames(frozenset(used)))
        if found.whole:
            return None
        registry = found.registry
        registry.extend(sorted(n for n in used if _OUTPUT_NAME.match(n) and n in namespace), namespace)
        registry.grow([(value, 0, f"<{name} before a plain cell>") for name, value in sorted(gone.items())])
        return registry

    def close(self) -> None:
        events = [
            ("pre_execute", self._pre_execute),
            ("pre_run_cell", self._pre_run),
            ("post_run_cell", self._post_run),
            ("post_execute", self._post_execute),
        ]
        for event, callback in events:
            try:
                self.shell.events.unregister(event, callback)
            except ValueError:
                pass
        THREAD_STARTS.uninstall()
        handlers = getattr(getattr(self.shell, "kernel", None), "shell_handlers", {})
        for msg_type, handler in self._handlers.items():
            handlers[msg_type] = handler


def _wrap_comm_handlers(shell: Any, handled: Callable[[], None]) -> dict[str, Any]:
    """Count each comm message the kernel handles (a widget's callback runs in it); the handlers
    wrapped, to put back on close. None in a terminal IPython."""
    handlers = getattr(getattr(shell, "kernel", None), "shell_handlers", None)
    if not isinstance(handlers, dict):
        return {}
    wrapped = {t: handlers[t] for t in ("comm_open", "comm_msg", "comm_close") if t in handlers}

    def counting(handler: Any) -> Any:
        def handle(*args: Any, **kwargs: Any) -> Any:
            handled()
            return handler(*args, **kwargs)

        return handle

    for msg_type, handler in wrapped.items():
        handlers[msg_type] = counting(handler)
    return wrapped
