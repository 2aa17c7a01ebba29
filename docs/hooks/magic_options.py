"""A MkDocs hook: the magics' options page is written from their ``magic_arguments``, so that it
cannot drift from what the magics accept (``<!-- magic-options: NAME -->`` in a page becomes the
help of that magic)."""

from __future__ import annotations

import re
from typing import Any

_MARKER = re.compile(r"<!-- magic-options: (\w+) -->")


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARKER.sub(lambda match: _help(match.group(1)), markdown)


def _help(name: str) -> str:
    from enot_nb.magic import EnotMagics

    magic = getattr(EnotMagics, name)
    text = magic.parser.format_help()
    return f"```text\n{text.rstrip()}\n```"
