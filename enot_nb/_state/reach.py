"""What a cell reaches: the names it uses, and under spawn, what of the notebook must travel.

A spawned worker starts empty: the variables the cell uses travel, with those that the
notebook's functions it uses read (to any depth), and the registry's objects travel with them in
the same pickle, so that index i names the worker's copy of the notebook's object i.
"""

from __future__ import annotations

import ast
import types
from typing import Any

from enot_nb._serialize import picklers
from enot_nb._state.registry import Registry, is_user_name


def names_used(code: str) -> set[str]:
    """Every name the cell reads or writes (a cheap, safe over-approximation)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def hidden_names(namespace: dict[str, Any]) -> Any:
    """The names IPython hides in the namespace (its ``user_ns_hidden``), or ()."""
    shell = namespace.get("get_ipython")
    try:
        return shell().user_ns_hidden if callable(shell) else ()
    except Exception:  # noqa: BLE001 - not IPython's
        return ()


def global_names(function: types.FunctionType) -> set[str]:
    """The global names a function's code (and the code nested in it) may read."""
    names: set[str] = set()
    todo = [function.__code__]
    while todo:
        code = todo.pop()
        names.update(code.co_names)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


def shippable_namespace(namespace: dict[str, Any], code: str) -> tuple[dict[str, Any], dict[str, str], Registry]:
    """What spawned workers need: the variables the cell uses, and those the notebook's functions
    it uses read (to any depth), that can be pickled; those that cannot (with why); and the
    registry of every object they reach."""
    hidden = hidden_names(namespace)
    registry = Registry.of_namespace(namespace, [])
    values: dict[str, Any] = {}
    left_out: dict[str, str] = {}
    todo, seen_functions = set(names_used(code)), 0
    while todo:
        names = sorted(
            n for n in todo if n in namespace and is_user_name(n, hidden) and n not in values and n not in left_out
        )
        todo = set()
        problems = picklers.unpicklable({n: namespace[n] for n in names})
        left_out.update(problems)
        fresh = [n for n in names if n not in problems]
        values.update({n: namespace[n] for n in fresh})
        registry.extend(fresh, namespace)
        for function in registry.notebook_functions[seen_functions:]:
            todo |= global_names(function)
        seen_functions = len(registry.notebook_functions)
    return values, left_out, registry


def shippable_objects(registry: Registry, namespace: dict[str, Any]) -> list[Any]:
    """The registry's objects as they travel with the shipped variables: index for index, None
    where one cannot be pickled on its own."""
    ship: dict[str, Any] = {"namespace": namespace, "pickler_class": picklers.ShipPickler}
    objects = list(registry.objects)
    try:
        picklers.dry_run(objects, **ship)
    except Exception:  # noqa: BLE001 - e.g. a lock that its owner's __getstate__ leaves out
        for i in range(1, len(objects)):
            if picklers.unpicklable({"": objects[i]}, **ship):
                objects[i] = None
    return objects
