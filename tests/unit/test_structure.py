"""The package's structure: its folders form one stack of layers (a module imports only from its
own layer or the ones below; function-level and TYPE_CHECKING imports count), and no import
cycles. Classes and functions are as long as their one job needs: no size is checked here."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "enot_nb"

LAYERS = [
    # bottom: what every layer may use
    {"enot_nb.errors", "enot_nb._defaults", "enot_nb._log", "enot_nb._version"},
    {"enot_nb._processes"},  # making, watching and ending processes; the worker protocol
    {"enot_nb._serialize"},  # pickling between the notebook and its workers
    {"enot_nb._runtime", "enot_nb.distributed"},  # the functional API and its machinery
    {"enot_nb._memory"},  # which pages of memory were written since a mark (one interface)
    {"enot_nb._state"},  # the object model: what the notebook holds, what a cell changed
    {"enot_nb._worker"},  # what runs in a worker
    {"enot_nb._session.tasks"},  # a session: the records its kernel side and its ranks share
    {"enot_nb._session.mirror"},  # a session: what its ranks hold of the notebook, found by path
    {"enot_nb._session.worker"},  # a session: a rank's loop across cells, its groups' repair
    {"enot_nb._launch"},  # the kernel's side of a launch; where ranks run (RankHost)
    {"enot_nb._session.kernel"},  # a session: the kernel's side (the session, its workers, flow, status)
    {"enot_nb.launcher", "enot_nb.export", "enot_nb.cells", "enot_nb.sessions", "enot_nb.magic", "enot_nb"},  # top
]
"""Low to high. Each module's layer is that of its longest listed prefix (a module's folder)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    """Every module of the package, in every folder (``enot_nb._state.apply`` -> its path)."""
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The enot_nb modules a module imports, wherever the import statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("enot_nb")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("enot_nb"):
            for a in node.names:  # `from enot_nb._state import apply` imports enot_nb._state.apply
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in modules else node.module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: {m for m in _imports(path, modules) if m in modules and m != name} for name, path in modules.items()}


def layer_of(module: str) -> int:
    best, level = -1, None
    for i, members in enumerate(LAYERS):
        for prefix in members:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level is not None, f"{module} is in no layer: add its folder to LAYERS"
    return level


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_walk_sees_every_folder():
    modules = all_modules()
    assert "enot_nb._state.apply" in modules and "enot_nb._processes.interrupts" in modules
    assert {m.split(".")[1] for m in modules if m.count(".") >= 2} == {
        "_launch",
        "_memory",
        "_processes",
        "_runtime",
        "_serialize",
        "_session",
        "_state",
        "_worker",
    }


def test_layer_of_takes_the_longest_prefix():
    assert layer_of("enot_nb._state.apply") == 5
    assert layer_of("enot_nb._session.mirror.paths") == 8 and layer_of("enot_nb._session.kernel.flow") == 11
    assert layer_of("enot_nb.magic") == 12 and layer_of("enot_nb.errors") == 0


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None


def test_the_layers_form_one_stack():
    """Nothing imports from a layer above its own (a worker never imports the launcher's side)."""
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in sorted(import_graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward


def test_the_object_model_knows_nothing_of_sessions():
    """_state/ and _memory/ are what one-off cells and sessions both use: neither imports a
    session module (a session's caches and records live in _session/)."""
    graph = import_graph()
    leaks = [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        if module.startswith(("enot_nb._state", "enot_nb._memory", "enot_nb._worker"))
        for target in sorted(targets)
        if target.startswith("enot_nb._session")
    ]
    assert not leaks


RAY_MODULES = {"enot_nb._launch.ray_ranks", "enot_nb._launch.ray_agent"}
"""The Ray engine's modules: the only ones that import ``ray`` (an optional extra)."""


def _imports_ray(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "ray" or a.name.startswith("ray.") for a in node.names):
            return True
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and (node.module == "ray" or node.module.startswith("ray."))
        ):
            return True
    return False


def test_only_the_ray_engine_imports_ray_and_only_when_asked_for():
    """``ray`` is imported by the Ray engine's modules alone, and they by nobody at module level
    (session.start_workers imports ray_ranks in the function that needs it): ``import enot_nb``
    and a local session work without Ray installed."""
    modules = all_modules()
    assert {name for name, path in modules.items() if _imports_ray(path)} <= RAY_MODULES
    assert RAY_MODULES <= set(modules)
    top_level = [
        f"{name} imports {node.module or node.names[0].name} at module level"
        for name, path in modules.items()
        if name not in RAY_MODULES
        for node in ast.parse(path.read_text()).body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(
            m in RAY_MODULES
            for m in (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            )
        )
    ]
    assert not top_level
