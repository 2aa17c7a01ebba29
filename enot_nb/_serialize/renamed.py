"""Saved pickles that name the package's modules as they were before they moved still load.

A results file (``--export``: ``<script>.results.pkl``) names the rebuild functions of its
tensors, storages and arrays by module and name: ``enot_nb._pickling._rebuild_tensor`` before
the package was regrouped into folders, ``enot_nb._serialize.pickling._rebuild_tensor`` until
that module was split. ``load`` reads such a file with those names mapped to where the
functions are now. Only saved files need this: what travels between the kernel and its
workers is pickled and loaded by the same code.
"""

from __future__ import annotations

import importlib
import pickle
from typing import IO, Any

_NOW_IN = {
    "enot_nb._serialize.tensors": (
        "_rebuild_storage",
        "_storage_from_shared",
        "_rebuild_tensor",
        "_set_tensor_state",
        "_numpy_view",
        "_array_of_storage",
        "_owned_array",
        "_storage_of_array",
    ),
    "enot_nb._serialize.picklers": ("_make_function", "_set_function_state", "_EMPTY_CELL", "_make_weakref"),
}
_OLD_MODULES = ("enot_nb._pickling", "enot_nb._serialize.pickling")

MOVED: dict[tuple[str, str], str] = {
    (old, name): new for old in _OLD_MODULES for new, names in _NOW_IN.items() for name in names
}
"""(old module, name) -> the module the name is in now."""


class RenamingUnpickler(pickle.Unpickler):
    """An Unpickler that finds what moved (see MOVED) where it is now."""

    def find_class(self, module: str, name: str) -> Any:
        new = MOVED.get((module, name))
        if new is not None:
            return getattr(importlib.import_module(new), name)
        return super().find_class(module, name)


def load(file: IO[bytes]) -> Any:
    """``pickle.load``, with the names of moved modules mapped (see MOVED)."""
    return RenamingUnpickler(file).load()
