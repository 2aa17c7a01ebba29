"""A DDP wrapper whose module a plain cell changed under it (``model[2] = nn.Linear(...)``, then
pushed to the ranks). The wrapper's reducer, and an optimizer built over its parameters, still
hold the replaced parameters: a step does not train the new ones, and the next fails in torch's
reducer ("Expected to have finished reduction in the prior iteration", 900 characters, on every
rank). DDP cannot take new parameters; the user builds the wrapper and its optimizer again.

So after a push each rank guards such a wrapper: its next forward raises ``StaleWrapperError``
naming the wrapper, the module and what to build again, on every rank alike (before any
collective), and the notebook shows it once (``_raise_failure`` in _session/kernel/session.py).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterator
from typing import Any

from enot_nb._worker.held import DDP, imported_classes
from enot_nb.errors import StaleWrapperError

_GUARDED: weakref.WeakSet[Any] = weakref.WeakSet()


def guard_stale(namespace: dict[str, Any]) -> list[str]:
    """Guard each DDP wrapper the namespace holds (in a variable or an attribute of one) whose
    module's parameters are no longer those it was built with; the names of those newly guarded."""
    ddp_type = imported_classes(DDP)
    if not ddp_type:
        return []
    guarded = []
    for name, value in _held(namespace):
        if not isinstance(value, ddp_type) or value in _GUARDED:
            continue
        wrapper: Any = value  # (a tuple of types narrows to object)
        changed = _changed_parameters(wrapper)
        if changed:
            module = next((n for n, v in _held(namespace) if v is wrapper.module), "its module")
            wrapper.register_forward_pre_hook(_refuse(_message(name, module, changed)), prepend=True)
            _GUARDED.add(wrapper)
            guarded.append(name)
    return guarded


def _held(namespace: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The variables, then each one's own attributes (``trainer.ddp``), by name: where a user keeps
    a wrapper. Not deeper: this runs after every push, and a walk of all the rank holds would cost
    what the push saves (a repair walks it: see held.reach)."""
    variables = sorted((n, v) for n, v in namespace.items() if not n.startswith("_"))
    yield from variables
    for name, value in variables:
        if isinstance(value, types.ModuleType | type | types.FunctionType):
            continue
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            for attribute, held in sorted(attributes.items()):
                yield f"{name}.{attribute}", held


def _changed_parameters(wrapper: Any) -> list[str]:
    """The module's parameters (by name) that the wrapper was not built with, or, where some were
    removed, every parameter's name that is left ("" where none is)."""
    built = {id(p) for p in wrapper._module_parameters}
    now = [(n, p) for n, p in wrapper.module.named_parameters() if n not in wrapper.parameters_to_ignore]
    new = [n for n, p in now if id(p) not in built]
    if new or len(now) == len(built):
        return new
    return [n for n, _ in now] or [""]


def _message(wrapper: str, module: str, changed: list[str]) -> str:
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    what = f"its parameters {shown}" if shown else "its parameters"
    return (
        f"{wrapper} wraps {module}, and {what} were replaced since {wrapper} was built (a plain cell "
        f"assigned a new layer or parameter): {wrapper}, and any optimizer built over its parameters, still "
        f"hold the old ones. Build both again in a session cell, e.g. `{wrapper} = DDP({module})` and "
        f"`opt = torch.optim.SGD({wrapper}.parameters(), lr=...)`"
    )


def _refuse(message: str) -> Any:
    def refuse(module: Any, args: Any) -> None:
        raise StaleWrapperError(message)

    return refuse
