"""Running a notebook cell inside a worker, and bringing its state back.

In the worker (every rank)::

    rich output -> a publisher that sends display data over the launcher's message pipe
    sync_model(broadcast) on the modules the cell uses -> exec(cell) -> last expression's value
    figures left open -> PNG display data (master only)
    master: pickle (one pickle, tensors on the CPU) the names the cell bound and the objects it
            changed in place -> returned as the launch's result

In the notebook, :func:`apply_state` puts the values back, updating existing models, optimizers,
tensors and containers in place so that other references to them stay valid.
"""

from __future__ import annotations

import ast
import builtins
import io
import linecache
import sys
import types
import zlib
from dataclasses import dataclass, field
from typing import Any

from enot_nb import _pickling, _worker

CELL_FILENAME = "<enot_distributed cell>"
_HIDDEN_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "open"}


@dataclass
class CellOptions:
    """What the magic asked for, as the worker needs it."""

    sync: list[str] | None = None
    """Modules to sync before the cell; None means every module the cell uses."""
    no_sync: bool = False
    returns: list[str] | None = None
    """Names to bring back; None means everything the cell bound or changed."""
    no_return: bool = False
    first_line: int = 2
    """Line number of the cell's first line in the notebook (after the %%magic line)."""
    source_header: str = ""
    shown: bool = True
    figure_dir: str | None = None
    """Outside a launch (an exported script): save images here instead of sending them."""
    figure_prefix: str = "cell"


@dataclass
class CellOutcome:
    """The master's result of a cell, pickled back to the notebook."""

    state: dict[str, Any]
    """{"bound": {...}, "updated": {...}, "value": ...}, pickled with the outcome: one pickle."""
    not_returned: dict[str, str] = field(default_factory=dict)
    """Names that could not come back, with the reason."""
    value_bundle: tuple[dict, dict] | None = None
    """The last expression's display data, if it cannot come back as an object."""
    value_name: str | None = None
    """The last expression was this bare name: show the notebook's (updated) object."""
    has_value: bool = False
    moved_to_cpu: int = 0


# ----------------------------------------------------------------------------- analysis


def split_cell(code: str, first_line: int) -> tuple[ast.Module, ast.Expression | None, bool]:
    """Parse the cell; split off its last expression (shown as Out, as IPython does)."""
    tree = ast.parse(code, CELL_FILENAME)
    ast.increment_lineno(tree, first_line - 1)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    suppressed = code.rstrip().endswith(";")
    return tree, last, suppressed


def names_used(code: str) -> set[str]:
    """Every name the cell reads or writes (a cheap, safe over-approximation)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def shippable_namespace(namespace: dict[str, Any], code: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The variables the cell uses that can be pickled, and those that cannot (with why)."""
    used = {n: namespace[n] for n in names_used(code)
            if n in namespace and not n.startswith("_") and n not in _HIDDEN_NAMES}
    left_out = _pickling.unpicklable(used)
    return {n: v for n, v in used.items() if n not in left_out}, left_out


