"""The launching process's output set-up, carried into its workers: logs and warnings show once.

A local cell's ``logging`` records and warnings follow what the notebook configured earlier
(``logging.basicConfig(level=INFO)``, ``warnings.filterwarnings(...)``). In a worker:

- under fork, handlers made in the kernel still hold the kernel's own output streams, which
  write to its ZMQ sockets (from every rank, unprefixed, or refused with "send message from
  fork"): ``redirect_inherited`` points them, and the old stream objects, at the worker's
  pipes, where the output mode decides who is shown;
- under spawn, nothing is inherited: ``capture`` (in the launcher) records logger levels, the
  root logger's stream handlers writing to stdout/stderr and the warning filters, and
  ``recreate`` (in the worker) sets them up again.
"""

from __future__ import annotations

import logging
import pickle
import sys
import warnings
from typing import Any, NamedTuple, cast


class OutputSetup(NamedTuple):
    """What the launcher configured for logs and warnings (plain data: it is pickled)."""

    levels: dict[str, int]
    """Logger name ("" for the root) -> level, for loggers with a level of their own."""
    handlers: list[tuple[str, str, int, logging.Formatter | None]]
    """(logger name, "stdout" or "stderr", level, formatter) of each root handler writing there."""
    warning_filters: list[tuple]


def _loggers() -> dict[str, logging.Logger]:
    named = {name: lg for name, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    return {"": logging.getLogger()} | named


def _std_name(stream: Any) -> str | None:
    return {id(sys.stdout): "stdout", id(sys.stderr): "stderr"}.get(id(stream))


def capture() -> bytes:
    """This process's logging levels, std-stream handlers and warning filters, pickled: the
    worker unpickles them after its front end is installed, since a filter's category may import
    a library (Lightning) that decides at import how to display (tqdm.auto), and after the job's
    own imports, which in the kernel also came first (Lightning adds its own handler only if the
    root logger has none)."""
    levels = {name: lg.level for name, lg in _loggers().items() if lg.level != logging.NOTSET}
    # The root logger's handlers only (logging.basicConfig): a library's own handler on its logger
    # (transformers, Lightning) is added again by the library in the worker; copied, it would
    # show every record twice.
    handlers = []
    for h in logging.getLogger().handlers:
        which = _std_name(getattr(h, "stream", None)) if type(h) is logging.StreamHandler else None
        if which is not None:
            handlers.append(("", which, h.level, h.formatter))
    # A category defined in the notebook cannot be pickled by reference: that filter stays behind.
    filters = [f for f in warnings.filters if getattr(f[2], "__module__", "") != "__main__"]
    return pickle.dumps(OutputSetup(levels, handlers, filters))


def recreate(pickled: bytes) -> None:
    """Set up a fresh (spawned) worker's logging and warnings as the launcher had them."""
    try:
        setup = pickle.loads(pickled)
    except Exception as err:  # noqa: BLE001 - the cell can run without them; say so once
        print(
            f"enot_nb: the notebook's logging and warning filters could not be recreated in this "
            f"worker ({type(err).__name__}: {err}); the defaults apply",
            file=sys.stderr,
        )
        return
    loggers = _loggers()
    for name, level in setup.levels.items():
        (loggers.get(name) or logging.getLogger(name)).setLevel(level)
    for name, which, level, formatter in setup.handlers:
        handler = logging.StreamHandler(getattr(sys, which))
        handler.setLevel(level)
        handler.setFormatter(formatter)
        logging.getLogger(name or None).addHandler(handler)
    warnings.resetwarnings()
    for action, message, category, module, lineno in setup.warning_filters:
        # Stored compiled, or as a plain string (the interpreter's defaults), or None.
        warnings.filterwarnings(
            action,
            getattr(message, "pattern", message) or "",
            category,
            getattr(module, "pattern", module) or "",
            lineno,
            append=True,
        )


def redirect_inherited(old_out: Any, old_err: Any) -> None:
    """After a fork: what still holds the launcher's stdout/stderr objects writes to ours."""
    pairs = {id(old_out): sys.stdout, id(old_err): sys.stderr}
    for lg in _loggers().values():
        for h in lg.handlers:
            new = pairs.get(id(getattr(h, "stream", None)))
            if new is not None:
                cast(Any, h).stream = new  # not setStream: it would flush the old stream to its sockets
    for old, new in ((old_out, sys.stdout), (old_err, sys.stderr)):
        if old is not new and old not in (sys.__stdout__, sys.__stderr__) and hasattr(old, "__dict__"):
            # ipykernel's OutStream, captured by print(file=...), tqdm, a library's handler
            old.write, old.flush, old.writelines = new.write, new.flush, new.writelines
