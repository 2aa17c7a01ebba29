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
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

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


@contextmanager
def unwarned() -> Iterator[None]:
    """Around what enot_nb does with the user's objects (walk, snapshot, compare, pickle, apply),
    never around the user's own code nor a fork: reading an object can make it warn
    (``torch.distributed.reduce_op`` warns on any attribute read, an isinstance check included), a
    local cell never reads them so, and the warning would name our lines or ``<frozen abc>``.
    (warnings.catch_warnings: the process's filters, for as long as this lasts.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
