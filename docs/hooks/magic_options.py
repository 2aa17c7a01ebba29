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
    # IPython writes the usage as a reStructuredText literal block for Sphinx ("::", then the
    # usage indented by two); shown as text, only the usage belongs on the page.
    usage, rest = magic.parser.format_help().removeprefix("::\n\n").split("\n\n", 1)
    usage = "\n".join(line.removeprefix("  ") for line in usage.splitlines())
    return f"```text\n{usage}\n\n{rest.rstrip()}\n```"
