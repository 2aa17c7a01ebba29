"""enot_nb's debug log: an attempt's transitions (start, connected, first failure, each signal
of the stop escalation, close), so that a rare failure in CI shows its cause.

Silent by default, even under a user's ``logging.basicConfig(level=logging.DEBUG)``: the logger
does not propagate to the root handlers, so a notebook that turns its own logging up does not
get our lines mixed in. ``ENOT_NB_DEBUG=1`` (read once, at import) sends them to stderr.
A user may also attach a handler to ``logging.getLogger("enot_nb")`` and lower its level.
"""

from __future__ import annotations

import logging
import os

DEBUG_VARIABLE = "ENOT_NB_DEBUG"

log = logging.getLogger("enot_nb")


def _configure(logger: logging.Logger) -> None:
    logger.propagate = False
    if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        handler = logging.StreamHandler()  # this process's sys.stderr (in a kernel: the cell's)
        handler.setFormatter(logging.Formatter("enot_nb %(asctime)s pid %(process)d: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    else:
        logger.addHandler(logging.NullHandler())
        logger.setLevel(logging.WARNING)


_configure(log)
