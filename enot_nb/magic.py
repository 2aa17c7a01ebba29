"""``%%enot_distributed``, ``%enot_session``, ``%enot_pull`` and ``%enot_debug``: the magics parse their options
and hand off, as ipyparallel's do: a one-off cell to cells.run_distributed_cell, a session cell
and the session's commands to sessions.py.

Example:
    ```python
    %load_ext enot_nb

    %%enot_distributed -n 2 --backend gloo --seed 0
    model = train(model)          # runs on 2 processes; `model` is updated in the notebook
    ```
"""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from enot_nb import sessions
from enot_nb._defaults import DEFAULT_TIMEOUT, SESSION_HANG_AFTER
from enot_nb._launch.options import EngineOptions, LaunchOptions, in_magic_words
from enot_nb._launch.plan import LaunchPlan, plan_launch
from enot_nb._worker import preload
from enot_nb.cells import check_cell_syntax, launch_options, option_names, run_distributed_cell
from enot_nb.errors import LaunchConfigError, LaunchError, NotHeldError, StaleError, WorkerFailedError

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


# The options that decide the workers, defined once: a one-off cell's (%%enot_distributed) and a
# session's (%enot_session start / restart). A session cell refuses them (WORKER_FLAGS).
PULL_SIDES = {"--overwrite": "overwrite", "--keep-notebook": "keep_notebook"}
"""%enot_pull's options: which side wins where a plain cell changed a stale variable."""

_WORKER_ARGUMENTS = (
    argument("-n", "--nprocs", type=int, default=None, help="processes to start (default: one per visible GPU)"),
    argument("--backend", default=None, help="nccl or gloo (default: nccl when each rank has a GPU)"),
    argument("--seed", type=int, default=None, help="seed random, NumPy and torch on every rank"),
    argument("--speed", action="store_true", help="cuDNN benchmark and TF32 (init_torch's cuda_optimize_for_speed)"),
    argument("--reproducible", action="store_true", help="deterministic algorithms (init_torch's cuda_reproducible)"),
    argument(
        "--start-method",
        choices=["fork", "spawn"],
        default=None,
        help="fork the kernel, or start clean workers (default: fork unless CUDA is initialized in the kernel)",
    ),
    argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT.total_seconds(),
        metavar="SECONDS",
        help=f"process group timeout for collectives (default: {DEFAULT_TIMEOUT.total_seconds():g})",
    ),
)
_NODE_ARGUMENTS = (
    argument("--master-addr", default="127.0.0.1", help="address of node 0 (multi-node)"),
    argument("--master-port", type=int, default=None, help="port on node 0 (default: a free one)"),
    argument("--nnodes", type=int, default=1, help="number of nodes running this cell"),
    argument("--node-rank", type=int, default=0, help="rank of this node"),
    argument("--max-restarts", type=int, default=0, help="restart a failed group this many times"),
)
_HANG_AFTER = argument(
    "--hang-after",
    type=float,
    default=None,
    metavar="SECONDS",
    help="when no rank has used CPU time for this long, show each rank's last collective and where it waits "
    f"(the cell goes on; 0: never; default: never in a one-off cell, {SESSION_HANG_AFTER:g} in a session)",
)
# Where a session's ranks run (%enot_session start / restart only): this machine, or a Ray cluster.
_ENGINE_ARGUMENTS = (
    argument("--engine", choices=["local", "ray"], default="local", help="local processes, or Ray actors"),
    argument("--address", default=None, help="the Ray cluster: auto, or its head's HOST:PORT (--engine ray)"),
    argument("--gpus-per-rank", type=int, default=0, help="GPUs Ray gives each rank (--engine ray)"),
    argument("--placement", choices=["pack", "spread"], default="pack", help="how Ray places the ranks (--engine ray)"),
)
WORKER_FLAGS = frozenset(
    {"-n", "--nprocs", "--backend", "--seed", "--speed", "--reproducible", "--start-method", "--timeout"}
    | {"--master-addr", "--master-port", "--nnodes", "--node-rank", "--max-restarts"}
)
"""The flags of _WORKER_ARGUMENTS and _NODE_ARGUMENTS: they would change a session's workers."""


def _with_arguments(*decorators: Any) -> Any:
    """Apply shared magic_arguments ``argument``s, in the order written."""

    def apply(function: Any) -> Any:
        for decorator in reversed(decorators):
            function = decorator(function)
        return function

    return apply