def fingerprint(value: Any) -> Any:
    """A cheap token that changes when ``value`` is changed in place (None: not tracked)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, torch.Tensor):
            return ("tensor", value._version, value.data_ptr())
        if isinstance(value, torch.nn.Module):
            tensors = list(value.parameters()) + list(value.buffers())
            return ("module", tuple(id(t) for t in tensors), sum(t._version for t in tensors))
        if isinstance(value, torch.optim.Optimizer):
            state = [t for s in value.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            hyper = repr([{k: v for k, v in g.items() if k != "params"} for g in value.param_groups])
            return ("optimizer", len(value.state), sum(t._version for t in state), hyper)
    if isinstance(value, bytearray):
        return ("bytearray", zlib.crc32(value))
    if isinstance(value, (list, dict, set)):  # shallow: appends and rebinds, not nested changes
        items = value.items() if isinstance(value, dict) else value
        return (type(value).__name__, len(value), tuple(map(id, items)))
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return ("ndarray", value.shape, zlib.crc32(numpy.ascontiguousarray(value).view(numpy.uint8)))
    if hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType, types.FunctionType)):
        return ("object", tuple((k, id(v)) for k, v in vars(value).items()))
    return None


# ----------------------------------------------------------------------------- worker side


class _PipePublisher:
    """Stands in for IPython's display publisher in a worker: display data goes to the notebook
    (or, in an exported script, text to stdout and images to files)."""

    def __init__(self, options: CellOptions) -> None:
        self.options = options
        self.is_publishing = False
        self._saved = 0

    def publish(self, data: dict, metadata: dict | None = None, source: Any = None, *,
                transient: dict | None = None, update: bool = False, **_: Any) -> None:
        if not self.options.shown:
            return
        if self.options.figure_dir is None:
            _worker.send(("display", {"data": data, "metadata": metadata or {},
                                      "transient": transient or {}, "update": update}))
        elif "image/png" in data:
            import base64
            import os

            self._saved += 1
            path = os.path.join(self.options.figure_dir,
                                f"{self.options.figure_prefix}.figure-{self._saved}.png")
            with open(path, "wb") as f:
                f.write(base64.b64decode(data["image/png"]))
            print(f"[figure saved to {path}]")
        elif "text/plain" in data:
            print(data["text/plain"])

    def clear_output(self, wait: bool = False) -> None:
        if self.options.shown and self.options.figure_dir is None:
            _worker.send(("clear_output", wait))


def _install_display(options: CellOptions) -> Any:
    """Route display() and figures of this worker to the notebook; returns the shell."""
    from IPython.core.interactiveshell import InteractiveShell

    if InteractiveShell.initialized():
        shell = InteractiveShell.instance()  # the kernel's, inherited by fork: never use its sockets
    else:
        from traitlets.config import Config

        config = Config()
        config.HistoryManager.enabled = False
        shell = InteractiveShell.instance(config=config)
    shell.display_pub = _PipePublisher(options)
    png = shell.display_formatter.formatters["image/png"]
    png.for_type_by_name("matplotlib.figure", "Figure", figure_png)
    builtins.input = _no_input  # ipykernel's input() would ask the kernel's frontend over zmq
    import os

    os.environ["MPLBACKEND"] = "module://enot_nb._mpl_backend"
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].switch_backend("module://enot_nb._mpl_backend")
    return shell


def _no_input(prompt: str = "") -> str:
    raise RuntimeError("input() is not available in a %%enot_distributed cell: read the value in "
                       "an ordinary cell before it and use the variable")


def figure_png(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return buffer.getvalue()


def run_cell(code: str, namespace: dict[str, Any], options: CellOptions) -> CellOutcome | None:
    """Run the cell as this rank; the master returns what goes back to the notebook."""
    from enot_nb import distributed

    rank = distributed.get_rank()
    shell = _install_display(options)
    source = options.source_header + code
    linecache.cache[CELL_FILENAME] = (len(source), None, source.splitlines(True), CELL_FILENAME)
    body, last, suppressed = split_cell(code, options.first_line)
    used = names_used(code)
    namespace.setdefault("get_ipython", lambda: shell)
    shell.user_ns = namespace  # line magics (%who, %run, ...) see the cell's variables
    _sync_models(namespace, used, options)
    before = {name: id(value) for name, value in namespace.items()}
    # Only the master's results go back, so only it pays for fingerprints (a checksum for arrays).
    watched = set() if rank != 0 or options.no_return else set(options.returns or used)
    tracked = {name: fingerprint(namespace[name]) for name in watched if name in namespace}
    figures_before = _open_figures()
    exec(compile(body, CELL_FILENAME, "exec"), namespace)  # noqa: S102 - running the user's cell is the point
    value = eval(compile(last, CELL_FILENAME, "eval"), namespace) if last else None  # noqa: S307
    _show_new_figures(figures_before, rank == 0 and options.shown)
    if rank != 0:
        return None
    return _outcome(namespace, before, tracked, value, last, suppressed, options, shell)


def _sync_models(namespace: dict[str, Any], used: set[str], options: CellOptions) -> None:
    import torch

    from enot_nb.distributed import sync_model

    if options.no_sync:
        return
    names = options.sync if options.sync is not None else sorted(used)
    for name in names:
        if name not in namespace and options.sync is not None:
            raise NameError(f"--sync {name}: no variable {name!r} in the notebook")
        if isinstance(namespace.get(name), torch.nn.Module):
            # Broadcast, not average: every rank starts from the master's exact weights.
            sync_model(namespace[name], reduce_parameters=False, reduce_buffers=False)


def _open_figures() -> set[int]:
    pyplot = sys.modules.get("matplotlib.pyplot")
    return set(pyplot.get_fignums()) if pyplot else set()


def _show_new_figures(before: set[int], show: bool) -> None:
    """Figures the cell left open appear in the notebook, as the inline backend does."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    from enot_nb._mpl_backend import publish_figure

    for number in sorted(set(pyplot.get_fignums()) - before):
        if show:
            publish_figure(pyplot.figure(number))
        pyplot.close(number)


