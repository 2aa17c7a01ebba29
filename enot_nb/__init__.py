"""enot_nb: train PyTorch on every GPU of a machine straight from a Jupyter notebook.

Public surface:

* ``%load_ext enot_nb`` then ``%%enot_distributed -n 4``: run a cell on 4 processes.
* [notebook_launcher][enot_nb.notebook_launcher]: run a function on N supervised worker processes.
* ``%enot_session start -n 2`` / [Session][enot_nb.Session]: workers that live across cells;
  [session][enot_nb.session] returns the live one.
* [enot_nb.distributed][]: the functional API, also usable under torchrun.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from enot_nb import distributed
from enot_nb._launch.notes import last_notes
from enot_nb._version import __version__ as __version__  # re-exported
from enot_nb.errors import (
    DistributedRuntimeException,
    EnotNbError,
    IncompatibleFrameworkError,
    LaunchError,
    NotHeldError,
    StaleError,
    StaleWrapperError,
    WorkerFailedError,
    WorkerFailure,
)
from enot_nb.export import export_cell, load_results
from enot_nb.launcher import notebook_launcher
from enot_nb.sessions import Session, session

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = [
    "DistributedRuntimeException",
    "EnotNbError",
    "IncompatibleFrameworkError",
    "LaunchError",
    "NotHeldError",
    "StaleError",
    "StaleWrapperError",
    "WorkerFailedError",
    "WorkerFailure",
    "distributed",
    "export_cell",
    "last_notes",
    "load_results",
    "notebook_launcher",
    "Session",
    "session",
]


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """``%load_ext enot_nb`` registers the ``%%enot_distributed`` cell magic."""
    from enot_nb.magic import load_ipython_extension as load

    load(ipython)