@magics_class
class EnotMagics(Magics):
    """The ``%%enot_distributed`` cell magic; ``%enot_session`` and ``%enot_pull``."""

    @magic_arguments()
    @_with_arguments(*_WORKER_ARGUMENTS[:6])
    @argument(
        "--output", choices=["master", "all", "none"], default="master", help="whose output to show (default: master)"
    )
    @argument(
        "--sync",
        default=None,
        metavar="NAME[,NAME]",
        help="models to sync before the cell (default: every model the cell uses; in a session: none)",
    )
    @argument("--no-sync", action="store_true", help="do not sync models before the cell")
    @argument(
        "--return",
        dest="returns",
        default=None,
        metavar="NAME[,NAME]",
        help="bring back only these variables (default: all the cell bound or changed)",
    )
    @argument("--no-return", action="store_true", help="bring nothing back")
    @argument(
        "--on-error",
        choices=["discard", "keep"],
        default="discard",
        help="when a rank fails: leave the notebook as it was (discard, the default), or "
        "keep the state the master reached (best effort); a session cell always keeps it",
    )
    @_with_arguments(_WORKER_ARGUMENTS[6], *_NODE_ARGUMENTS, _HANG_AFTER)
    @argument(
        "--export",
        default=None,
        metavar="PATH",
        help="do not run: write a torchrun script for this cell at PATH, with the variables "
        "it uses beside it (see enot_nb.load_results)",
    )
    @argument(
        "--check-replicas",
        action="store_true",
        help="after the cell, compare every replicated tensor (DDP's parameters and buffers, a replicated "
        "optimizer's state) across the ranks, naming each that differs",
    )
    @argument("--fresh", action="store_true", help="while a session runs: run this cell as a one-off launch")
    @cell_magic
    def enot_distributed(self, line: str, cell: str) -> Any:
        """Run this cell on several processes; the master's results come back to the notebook.
        While a session runs (%enot_session start), the cell runs on its workers."""
        live = sessions.session()
        if live is not None:
            args = parse_argstring(EnotMagics.enot_distributed, line)
            if not args.fresh:
                given = given_options(EnotMagics.enot_distributed, line)
                check_session_cell_options(args, given, live.mirror_mode)
                if not args.export:  # --export writes a script: the one-off path below
                    return sessions.run_session_cell(self.shell, live, cell, args, line)
        args, plan = parse_options(line)
        return run_distributed_cell(self.shell, cell, args, plan, line)

    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        choices=["start", "stop", "restart", "status", "check"],
        default="status",
        help="start the session's workers, stop them, start them again, show them (the default), or "
        "check that their replicas agree",
    )
    @_with_arguments(*_WORKER_ARGUMENTS, _HANG_AFTER, *_ENGINE_ARGUMENTS)
    @argument(
        "--mirror",
        choices=["all", "none"],
        default="all",
        help="all: the notebook mirrors the master after every cell, and plain cells' changes reach "
        "every rank; none: nothing flows unless asked (%%enot_pull, session.push)",
    )
    @line_magic
    def enot_session(self, line: str) -> Any:
        """Workers that live across cells: %enot_session start -n 2, %enot_session (their
        table), %enot_session restart, %enot_session stop, %enot_session check (do the replicas
        agree?)."""
        args = parse_argstring(EnotMagics.enot_session, line)
        given = given_options(EnotMagics.enot_session, line)
        try:
            return sessions.run_session_command(self.shell, args, given)
        except LaunchConfigError as err:
            flag = LaunchOptions.FLAGS.get(err.parameter or "") or EngineOptions.FLAGS.get(err.parameter or "")
            raise UsageError(f"%enot_session{' ' + flag if flag else ''}: {in_magic_words(str(err))}") from None

    @line_magic
    def enot_debug(self, line: str) -> None:
        """%enot_debug [RANK]: after a session cell failed, the debugger on the failing rank's
        traceback (or RANK's), in the notebook, as %debug after a local cell."""
        live = sessions.session()
        if live is None:
            raise UsageError(
                "%enot_debug needs a session: a one-off cell's workers are gone once it fails; start one "
                "(%enot_session start -n N) and run the cell there"
            )
        words = line.split()
        if len(words) > 1 or (words and not words[0].isdigit()):
            raise UsageError(f"%enot_debug [RANK]: RANK is a rank's number, e.g. %enot_debug 1 (got {line!r})")
        try:
            live.debug(int(words[0]) if words else None)
        except WorkerFailedError as err:
            raise err.with_traceback(None) from None
        except LaunchError as err:
            raise UsageError(f"%enot_debug: {err}") from None

    @line_magic
    def enot_pull(self, line: str) -> None:
        """%enot_pull NAME[,NAME] [--overwrite | --keep-notebook]: bind the session master's
        values in the notebook. Where a plain cell changed a stale name (the master changed it
        too, and it did not come back), say which side wins: --overwrite takes rank 0's
        value, --keep-notebook sends the notebook's (or its deletion) to every rank."""
        live = sessions.session()
        if live is None:
            raise UsageError("%enot_pull: no session is running; start one with `%enot_session start -n N`")
        words = line.replace(",", " ").split()
        flags = {w for w in words if w.startswith("-")}
        names = [w for w in words if not w.startswith("-")]
        bad = [n for n in names if not n.isidentifier()] + sorted(flags - set(PULL_SIDES))
        if bad or not names or len(flags) > 1:
            raise UsageError(
                "%enot_pull NAME[,NAME] [--overwrite | --keep-notebook]: name the variables to bring back, "
                f"e.g. %enot_pull model (got {line!r})"
            )
        try:
            live.pull(*names, **{PULL_SIDES[f]: True for f in flags})
        except (StaleError, NotHeldError, LaunchConfigError) as err:
            raise UsageError(f"%enot_pull: {err}") from None


