"""A DDP wrapper whose module a plain cell changed under it (``model[2] = nn.Linear(...)``, then
pushed to the ranks). The wrapper's reducer, and an optimizer built over its parameters, still
hold the replaced parameters: a step does not train the new ones, and the next fails in torch's
reducer ("Expected to have finished reduction in the prior iteration", 900 characters, on every
rank). DDP cannot take new parameters; the user builds the wrapper and its optimizer again.

So after a push each rank guards such a wrapper: its next forward raises ``StaleWrapperError``
naming the wrapper, the module and what to build again, on every rank alike (before any
collective), and the notebook shows it once (``sessions._raise_failure``).
"""

from __future__ import annotations

import weakref
from typing import Any

from enot_nb._session.worker.repair import _attributes, _ddp_type, _name_of
from enot_nb.errors import StaleWrapperError

_GUARDED: weakref.WeakSet[Any] = weakref.WeakSet()


def guard_stale(namespace: dict[str, Any]) -> list[str]:
    """Guard each DDP wrapper the namespace holds (in a variable or an attribute of one) whose
    module's parameters are no longer those it was built with; the names of those newly guarded."""
    ddp_type = _ddp_type()
    if ddp_type is None:
        return []
    guarded = []
    for _, value in sorted(namespace.items(), key=lambda item: item[0]):
        for held in (value, *[v for _, v in _attributes(value)]):
            if isinstance(held, ddp_type) and held not in _GUARDED:
                changed = _changed_parameters(held)
                if changed:
                    name = _name_of(held, namespace)
                    message = _message(name, _name_of(held.module, namespace), changed)
                    held.register_forward_pre_hook(_refuse(message), prepend=True)
                    _GUARDED.add(held)
                    guarded.append(name)
    return guarded


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
