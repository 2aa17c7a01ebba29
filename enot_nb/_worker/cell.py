"""Running a notebook cell inside a worker, and bringing its state back.

In the worker (every rank)::

    rich output and widgets -> the launcher (the front end frontend installed at the start)
    sync_model(broadcast) on the modules the cell uses -> exec(cell) -> last expression's value
    figures left open -> PNG display data (master only)
    master: what the cell changed (see snapshot, collect), pickled once against the registry
            of the notebook's objects -> returned as the launch's result; on an interrupt (or a
            failure with --on-error keep) the same, sent before the exception is reported

In the notebook, collect.apply_changes makes the notebook's objects hold what the master's hold,
in place, so that other references to them stay valid.
"""

from __future__ import annotations
import __future__

import ast
import functools
import linecache
import operator
import sys
import types
from dataclasses import dataclass, field
from typing import Any, cast

from enot_nb._log import unwarned
from enot_nb._processes.protocol import Imported
from enot_nb._state import collect, reach
from enot_nb._state.kinds import held_still, let_go
from enot_nb._state.registry import Registry, user_variables
from enot_nb._state.snapshot import Snapshot, SnapshotKeeper
from enot_nb._worker import bootstrap, frontend, preload, replica_check, sharded
from enot_nb._worker import figures as _figures
from enot_nb._worker.replica_check import ReplicaReport

CELL_FILENAME = "<enot_distributed cell>"


@dataclass
class CellOptions:
    """What the magic asked for, as the worker needs it."""

    sync: list[str] | None = None
    """Modules to sync before the cell; None means every module the cell uses."""
    no_sync: bool = False
    returns: list[str] | None = None
    """Names to bring back; None means everything the cell bound or changed."""
    no_return: bool = False
    names_only: bool = False
    """A session's --no-return cell: the master snapshots what it reaches, as a returning cell
    does, and sends back only the names of what it changed (the notebook marks those stale;
    what the cell only read stays current)."""
    first_line: int = 2
    """Line number of the cell's first line in the notebook (after the %%magic line)."""
    source_header: str = ""
    shown: bool = True
    figure_dir: str | None = None
    """Outside a launch (an exported script): save images here instead of sending them."""
    figure_prefix: str = "cell"
    keep_on_error: bool = False
    """--on-error keep: a failing master sends the state it reached."""
    gather_sharded: bool = True
    """Make sharded modules whole on the master after the cell (in place: right for a one-off
    cell's workers, which end; a session's live FSDP modules must stay sharded)."""
    future_flags: int = 0
    """The ``from __future__`` features the notebook's cells compile with (see notebook_future_flags)."""
    check_replicas: bool = False
    """--check-replicas: after the cell, every rank compares its replicas with the master's."""


@dataclass
class CellOutcome:
    """The master's result of a cell, pickled back to the notebook."""

    state: collect.PickledState | None = None
    """The changes, pickled against the registry of the notebook's objects."""
    not_returned: dict[str, str] = field(default_factory=dict)
    """Names (or paths) that could not come back, with the reason."""
    value_bundle: tuple[dict, dict] | None = None
    """The last expression's display data, if it cannot come back as an object."""
    value_name: str | None = None
    """The last expression was this bare name: show the notebook's (updated) object."""
    has_value: bool = False
    moved_to_cpu: int = 0
    changed_names: list[str] = field(default_factory=list)
    """The names bound by the cell or whose objects it changed (an exported run saves them)."""
    unbound_returns: list[str] = field(default_factory=list)
    """Names given to --return that the cell neither bound nor changed."""
    left_out: list[str] = field(default_factory=list)
    """Names the cell bound or deleted that --return (or --no-return) kept from coming back:
    the master's value differs from the notebook's (in-place changes come back regardless)."""
    detached: list[str] = field(default_factory=list)
    """Names bound to tensors with an autograd graph: they come back without it."""
    on_device: list[str] = field(default_factory=list)
    """A session master's variables that hold tensors on its GPU (a module, a tensor, an
    optimizer's state): a restart puts them back on each rank's GPU (see _session/worker)."""
    replicas: ReplicaReport | None = None
    """--check-replicas: what the check after the cell found."""


# ----------------------------------------------------------------------------- analysis


def split_cell(code: str, first_line: int) -> tuple[ast.Module, ast.Expression | None, bool]:
    """Parse the cell; split off its last expression (shown as Out, as IPython does)."""
    tree = ast.parse(code, CELL_FILENAME)
    ast.increment_lineno(tree, first_line - 1)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    suppressed = code.rstrip().endswith(";")
    return tree, last, suppressed


# ----------------------------------------------------------------------------- worker side