def check_cell_options(args: argparse.Namespace) -> None:
    """The per-cell options a one-off cell and a session cell share: UsageError if they
    contradict each other or name no variable."""
    if args.sync and args.no_sync:
        raise UsageError("--sync and --no-sync contradict each other; keep one")
    if args.returns and args.no_return:
        raise UsageError("--return and --no-return contradict each other; keep one")
    option_names(args.sync)
    option_names(args.returns)


def parse_options(line: str) -> tuple[argparse.Namespace, LaunchPlan | None]:
    """The magic's options and the launch they describe (None with --export); UsageError
    (no traceback) if bad."""
    args = parse_argstring(EnotMagics.enot_distributed, line)
    check_cell_options(args)
    try:
        options = launch_options(args)
        # --export runs nothing here: torchrun decides the processes (-n may be omitted).
        plan = None if args.export else plan_launch(options)
    except LaunchConfigError as err:
        flag = LaunchOptions.FLAGS.get(err.parameter or "")
        raise UsageError(f"%%enot_distributed{' ' + flag if flag else ''}: {in_magic_words(str(err))}") from None
    return args, plan


def given_options(magic: Any, line: str) -> dict[str, str]:
    """The options written on a magic's line, as {dest: the flag as written}: what the user asked
    for, whatever its value (a value equal to the default is asked for too). Abbreviations are
    resolved as argparse resolves them."""
    actions = magic.parser._option_string_actions
    given = {}
    for token in shlex.split(line):
        if not token.startswith("-") or token == "--":
            continue
        flag = token.split("=", 1)[0]
        if flag not in actions and not flag.startswith("--"):
            flag = flag[:2]  # -n2
        matches = [f for f in actions if f == flag] or [
            f for f in actions if flag.startswith("--") and f.startswith(flag)
        ]
        if len(matches) == 1:
            given[actions[matches[0]].dest] = matches[0]
    return given


def check_session_cell_options(args: argparse.Namespace, given: dict[str, str], mirror_mode: str) -> None:
    """A session cell's options: UsageError for a flag that would change the session's workers,
    ``--on-error discard`` (a live rank cannot roll a cell back), ``--export`` under ``--mirror
    none``, and what check_cell_options refuses."""
    changing = [flag for flag in given.values() if flag in WORKER_FLAGS]
    if changing:
        flag = "-n" if changing[0] == "--nprocs" else changing[0]
        raise UsageError(
            f"%%enot_distributed {flag}: a session is running, and {flag} would change its workers; "
            f"run `%enot_session restart {flag} ...` to start them again with it, or add --fresh to run "
            "this cell as a one-off launch"
        )
    if given.get("on_error") and args.on_error == "discard":
        raise UsageError(
            "%%enot_distributed --on-error discard: a session's ranks live on and cannot roll a failed cell "
            "back; the notebook keeps the master's state at the failure, as a local cell keeps its partial "
            "changes. Drop the flag, or add --fresh to run this cell as a one-off launch"
        )
    if args.export and mirror_mode == "none":
        raise UsageError(
            "%%enot_distributed --export: refused under --mirror none, where the notebook does not hold "
            "the session's state; pull what the script needs first (%enot_pull NAME)"
        )
    check_cell_options(args)


def _wait_for_imports(info: Any = None) -> None:
    """Before a cell that imports what a distributed cell's master left to import (see preload):
    those imports are done first, so that the cell never imports the same packages beside them;
    any other cell runs at once."""
    code = getattr(info, "raw_cell", None)
    if code is None or preload.PRELOADER.must_wait_for(code):
        preload.PRELOADER.wait()


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """``%load_ext enot_nb``: register ``%%enot_distributed``."""
    if ipython is None:
        raise UsageError("enot_nb's magic needs IPython: run `%load_ext enot_nb` in a notebook")
    ipython.register_magics(EnotMagics)
    if _wait_for_imports not in ipython.events.callbacks["pre_run_cell"]:
        ipython.events.register("pre_run_cell", _wait_for_imports)
    cleanup = ipython.input_transformers_cleanup
    if check_cell_syntax not in cleanup:
        cleanup.append(check_cell_syntax)
