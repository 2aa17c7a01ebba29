"""Imports kept across cells: what a cell's master imported is imported here too, in the
background, as the same cell run locally would have left it in ``sys.modules``.

Why: a distributed cell's workers die with the cell, and every module they imported with them.
The README's DDP cell imports 822 modules (``torch._dynamo``, sympy, mpmath: 2 s here) inside
each fresh worker, on every run. A local cell pays that once. So the master reports what it
imported (``protocol.Imported``, the difference of ``sys.modules`` around the cell's ``exec``)
and the kernel, and the fork server for spawned workers, import the same modules::

    master: sys.modules before and after the cell -> Imported(modules) -> kernel
    kernel: fork server: Preload(modules) -> its helper thread -> its next fork inherits them
            the cell done: PRELOADER.start_pending() (a helper thread) -> the next cell waits for
            it, the next fork inherits them

Three rules keep it safe:

* Nothing else imports the same packages meanwhile: two threads importing them at once can
  deadlock (importlib raises ``_DeadlockError`` on a cycle of torch's circular imports) and a
  rollback would remove what the other imported. So the kernel starts the import once the cell
  is done with (its result loaded, its changes applied), and a later cell that imports one of
  the packages being imported (or may: it reads names dynamically, or calls ``__import__``)
  waits for it first (``must_wait_for``, at IPython's ``pre_run_cell``, before the cell holds
  any import lock); other cells run at once. The fork server only forks and reads its socket
  between launches.
* Every fork waits for the helper thread first (``os.register_at_fork(before=...)``): the
  launcher's forks and the user's own. A fork halfway through an import would leave the child a
  half-made module and the import lock held.
* The import runs on a helper thread, never on the thread that forks: there one threaded torch op
  would leave GNU OpenMP's dead pool to every child (see clean_thread).
* It never initializes CUDA: ``torch.cuda._lazy_init`` raises on the helper thread while it
  imports, and a module whose import fails is rolled back (every module it added removed).

Which modules: see ``worker_may_keep`` (the master applies it before it reports).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings
from collections.abc import Iterable
from typing import Any, NamedTuple

from enot_nb._log import log

PURE = frozenset(
    {
        "torch",
        "torchgen",
        "functorch",
        "numpy",
        "sympy",
        "mpmath",
        "networkx",
        "jinja2",
        "markupsafe",
        "filelock",
        "fsspec",
        "typing_extensions",
        "packaging",
        "optree",
        "opt_einsum",
        "cloudpickle",
    }
)
"""torch and its pure dependencies: they read no rank, device or launcher variable at import."""

READS_RANK_AT_IMPORT = frozenset({"lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "deepspeed"})
"""Packages that cache the process's rank or device at import (Lightning's ``rank_zero_only.rank``)
or may: imported in the kernel, every later worker would inherit the kernel's answer."""


def may_keep(name: str, imported_by_name: Iterable[str]) -> bool:
    """The rule: a module is kept if its top-level package is the standard library's, torch's
    family (``PURE``), or one the cell imported by name (a local cell would hold it), unless that
    package reads the rank at import (``READS_RANK_AT_IMPORT``)."""
    top = name.split(".", 1)[0]
    if top in READS_RANK_AT_IMPORT or top == "__main__" or top == "enot_nb":
        return False
    return top in sys.stdlib_module_names or top in PURE or top in set(imported_by_name)


def importable(name: str) -> bool:
    """A module that ``importlib.import_module(name)`` would find again: registered under its own
    spec's name (not an alias some library put in sys.modules, not a module made in memory)."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return spec is not None and spec.name == name and spec.origin is not None


class Imports(NamedTuple):
    kept: list[str]
    rolled_back: dict[str, BaseException]
    """Each module whose import failed (``CudaRefused``: it would have initialized CUDA)."""


def import_all(names: list[str]) -> Imports:
    """Import each module (in order), CUDA refused meanwhile; one that fails is rolled back."""
    done = Imports([], {})
    # The master already showed what the imports warned, as a local cell shows it once.
    with _cuda_refused(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if name in sys.modules:
                continue
            before = set(sys.modules)
            try:
                importlib.import_module(name)
                done.kept.append(name)
            except BaseException as err:  # noqa: BLE001 - any failure: leave no half of it
                for added in set(sys.modules) - before:
                    sys.modules.pop(added, None)
                done.rolled_back[name] = err
                log.debug("preload: %s rolled back (%s: %s)", name, type(err).__name__, err)
    return done


class CudaRefused(RuntimeError):
    """Raised where a preloaded module's import would initialize CUDA in the kernel."""


