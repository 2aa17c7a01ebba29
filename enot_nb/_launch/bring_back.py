"""A cell's outcome in the notebook: the master's changes applied in place, what could not come
back said once (notes), the cell's value shown as a local cell's Out (shared by one-off cells
and session cells)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from enot_nb._launch.notes import NOTES, Note
from enot_nb._state import apply
from enot_nb._state.collect import Changes
from enot_nb._state.registry import Registry
from enot_nb._worker import cell as _cell


@dataclass
class Bundle:
    """Shows display data computed in a worker as this cell's Out."""

    data: dict
    metadata: dict

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
        return self.data, self.metadata


@dataclass
class BroughtBack:
    """What bring_back did: the changes it applied (None: none came), the value to show."""

    changes: Changes | None
    value: Any = None


def bring_back(
    namespace: dict[str, Any],
    registry: Registry,
    outcome: _cell.CellOutcome,
    options: _cell.CellOptions,
    show_value: bool = True,
) -> BroughtBack:
    """Apply the master's changes to the notebook, in place; say what could not come back."""
    changes = apply.load(outcome.state, registry) if outcome.state is not None else None
    problems = []
    if changes is not None:
        problems = apply.apply_changes(namespace, registry, changes, options.returns)
    for line in problems:  # something the cell changed did not reach the notebook: an error
        print(f"enot_nb: {line}", file=sys.stderr)
    if outcome.replicas is not None:  # --check-replicas
        print(outcome.replicas)
    notes = [Note(name, f"{name!r} was not brought back: {reason}") for name, reason in outcome.not_returned.items()]
    if outcome.detached:
        names = ", ".join(outcome.detached)
        notes.append(
            Note(
                f"detached {names}",
                f"{names}: came back without the autograd graph, which stays in the worker; call "
                "backward() inside the distributed cell",
            )
        )
    if outcome.moved_to_cpu:
        notes.append(
            Note(
                "moved_to_cpu",
                f"{outcome.moved_to_cpu} CUDA tensor(s) came back on the CPU, so this kernel does not "
                "initialize CUDA and later cells still start fast",
            )
        )
    NOTES.show(notes)
    if outcome.unbound_returns:
        print(
            f"enot_nb: --return {','.join(outcome.unbound_returns)}: the cell bound or changed no "
            "such variable; everything else came back",
            file=sys.stderr,
        )
    return BroughtBack(changes, _value(namespace, outcome, changes) if show_value and outcome.has_value else None)


def _value(namespace: dict[str, Any], outcome: _cell.CellOutcome, changes: Changes | None) -> Any:
    """The cell's value, as a local cell's Out."""
    if (
        outcome.value_name is not None
        and outcome.value_name not in outcome.not_returned
        and outcome.value_name not in outcome.detached
    ):  # else shown as the worker had it
        return namespace.get(outcome.value_name)
    if changes is not None and changes.has_value:
        return changes.value
    return Bundle(*outcome.value_bundle) if outcome.value_bundle else None


class CellInterrupted(KeyboardInterrupt):
    """A distributed cell was stopped; shown as a local cell's KeyboardInterrupt (no launcher
    frames: the ranks' own stacks were printed above)."""

    def _render_traceback_(self) -> list[str]:
        return ["KeyboardInterrupt: the cell was stopped on every rank (their stacks are above)"]


CellInterrupted.__name__ = CellInterrupted.__qualname__ = "KeyboardInterrupt"  # as a local cell