def run_cell(
    code: str,
    namespace: dict[str, Any],
    options: CellOptions,
    registry: Registry | None = None,
    scan_large: bool = False,
    kept: SnapshotKeeper | None = None,
    late_presses_ignored: bool = False,
) -> CellOutcome | None:
    """Run the cell as this rank; the master returns what goes back to the notebook.

    ``registry``: the notebook's objects (inherited by fork, or the shipped copies); None in an
    exported script, where the namespace is this process's own. ``scan_large``: a session
    master's snapshot reads the large storages' pages (see digests.storage_digests). ``kept``:
    a session master's snapshot from its last cell, used and kept again (see SnapshotKeeper).
    ``late_presses_ignored``: a session worker's (see ignore_late_presses).
    """
    from enot_nb import distributed

    rank = distributed.get_rank()
    shell = _cell_shell(options)
    source = options.source_header + code
    linecache.cache[CELL_FILENAME] = (len(source), None, source.splitlines(True), CELL_FILENAME)
    body, last, suppressed = split_cell(code, options.first_line)
    hidden = reach.hidden_names(namespace)
    namespace.setdefault("get_ipython", lambda: shell)
    shell.user_ns = namespace  # line magics (%who, %run, ...) see the cell's variables
    used = reach.names_used(code)
    with unwarned():
        _sync_models(namespace, used, options)
    tracker = None
    if rank == 0 and not options.no_return:  # only the master's state goes back
        with unwarned():
            if registry is None:
                registry = reach.reach(namespace, code, hidden).registry
            reached = {n for n, v in list(namespace.items()) if registry.find(v) is not None}
            originals = sharded.originals(namespace, used | reached)
            tracker = Tracker(registry, namespace, hidden, originals, scan_large, kept)
    figures_before = _open_figures()
    modules_before = list(sys.modules)  # a copy of its keys, in order: cheap to take and compare
    let_go()  # (a session master holds still from finding its registry to here)
    grad_before = _grad_enabled()
    try:
        exec(_compiled(body, "exec", options), namespace)  # running the user's cell is the point
        value = eval(_compiled(last, "eval", options), namespace) if last else None
        if late_presses_ignored:
            ignore_late_presses()  # in the try: a press that came before it is the cell's own
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            _grad_mode_after_press(grad_before)
        if tracker is not None and (isinstance(exc, KeyboardInterrupt) or options.keep_on_error):
            with unwarned():
                _send_partial(tracker, options)
        raise
    finally:
        if rank == 0:
            _report_imports(modules_before, body, last)
    if not options.no_return and options.gather_sharded and sharded.may_be_sharded():  # every rank
        with unwarned():
            reached = used | set(reach.reach(namespace, code, hidden).names)  # train() may shard `model`
            whole_before = tracker.sharded_before if tracker is not None else {}
            gathered = sharded.gather_whole(namespace, sorted(reached & set(namespace)), whole_before)
        for line in gathered:
            print(f"enot_nb: {line}", file=sys.stderr)
    report = None
    if options.check_replicas:  # every rank: a collective
        with unwarned():
            report = replica_check.check_replicas(namespace)
    _show_new_figures(figures_before, rank == 0 and options.shown)
    has_value = last is not None and not suppressed and value is not None
    if tracker is None:
        if rank != 0:
            return None
        # --no-return: nothing comes back, but the cell's value is shown, as a local cell shows it
        bundle = _bundle(value, shell) if has_value else None
        return CellOutcome(has_value=has_value, value_bundle=bundle, replicas=report)
    with unwarned():
        outcome = tracker.outcome(options, value if has_value else None, has_value, last, shell, body)
        tracker.keep()
    outcome.replicas = report
    return outcome


def _grad_enabled() -> bool:
    torch = sys.modules.get("torch")
    return torch is None or bool(torch.is_grad_enabled())


def _grad_mode_after_press(before: bool) -> None:
    """A press that lands inside ``torch.no_grad()``'s entry (autograd turned off, its ``with``
    block not begun) leaves autograd off with nothing to turn it on again: every later backward
    fails. After a press, autograd is as it was before the cell, and a line says so."""
    torch = sys.modules.get("torch")
    if torch is None or bool(torch.is_grad_enabled()) == before:
        return
    torch.set_grad_enabled(before)
    state = "on" if before else "off"
    print(f"enot_nb: a stop press left autograd switched; it is {state} again, as before the cell", file=sys.stderr)