class _cuda_refused:  # noqa: N801 - a context manager, named as the state it makes
    """``torch.cuda._lazy_init`` raises on this thread while the block runs; other threads (the
    notebook's own cells) are served as before."""

    def __enter__(self) -> None:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        self.patched: list[Any] = []
        if cuda is None:
            return
        self.original = original = getattr(cuda, "_lazy_init")  # noqa: B009 - torch's private name
        me = threading.current_thread()

        def lazy_init() -> None:
            if threading.current_thread() is me:
                raise CudaRefused("enot_nb: a module preloaded after a cell would initialize CUDA; rolled back")
            original()

        # torch.cuda's own modules (memory, random, ...) import _lazy_init by name: theirs too.
        for name, module in list(sys.modules.items()):
            if name.startswith("torch.cuda") and getattr(module, "_lazy_init", None) is original:
                setattr(module, "_lazy_init", lazy_init)  # noqa: B010 - a module's private name
                self.patched.append(module)

    def __exit__(self, *exc: object) -> None:
        for module in self.patched:
            setattr(module, "_lazy_init", self.original)  # noqa: B010


class Preloader:
    """The helper thread that imports what the last cell's master imported; every fork of this
    process waits for it."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.pending: dict[str, None] = {}
        self.importing: set[str] = set()
        """The top-level packages of what the helper thread imports (or was last given)."""

    def add_pending(self, names: list[str]) -> None:
        """Import ``names`` at the next ``start_pending``."""
        self.pending.update(dict.fromkeys(names))

    def start_pending(self) -> None:
        """Start importing what is pending: called when this process imports nothing else (a
        cell's end; the next cell waits for it, see wait)."""
        names, self.pending = list(self.pending), {}
        self.start(names)

    def start(self, names: list[str]) -> None:
        """Import ``names`` in the background (after any import still running)."""
        missing = [n for n in names if n not in sys.modules]
        if not missing:
            return
        with self.lock:
            previous = self.thread
            running = previous is not None and previous.is_alive()
            self.importing = (self.importing if running else set()) | {n.split(".", 1)[0] for n in missing}

            def run() -> None:
                if previous is not None:
                    previous.join()
                import_all(missing)

            self.thread = threading.Thread(target=run, name="enot_nb-preload", daemon=True)
            self.thread.start()

    def must_wait_for(self, code: str) -> bool:
        """Whether a cell of ``code`` must wait for the background import before it runs: it
        imports one of the packages being imported, or may (see ``imported_by``)."""
        thread = self.thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return False
        tops = imported_by(code)
        return tops is None or bool(tops & self.importing)

    def wait(self) -> None:
        """Block until the imports are done (a fork must not copy half an import)."""
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


_DYNAMIC_IMPORTS = frozenset({"__import__", "importlib", "import_module", "exec", "eval", "run_line_magic"})


def imported_by(code: str) -> set[str] | None:
    """The top-level packages a cell imports by statement; None where it may import otherwise
    (it reads names dynamically, calls ``__import__`` or ``importlib``, runs a cell magic) or does
    not parse. Line magics and shell escapes count as no import (their lines are left out)."""
    import ast

    if code.lstrip().startswith("%%"):
        return None
    lines = [line if not line.lstrip().startswith(("%", "!")) else "" for line in code.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return None
    tops: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".", 1)[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".", 1)[0])
        elif (
            isinstance(node, ast.Name | ast.Attribute)
            and (getattr(node, "id", None) or getattr(node, "attr", None)) in _DYNAMIC_IMPORTS
        ):
            return None
    return tops


PRELOADER = Preloader()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=PRELOADER.wait)