def _outcome(namespace: dict[str, Any], before: dict[str, int], tracked: dict[str, Any],
             value: Any, last: ast.Expression | None, suppressed: bool, options: CellOptions,
             shell: Any) -> CellOutcome:
    outcome = CellOutcome(state={})
    bound, updated = _changes(namespace, before, tracked, options)
    has_value = last is not None and not suppressed and value is not None
    outcome.has_value = has_value
    if has_value and isinstance(last.body, ast.Name) and last.body.id in bound | updated:
        outcome.value_name = last.body.id
    state = {"bound": {n: namespace[n] for n in bound}, "updated": {n: namespace[n] for n in updated}}
    if has_value and outcome.value_name is None:
        state["value"] = value
        outcome.value_bundle = shell.display_formatter.format(value)
    outcome.not_returned, outcome.moved_to_cpu = check_state(state)
    outcome.state = state
    return outcome


def _changes(namespace: dict[str, Any], before: dict[str, int], tracked: dict[str, Any],
             options: CellOptions) -> tuple[set[str], set[str]]:
    if options.no_return:
        return set(), set()
    candidates = [n for n in namespace if not n.startswith("_") and n not in _HIDDEN_NAMES]
    bound = {n for n in candidates if before.get(n) != id(namespace[n])}
    updated = {n for n, token in tracked.items()
               if n in namespace and n not in bound and token is not None
               and fingerprint(namespace[n]) != token}
    if options.returns is not None:
        missing = [n for n in options.returns if n not in namespace]
        if missing:
            raise NameError(f"--return {','.join(missing)}: the cell defined no such variable")
        wanted = set(options.returns)
        return {n for n in wanted if n not in before or before[n] != id(namespace[n])}, \
               {n for n in wanted if n in before and before[n] == id(namespace[n])}
    return bound, updated


# ----------------------------------------------------------------------------- pickling


def check_state(state: dict[str, Any]) -> tuple[dict[str, str], int]:
    """Leave out (and explain) the names that cannot be pickled; count tensors off the CPU.

    A dry run that skips tensor data: the real pickling happens once, with the outcome.
    """
    try:
        return {}, _pickling.dry_run(state)
    except Exception:  # noqa: BLE001 - find the culprits below
        pass
    not_returned: dict[str, str] = {}
    for section in ("bound", "updated"):
        for name, value in list(state[section].items()):
            try:
                _pickling.dry_run(value)
            except Exception as err:  # noqa: BLE001
                not_returned[name] = f"{type(value).__name__} cannot be pickled: {err}"
                del state[section][name]
    if "value" in state:
        try:
            _pickling.dry_run(state["value"])
        except Exception:  # noqa: BLE001 - shown from its display data instead
            del state["value"]
    return not_returned, _pickling.dry_run(state)


# ----------------------------------------------------------------------------- notebook side


def apply_state(namespace: dict[str, Any], state: dict[str, Any]) -> None:
    """Put the master's values into the notebook; existing objects are updated in place."""
    for name, value in state["bound"].items():
        namespace[name] = value
    for name, value in state["updated"].items():
        namespace[name] = update_in_place(namespace.get(name), value)


def update_in_place(old: Any, new: Any) -> Any:
    """Copy ``new`` into ``old`` where its type allows, keeping ``old``'s identity; else ``new``."""
    import torch

    if isinstance(old, torch.nn.Module) and isinstance(new, torch.nn.Module):
        try:
            old.load_state_dict(new.state_dict())
            return old
        except (RuntimeError, KeyError):
            return new  # the structure changed in the cell: the new module replaces it
    if isinstance(old, torch.optim.Optimizer) and isinstance(new, torch.optim.Optimizer):
        try:
            old.load_state_dict(new.state_dict())
            return old
        except (ValueError, KeyError):
            return new
    if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
        if old.shape == new.shape and old.dtype == new.dtype:
            with torch.no_grad():
                old.copy_(new)
            return old
        return new
    if type(old) is type(new) and isinstance(old, list):
        old[:] = new
    elif type(old) is type(new) and isinstance(old, (dict, set)):
        old.clear()
        old.update(new)
    elif type(old) is type(new) and hasattr(old, "__dict__") and not isinstance(old, type):
        vars(old).clear()
        vars(old).update(vars(new))
    else:
        return new
    return old


