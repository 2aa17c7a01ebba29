"""Sessions: workers that live across cells, the notebook mirroring the master (the counterpart
of cells.py, which runs one-off cells). ``Session`` and ``session()`` are the public face; the
session itself lives in _session/ (the kernel side: _session/kernel/session.py); what the magics
ask of a session after parsing is here.

Example:
    ```python
    %load_ext enot_nb
    %enot_session start -n 2 --backend gloo

    %%enot_distributed
    ddp = DDP(model)                  # built once; lives on every rank
    train(ddp, steps=50)              # `model` is updated in the notebook, in place

    %enot_session stop
    ```
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from enot_nb._defaults import SESSION_HANG_AFTER
from enot_nb._launch.notes import NOTES
from enot_nb._launch.options import EngineOptions, LaunchOptions
from enot_nb._session.kernel.flow import CellRun
from enot_nb._session.kernel.session import RankStatus, Session, SessionStatus, plan_session, session
from enot_nb._worker import cell as _cell
from enot_nb.cells import check_sync, option_names, transformed
from enot_nb.errors import LaunchError, WorkerFailedError

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = ["CellRun", "RankStatus", "Session", "SessionStatus", "run_session_cell", "run_session_command", "session"]


def run_session_cell(shell: InteractiveShell | None, live: Any, cell: str, args: argparse.Namespace, line: str) -> Any:
    """``%%enot_distributed`` while a session runs: the cell runs on the session's workers
    (its options checked by the magic)."""
    if shell is None:
        raise UsageError("%%enot_distributed runs inside IPython or Jupyter")
    code = transformed(shell, cell)
    NOTES.start_cell()
    run = CellRun(
        output=args.output,
        returns=option_names(args.returns),
        no_return=args.no_return,
        sync=None if args.no_sync else option_names(args.sync),
        first_line=2,
        source_header=f"%%enot_distributed {line}\n",
        future_flags=_cell.notebook_future_flags(shell),
        check_replicas=args.check_replicas,
        hang_after=args.hang_after,
    )
    check_sync(shell.user_ns, run.sync)
    failure: BaseException | None = None
    try:
        return live.run_cell(code, run)
    except WorkerFailedError as err:
        failure = err.with_traceback(None)
    except LaunchError as err:  # a stale variable changed here, a closed session
        failure = UsageError(f"%%enot_distributed: {err}")
    raise failure


def run_session_command(shell: InteractiveShell | None, args: argparse.Namespace, given: dict[str, str]) -> Any:
    """``%enot_session [start|stop|restart|status|check] [options]``, parsed (``given``: the options
    written on the line, see magic.given_options); LaunchConfigError for a bad option."""
    live = session()
    if args.action in ("status", "check"):
        if given:
            raise UsageError("%enot_session: options go with start or restart, e.g. %enot_session start -n 2")
        if live is None:
            print("enot_nb: no session is running; start one with `%enot_session start -n N`")
            return None
        if args.action == "check":
            try:
                return live.check()
            except WorkerFailedError as err:
                raise err.with_traceback(None) from None
        return live.status()
    if args.action == "stop":
        if live is None:
            print("enot_nb: no session is running")
            return None
        live.close()
        print("enot_nb: session stopped; its workers are gone, the notebook keeps what it holds")
        return None
    if args.action == "start" and live is not None:
        raise UsageError(
            "%enot_session start: a session is already running; `%enot_session restart ...` starts its "
            "workers again (with other options, if given), `%enot_session stop` ends it"
        )
    if args.action == "restart" and live is not None and not given:
        live.restart("asked for")
        return None
    options = _session_options(args, given, live)
    engine = EngineOptions(**{k: v for k, v in options.items() if k in EngineOptions.names()})
    plan_session(LaunchOptions(**{k: v for k, v in options.items() if k in LaunchOptions.names()}), engine)  # first
    if live is not None:
        live.close()
    Session(**options, namespace=shell.user_ns if shell is not None else None)
    return None


def _session_options(args: argparse.Namespace, given: dict[str, str], live: Any) -> dict[str, Any]:
    """A session's options from the magic's flags; on a restart, the flags given replace the
    running session's options, the others are kept."""
    dests = {
        "nprocs": "nprocs",
        "backend": "backend",
        "seed": "seed",
        "cuda_optimize_for_speed": "speed",
        "cuda_reproducible": "reproducible",
        "start_method": "start_method",
        "timeout": "timeout",
        "hang_after": "hang_after",
    }
    options: dict[str, Any] = {}
    for name, dest in dests.items():
        keep = live is not None and dest not in given
        options[name] = getattr(live.options, name) if keep else getattr(args, dest)
    if "hang_after" not in given and live is None:
        options["hang_after"] = SESSION_HANG_AFTER  # a session watches for hangs unless told not to
    options["mirror"] = live.mirror_mode if live is not None and "mirror" not in given else args.mirror
    for name in EngineOptions.names():  # where the ranks run: kept on a restart unless given
        keep = live is not None and name not in given
        options[name] = getattr(live.engine, name) if keep else getattr(args, name)
    return options
