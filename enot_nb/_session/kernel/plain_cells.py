"""The plain cells a notebook ran since a session's last sync: what they can reach is all that can
have changed of the record of what the ranks hold, so the push before the next task compares
only that (see Mirror.compare), and a session cell after plain cells that touched nothing of a
large state costs nothing for it.

IPython's ``pre_run_cell`` event names every cell it runs, stored in its history or not. What a
cell can reach is found as for a distributed cell (reach.reach: its names, and the globals of
the notebook functions it calls, to any depth), with the same fallback: a cell that reads the
namespace by name (``globals()``, ``eval``, a line magic) makes the next push compare it all.
Outside IPython (a ``Session`` over a dict of its own) everything is compared, as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from enot_nb._state import reach
from enot_nb._state.registry import Registry

_SESSION_CELL = re.compile(r"\s*%%enot_distributed\b(?![^\n]*--fresh)")
"""A session cell; a one-off ``--fresh`` one changes the notebook as a plain cell does."""


class PlainCells:
    """The cells run since the last sync (see the module's docstring)."""

    def __init__(self, shell: Any, synced_at: Callable[[], int]) -> None:
        self.shell, self.synced_at = shell, synced_at
        self.ran: list[tuple[str, list[int | None]]] = []
        """Each cell's source, and the last sync as of its end (None while it runs): one that
        ended before the last sync is in the record; one that called a session task goes on
        after that task's sync, and counts."""
        shell.events.register("pre_run_cell", self._pre_run)
        shell.events.register("post_run_cell", self._post_run)

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

    def _pre_run(self, info: Any) -> None:
        self.ran = self._since()
        self.ran.append((getattr(info, "raw_cell", None) or "", [None]))

    def _post_run(self, result: Any) -> None:
        for _, end in reversed(self.ran):
            if end[0] is None:
                end[0] = self.synced_at()
                return

    def _since(self) -> list[tuple[str, list[int | None]]]:
        now = self.synced_at()
        return [(code, end) for code, end in self.ran if end[0] is None or end[0] == now]

    def reached(self, namespace: dict[str, Any], hidden: Any) -> Registry | None:
        """A walk of all that the plain cells run since the last sync can reach; None where one
        may reach any name (then everything is compared). Session cells are left out: what
        they changed is in the record."""
        names: set[str] = set()
        for code, _ in self._since():
            if _SESSION_CELL.match(code):
                continue
            try:
                found = reach.reach(namespace, self.shell.transform_cell(code), hidden)
            except Exception:  # noqa: BLE001 - a cell we cannot read: everything is compared
                return None
            if found.whole:
                return None
            names.update(found.names)
        return Registry.of_namespace(namespace, sorted(n for n in names if n in namespace))

    def close(self) -> None:
        for event, callback in (("pre_run_cell", self._pre_run), ("post_run_cell", self._post_run)):
            try:
                self.shell.events.unregister(event, callback)
            except ValueError:
                pass