def ignore_late_presses() -> None:
    """A session worker's task ran to its end: a stop press from here is late, and ignored
    until the worker is idle again (_session/worker/loop.serve sets the default handler back). So the
    master's outcome (what the cell changed) is made and sent whole, and the notebook, which
    mirrors the master, gets it (a press while it was made had lost it: the master held what
    the cell did, the notebook not); and a press cannot make a second answer. Ignored, not
    blocked: a press goes to the whole process, and any of its threads may take it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _report_imports(before: list[str], *trees: ast.AST | None) -> None:
    """Tell the kernel which modules the cell imported that it may import too (preload's rule),
    in the order they were imported; outside a launch (an exported script) there is no one to
    tell."""
    if not bootstrap.in_launch():
        return
    if list(sys.modules) == before:  # most cells import nothing: the same names, the same order
        return
    imported = set(sys.modules).difference(before)
    if not imported:
        return
    named = {
        (a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
        for tree in trees
        if tree is not None
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    modules = tuple(
        n for n in list(sys.modules) if n in imported and preload.importable(n) and preload.may_keep(n, named)
    )
    if modules:
        bootstrap.send(Imported(modules))


_FUTURE_FEATURES = functools.reduce(
    operator.or_, (getattr(__future__, name).compiler_flag for name in __future__.all_feature_names)
)


def notebook_future_flags(shell: Any) -> int:
    """Return the ``from __future__`` features the notebook's next cell compiles with: IPython's
    compiler keeps those a cell imported for every cell after it."""
    return getattr(getattr(shell, "compile", None), "flags", 0) & _FUTURE_FEATURES


def _compiled(tree: ast.Module | ast.Expression, mode: str, options: CellOptions) -> types.CodeType:
    """The cell's code, compiled as the notebook compiles it: with the notebook's ``__future__``
    features and no others (``compile`` would add this module's own ``annotations``, and a
    dataclass's fields would become strings that only this module's globals resolve)."""
    return compile(tree, CELL_FILENAME, mode, flags=options.future_flags, dont_inherit=True)


class _MainModule:
    """The ``__main__`` module over a namespace that is no module's, as IPython's ``DummyMod``
    is over the notebook's: its ``__dict__`` is the namespace itself."""

    __spec__ = None  # (multiprocessing's spawn reads it: nothing to import in a child, as in Jupyter)


def make_main(namespace: dict[str, Any]) -> None:
    """Make ``namespace`` this process's ``__main__``, as the notebook's namespace is the
    kernel's: what looks ``__main__`` up finds the cell's names (a dataclass's generated methods
    take its ``__dict__`` as their globals, ``typing.get_type_hints`` and pickle by name read it).
    A forked one-off worker's namespace is already the kernel's ``__main__``: left as it is."""
    if getattr(sys.modules.get("__main__"), "__dict__", None) is namespace:
        return
    main = _MainModule()
    main.__dict__ = namespace
    sys.modules["__main__"] = cast(types.ModuleType, main)


def _bundle(value: Any, shell: Any) -> tuple[dict, dict] | None:
    return shell.display_formatter.format(value) if shell else None


def _cell_shell(options: CellOptions) -> Any:
    """The worker's shell, its front end installed when the worker started; in an exported script
    (run by torchrun, no launcher), one that prints text and saves figures to files."""
    if options.figure_dir is None:
        from IPython.core.interactiveshell import InteractiveShell

        if InteractiveShell.initialized():
            return InteractiveShell.instance()
    shell = frontend.install(None, None)
    shell.display_pub = frontend.PipePublisher(None, options.shown, options.figure_dir, options.figure_prefix)
    return shell


def run_shipped_cell(
    values: dict[str, Any],
    left_out: dict[str, str],
    objects: list[Any],
    code: str,
    options: CellOptions,
    parents: list[tuple[int, str]] | None = None,
) -> Any:
    """Worker side under spawn: the shipped variables become the cell's namespace; ``objects``
    are the copies of the notebook's registered objects, index for index (``parents``: their
    paths, see Registry.of_objects)."""
    namespace = objects[0]  # the worker's namespace dict (see picklers.WORKER_NAMESPACE)
    namespace.update({"__name__": "__main__", "__builtins__": __builtins__})
    namespace.update(values)
    make_main(namespace)
    with unwarned():
        registry = Registry.of_objects(objects, parents)
    try:
        return run_cell(code, namespace, options, registry)
    except NameError as err:
        if err.name in left_out:
            raise NameError(
                f"variable {err.name!r} could not be sent to the workers: {left_out[err.name]}. "
                "Create it inside this cell, or use --start-method fork"
            ) from err
        raise


class Tracker:
    """The master's view of the notebook's objects: a snapshot before, the changes after."""

    def __init__(
        self,
        registry: Registry,
        namespace: dict[str, Any],
        hidden: Any,
        sharded_before: dict[str, Any],
        scan_large: bool = False,
        kept: SnapshotKeeper | None = None,
    ) -> None:
        self.registry, self.namespace, self.hidden = registry, namespace, hidden
        self.sharded_before = sharded_before
        """Each used module's tensors before the cell, by name (see sharded.originals)."""
        self.names_before = user_variables(namespace, hidden)
        self.kept = kept
        with held_still():
            self.snapshot = kept.take(registry, scan_large) if kept is not None else Snapshot.take(registry, scan_large)
        self.changed: tuple[list[int], list[int]] | None = None  # (objects, storages), once collected

    def outcome(
        self,
        options: CellOptions,
        value: Any,
        has_value: bool,
        last: ast.Expression | None,
        shell: Any,
        body: ast.Module | None = None,
    ) -> CellOutcome:
        with held_still():  # the cell has run: each large container pickled once to compare it
            changes, changed = collect.collect(
                self.registry, self.snapshot, self.names_before, self.namespace, self.hidden
            )
        left = (
            sharded.left_sharded(self.registry, self.namespace, changed, changes)
            if not options.gather_sharded and sharded.may_be_sharded()
            else {}
        )
        # Kept for the next cell unless the cell let go of a registered object: kept, it would
        # hold it (its memory) until the next task, and the next cell's objects differ anyway.
        gone = [n for n in (*changes.bound, *changes.deleted) if self.registry.find(self.names_before.get(n))]
        self.changed = None if gone else (changed, [new.storage for new in changes.storages])
        outcome = CellOutcome(has_value=has_value, not_returned=left)
        outcome.changed_names = sorted(
            set(changes.bound) | {name for name in map(self.registry.root_name, changed) if name in self.namespace}
        )
        if options.names_only:  # a session's --no-return cell: the names of what changed, no state
            written = self.registry.names_holding({new.storage for new in changes.storages})
            outcome.left_out = sorted({*outcome.changed_names, *written, *changes.deleted})
            outcome.value_bundle = _bundle(value, shell) if has_value else None
            return outcome
        if options.returns is not None:
            outcome.left_out = sorted({*changes.bound, *changes.deleted} - set(options.returns))
            written = set(outcome.changed_names) | set(changes.deleted) | names_written(body, last)
            outcome.unbound_returns = [n for n in options.returns if n not in written]
            changes.bound = {n: v for n, v in changes.bound.items() if n in options.returns}
            changes.deleted = [n for n in changes.deleted if n in options.returns]
            outcome.changed_names = [n for n in outcome.changed_names if n in options.returns]
        tensor = sys.modules["torch"].Tensor
        outcome.detached = sorted(
            n for n, v in changes.bound.items() if isinstance(v, tensor) and v.grad_fn is not None
        )
        name = last.body.id if has_value and last is not None and isinstance(last.body, ast.Name) else None
        if (
            name is not None
            and self.namespace.get(name) is value
            and (name in changes.bound or self.names_before.get(name, collect._MISSING) is value)
        ):
            outcome.value_name = name  # the notebook will hold it under that name: show that object
            outcome.value_bundle = _bundle(value, shell)  # in case it cannot come back
        elif has_value:
            changes.value, changes.has_value = value, True
            outcome.value_bundle = _bundle(value, shell)
        outcome.state, outcome.moved_to_cpu = collect.dump(changes, self.registry, outcome.not_returned)
        return outcome

    def keep(self) -> None:
        """The cell ended well: its snapshot is kept for the next (see SnapshotKeeper)."""
        if self.kept is not None and self.changed is not None:
            self.kept.keep(self.registry, self.snapshot, *self.changed)

    def send_partial(self, options: CellOptions) -> None:
        """The state reached, sent before the failure is reported (see _send_partial)."""
        _send_partial(self, options)


def names_written(*trees: ast.AST | None) -> set[str]:
    """Names a cell's text binds or deletes (``x = 1; del x`` bound x, though it left none;
    ``import math`` binds math even when it was imported before)."""
    names = set()
    for node in (n for tree in trees if tree is not None for n in ast.walk(tree)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
    return names


def _send_partial(tracker: Tracker, options: CellOptions) -> None:
    """The master failed or was interrupted: send the state it reached, bounded by the launcher's
    patience (it stops this process after ENOT_NB_INTERRUPT_SAVE_WAIT seconds)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second stop press must not cut this short
    try:
        # A one-off cell's sharded modules go back to how they were (they cannot be gathered
        # now); a session's live ones stay sharded on every rank (the master's too: its peers'
        # next collective needs it so).
        kept = (
            sharded.restore_as_before(tracker.namespace, tracker.sharded_before, tracker.names_before)
            if options.gather_sharded
            else {}
        )
        outcome = tracker.outcome(options, None, False, None, None)
        outcome.not_returned.update(kept)
        bootstrap.send_partial(outcome)
    except Exception as err:  # noqa: BLE001 - the original error matters more
        print(f"enot_nb: the master's state could not be saved ({err})", file=sys.stderr)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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

    for number in sorted(set(pyplot.get_fignums()) - before):
        if show:
            _figures.publish_figure(pyplot.figure(number))
        pyplot.close(number)
