"""What a cell can reach: the notebook's names it uses, and everything those reach.

A cell costs what it reaches, not what the notebook holds: the registry (what the master
snapshots and what can come back changed) and, under spawn, what travels to the workers are
walked from the names the cell can use, never from the whole namespace::

    the cell's names (those in the arguments of its line magics too: IPython rewrote them into
    get_ipython().run_line_magic(...) calls)
      -> walk their values (Registry.extend): containers, attributes, the class of an instance
         of a notebook class, a notebook class's methods, properties and bases, closures
      -> each notebook function met adds the global names its code reads (to any depth)
      -> until no new name is met

A cell or a reached function that reads the namespace by name (``globals()``, ``vars()``,
``eval``, ``exec``, ``get_ipython``, ``__main__``, ``sys.modules``) can reach anything: then every
user name is walked, as before. A change made only through a reference that a library holds
(not reachable from what the cell uses) is outside the promise (README, "What comes back").

Under spawn a worker starts empty: the reached names that pickle travel, and the registry's
objects travel with them in the same pickle, so that index i names the worker's copy of the
notebook's object i.
"""

from __future__ import annotations

import ast
import dis
import re
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from enot_nb._serialize import picklers
from enot_nb._state.registry import Registry, is_user_name, user_variables
from enot_nb._state.states import VALUE_TYPES

DYNAMIC_NAMES = frozenset({"globals", "vars", "eval", "exec", "get_ipython", "__main__", "__import__"})
"""Names whose use lets code read any of the namespace's names (with ``sys.modules``)."""
_CELL_DYNAMIC_NAMES = DYNAMIC_NAMES | {"locals"}
"""At the cell's top level ``locals()`` is the namespace too (in a function, its own locals)."""

_CODE_MAGICS = frozenset({"time", "timeit", "prun"})
"""Line magics whose argument is code run in the namespace; any other magic may read any name."""
_SHELL_CALLS = frozenset({"system", "getoutput"})
"""``!cmd`` calls: their ``{name}`` expansions read names of the namespace."""
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class CodeNames:
    """The names a piece of code can read or write."""

    names: frozenset[str]
    dynamic: str | None = None
    """What lets it read the namespace by name (e.g. ``globals``), or None."""


def cell_names(code: str) -> CodeNames:
    """The names a cell (as IPython transformed it) uses: a cheap, safe over-approximation."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return CodeNames(frozenset(), "code that does not parse")
    names: set[str] = set()
    dynamic: str | None = None
    exempt: set[int] = set()  # get_ipython() calls that IPython's own rewriting made
    for node in ast.walk(tree):
        call = _magic_call(node)
        if call is not None:
            exempt.add(id(call.shell))
            found = _magic_names(call.method, call.arguments)
            names |= found.names
            dynamic = dynamic or found.dynamic
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
            if node.id in _CELL_DYNAMIC_NAMES and id(node) not in exempt:
                dynamic = dynamic or f"{node.id}"
        elif _is_sys_modules(node):
            dynamic = dynamic or "sys.modules"
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if "__main__" in modules:
                dynamic = dynamic or "__main__"
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return CodeNames(frozenset(names), dynamic)


def names_used(code: str) -> set[str]:
    """Every name the cell reads or writes."""
    return set(cell_names(code).names)


class _MagicCall(NamedTuple):
    """``get_ipython().METHOD('...', ...)``, as IPython rewrites ``%magic`` and ``!cmd``."""

    method: str
    arguments: list[str]
    shell: ast.Name  # the get_ipython of the call


def _magic_call(node: ast.AST) -> _MagicCall | None:
    """The call, if ``node`` is one such with constant string arguments only."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    shell = node.func.value
    if not (isinstance(shell, ast.Call) and isinstance(shell.func, ast.Name) and shell.func.id == "get_ipython"):
        return None
    arguments = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    if len(arguments) != len(node.args) or node.keywords:
        return None
    return _MagicCall(node.func.attr, arguments, shell.func)


def _magic_names(method: str, arguments: list[str]) -> CodeNames:
    if method == "run_line_magic" and len(arguments) == 2 and arguments[0] in _CODE_MAGICS:
        return _loose_names(arguments[1])
    if method in _SHELL_CALLS:
        return CodeNames(frozenset(_IDENTIFIER.findall(" ".join(arguments))))
    what = f"%{arguments[0]}" if method == "run_line_magic" and arguments else f"get_ipython().{method}"
    return CodeNames(frozenset(), what)


def _loose_names(text: str) -> CodeNames:
    """The names of a magic's argument: its code's, or (options before it) every identifier."""
    found = cell_names(text)
    if found.dynamic == "code that does not parse":
        return CodeNames(frozenset(_IDENTIFIER.findall(text)))
    return found


