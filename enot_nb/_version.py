"""The package's version: from its installed metadata, or, in a checkout that is not installed
(``PYTHONPATH=.``), from the ``pyproject.toml`` beside it. Its own module, so that code inside the
package (the exported script's header) never imports back up into ``enot_nb/__init__``."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _from_checkout() -> str:
    try:
        text = _PYPROJECT.read_text()
    except OSError:
        return "0+unknown"
    found = re.search(r'^version\s*=\s*"([^"]+)"', text, flags=re.M)
    return found.group(1) if found else "0+unknown"


def _version() -> str:
    try:
        return metadata.version("enot_nb")
    except metadata.PackageNotFoundError:
        return _from_checkout()


__version__ = _version()
