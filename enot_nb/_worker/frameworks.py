"""What makes a worker a torchrun worker to the frameworks users bring (worker side only).

torchrun's environment variables are set by the launcher (see ``attempt.rank_environment``);
two things the environment cannot say are done here, in every worker, at its start:

- **Lightning** refuses ``strategy="ddp"`` (and picks ``ddp_fork`` for ``"auto"``) whenever its
  private flag ``_IS_INTERACTIVE`` is true. The flag is computed once, from ``sys.ps1``, when
  ``lightning_fabric.utilities.imports`` is imported (usually in the kernel, before the fork),
  and copied by ``from ... import`` into the modules in ``LIGHTNING_FLAG_HOLDERS``. A worker is
  not interactive: the flag is set to False in each holder already imported, and in the source
  module as soon as it is imported later (so later copies are False too); a copy in any other
  Lightning module already imported is cleared as well. Tested with
  pytorch-lightning / lightning-fabric ``LIGHTNING_TESTED``; a Lightning that moved the flag gets
  a clear error instead of a silent "not compatible with an interactive environment".
- **Processes started inside a worker** to form another process group (Lightning's
  ``ddp_notebook``/``ddp_spawn``, ``torch.multiprocessing.spawn``, Accelerate's
  ``notebook_launcher``) would wait forever in a rendezvous nobody else joins. They all go
  through ``torch.multiprocessing.start_processes`` (whose children run, but get the error with
  the fix when they call ``init_process_group``: helper processes that only compute keep
  working) or torch elastic's ``launch_agent`` (refused at once). DataLoader workers and
  torch.compile's compile workers start otherwise and keep working.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

from enot_nb.errors import IncompatibleFrameworkError, LaunchError

LIGHTNING_TESTED = "2.6.6"
_LIGHTNING_PACKAGES = ("lightning_fabric", "pytorch_lightning", "lightning")
_FLAG = "_IS_INTERACTIVE"
# Where the flag is defined, per distribution of Lightning (standalone packages, or `lightning`).
LIGHTNING_FLAG_SOURCES = ("lightning_fabric.utilities.imports", "lightning.fabric.utilities.imports")
# The modules that copy it at import, relative to the fabric / pytorch package.
_FABRIC_HOLDERS = ("connector", "strategies.launchers.multiprocessing")
_PYTORCH_HOLDERS = ("trainer.connectors.accelerator_connector", "callbacks.progress.rich_progress")
LIGHTNING_FLAG_HOLDERS = tuple(
    f"{fabric}.{m}" for fabric in ("lightning_fabric", "lightning.fabric") for m in _FABRIC_HOLDERS
) + tuple(f"{pl}.{m}" for pl in ("pytorch_lightning", "lightning.pytorch") for m in _PYTORCH_HOLDERS)


def adapt() -> None:
    """Make this worker look like a torchrun worker to Lightning; refuse nested process starts."""
    after_import: dict[str, Callable[[Any], None]] = {}
    _refuse_nested_starts(after_import)
    for name in LIGHTNING_FLAG_HOLDERS:  # imported later, they copy the cleared source's flag
        if name in sys.modules:
            _clear_flag(sys.modules[name])
    for name in LIGHTNING_FLAG_SOURCES:
        _patch_when_imported(name, _clear_flag, after_import)
    for name, module in list(sys.modules.items()):  # a copy in a module not named above (newer)
        if name.split(".", 1)[0] in _LIGHTNING_PACKAGES and getattr(module, _FLAG, None) is True:
            setattr(module, _FLAG, False)
    sys.meta_path.insert(0, _AfterImportFinder(after_import))


def _patch_when_imported(
    name: str, patch: Callable[[Any], None], after_import: dict[str, Callable[[Any], None]]
) -> None:
    """Patch a module now if it is imported, else right after its import (nothing is imported
    here: a worker that never uses it pays nothing)."""
    if name in sys.modules:
        patch(sys.modules[name])
    else:
        after_import[name] = patch


def _clear_flag(module: Any) -> None:
    if not hasattr(module, _FLAG):
        raise IncompatibleFrameworkError(
            f"enot_nb cannot run Lightning's 'ddp' in a worker: {module.__name__} has no {_FLAG} "
            f"flag in this Lightning version (enot_nb was tested with {LIGHTNING_TESTED}). "
            f"Install pytorch-lightning=={LIGHTNING_TESTED}, or report this at enot_nb's issues"
        )
    setattr(module, _FLAG, False)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Runs a module's patch right after the module is first executed."""

    def __init__(self, after_import: dict[str, Callable[[Any], None]]) -> None:
        self.after_import = after_import

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.after_import:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, self.after_import[name])
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.patch(module)


_NESTED = (
    "this code runs in an enot_nb worker, which is already one rank of the job, and started "
    "processes that form another process group (Lightning's strategy='ddp_notebook' or 'ddp_spawn', "
    "torch.multiprocessing.spawn of init_process_group, Accelerate's notebook_launcher, torchrun's "
    "elastic_launch). They would wait forever for ranks that never join. Let each worker be a rank: "
    "use strategy='ddp' in Lightning, or call the function directly instead of launching it"
)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise LaunchError(_NESTED)


class NoProcessGroup:
    """A function started by torch.multiprocessing inside a worker: it runs, but may not form a
    process group (helper processes that only compute or fill a queue keep working)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        dist.init_process_group = c10d.init_process_group = _refuse
        # Forked, it inherits the worker's group (its sockets are the worker's): not its own.
        dist.is_initialized = c10d.is_initialized = lambda: False
        return self.fn(*args)


def _refuse_nested_starts(after_import: dict[str, Callable[[Any], None]]) -> None:
    import torch.multiprocessing as mp

    spawn_module: Any = sys.modules["torch.multiprocessing.spawn"]  # a module we patch
    start = spawn_module.start_processes

    def start_processes(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return start(NoProcessGroup(fn), *args, **kwargs)

    mp.start_processes = spawn_module.start_processes = start_processes  # mp.spawn calls it too
    # What elastic_launch (torchrun, Accelerate) calls; its import costs ~25 ms, so only if used.
    _patch_when_imported(
        "torch.distributed.launcher.api", lambda module: setattr(module, "launch_agent", _refuse), after_import
    )