def _is_sys_modules(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "modules"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME", "STORE_NAME", "DELETE_NAME"})
"""The instructions that read or write a global (``*_NAME``: a class body's, which falls back to the
globals); an attribute's name (``model.eval()``) is in ``co_names`` too, but is no global."""


def global_names(function: Any) -> CodeNames:
    """The global names a function's (or a generator's) code, and the code nested in it, reads
    or writes; dynamic if it loads ``globals``, ``vars``, ``eval``... or ``sys`` and its
    ``modules``."""
    names: set[str] = set()
    attributes: set[str] = set()
    code = getattr(function, "__code__", None) or getattr(function, "gi_code", None)
    todo = [code] if code is not None else []
    while todo:
        code = todo.pop()
        names.update(i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS)
        attributes.update(code.co_names)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    dynamic = sorted(names & DYNAMIC_NAMES) or (["sys.modules"] if "sys" in names and "modules" in attributes else [])
    name = getattr(function, "__qualname__", type(function).__name__)
    return CodeNames(frozenset(names), f"{name} uses {dynamic[0]}" if dynamic else None)


def hidden_names(namespace: dict[str, Any]) -> Any:
    """The names IPython hides in the namespace (its ``user_ns_hidden``), or ()."""
    shell = namespace.get("get_ipython")
    try:
        return shell().user_ns_hidden if callable(shell) else ()
    except Exception:  # noqa: BLE001 - not IPython's
        return ()


Admit = Callable[[dict[str, Any]], dict[str, str]]
"""Which of some variables cannot be taken, with why (spawn: those that do not pickle)."""


@dataclass
class Reach:
    """What a cell reaches in the notebook."""

    registry: Registry
    names: list[str] = field(default_factory=list)
    """The user names walked, in the order they were met."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Reached names that ``admit`` refused, with why."""
    whole: str | None = None
    """Why every user name was walked (code that reads the namespace by name), or None."""
    looked_up: dict[str, Any] = field(default_factory=dict)
    """Each name the walk looked up, and what it found: the user variable's value, or ABSENT
    (no such user variable). The same walk finds the same again while these hold and the
    registry's objects are unchanged (see bound_as_looked_up)."""


ABSENT = object()
"""What a reach found at a name that is no user variable."""


def bound_as_looked_up(found: Reach, namespace: dict[str, Any], hidden: Any = ()) -> bool:
    """Whether every name the walk looked up holds what it found then: the same object, or an
    atom both times (never registered, and it reaches nothing), or no user variable still."""
    for name, then in found.looked_up.items():
        now = namespace.get(name, ABSENT) if is_user_name(name, hidden) else ABSENT
        if now is not then and not (type(now) in VALUE_TYPES and type(then) in VALUE_TYPES):
            return False
    return True


def reach(
    namespace: dict[str, Any], code: str, hidden: Any = (), admit: Admit | None = None, found: CodeNames | None = None
) -> Reach:
    """Walk what ``code`` can reach from ``namespace``: its names, and the global names of the
    notebook functions met, to any depth; every user name where code reads names dynamically.
    ``found``: the names to start from instead of the code's (a function's: global_names)."""
    found = found if found is not None else cell_names(code)
    result = Reach(Registry.of_namespace(namespace, []), whole=found.dynamic)
    todo = set(user_variables(namespace, hidden)) if found.dynamic else set(found.names)
    seen_functions, walked = 0, set[str]()
    while todo:
        for name in todo - walked:
            user = name in namespace and is_user_name(name, hidden)
            result.looked_up[name] = namespace[name] if user else ABSENT
        names = sorted(n for n in todo - walked if result.looked_up[n] is not ABSENT)
        walked |= todo
        todo = set()
        if result.whole is None and any(namespace[n] is namespace for n in names):  # ns = globals()
            result.whole = "a name bound to the namespace itself"
            todo |= set(user_variables(namespace, hidden))
        refused = admit({n: namespace[n] for n in names}) if admit is not None else {}
        result.left_out.update(refused)
        fresh = [n for n in names if n not in refused]
        result.names += fresh
        result.registry.extend(fresh, namespace)
        for function in result.registry.notebook_functions[seen_functions:]:
            if _globals_of(function) is not namespace:  # a library's generator
                continue
            used = global_names(function)
            if used.dynamic and result.whole is None:
                result.whole = used.dynamic
                todo |= set(user_variables(namespace, hidden))
            todo |= used.names
        seen_functions = len(result.registry.notebook_functions)
    return result


def _globals_of(function: Any) -> Any:
    frame = getattr(function, "gi_frame", None)
    return getattr(function, "__globals__", None) or (frame.f_globals if frame is not None else None)


def shippable_namespace(namespace: dict[str, Any], code: str) -> tuple[dict[str, Any], dict[str, str], Registry]:
    """What spawned workers need: the reached variables that can be pickled; those that cannot
    (with why); and the registry of every object they reach."""
    reached = reach(namespace, code, hidden_names(namespace), admit=picklers.unpicklable)
    return {n: namespace[n] for n in reached.names}, reached.left_out, reached.registry


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
