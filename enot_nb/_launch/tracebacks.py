"""A worker's traceback in the notebook's words: a frame in a notebook cell is named as IPython
names it for a local cell (``Cell In[5], line 3``) instead of by the cell's file."""

from __future__ import annotations

import re
from typing import Any

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def as_in_the_notebook(text: str | None, shell: Any = None) -> str | None:
    """``text`` with each frame of a notebook cell named ``Cell In[N], line L``, as IPython does;
    unchanged outside IPython or where no frame is a cell's."""
    if not text:
        return text
    cells = _cell_files(shell)
    if not cells:
        return text

    def named(match: re.Match[str]) -> str:
        count = cells.get(match.group(1))
        return match.group(0) if count is None else f"Cell In[{count}], line {match.group(2)}"

    return _FRAME.sub(named, text)


def _cell_files(shell: Any) -> dict[str, int]:
    """The files IPython compiled cells into, by execution count (its own map, IPython >= 8)."""
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return {}
        shell = get_ipython()
    compiler = getattr(shell, "compile", None)
    files = getattr(compiler, "_filename_map", None)
    return dict(files) if isinstance(files, dict) else {}
