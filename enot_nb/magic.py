"""``%%enot_distributed``: run a notebook cell on every process and keep the notebook's state.

The magic only parses its options; :func:`run_distributed_cell` does the work, and the worker
side lives in :mod:`enot_nb._worker.cell`.

Example::

    %load_ext enot_nb

    %%enot_distributed -n 2 --backend gloo --seed 0
    model = train(model)          # runs on 2 processes; `model` is updated in the notebook
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from enot_nb._defaults import DEFAULT_TIMEOUT
from enot_nb._launch import relay
from enot_nb._launch.bring_back import CellInterrupted, bring_back
from enot_nb._launch.notes import NOTES
from enot_nb._launch.options import LaunchOptions
from enot_nb._processes import preload
from enot_nb._state import apply, reach
from enot_nb._state.registry import Registry
from enot_nb._worker import bootstrap
from enot_nb._worker import cell as _cell
from enot_nb.errors import LaunchError, LaunchInterrupted, WorkerFailedError
from enot_nb.launcher import LaunchConfigError, LaunchPlan, launch_job, plan_launch

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad or not names:
        raise UsageError(f"expected NAME[,NAME...], got {text!r}; e.g. --sync model,ema")
    return names


# The options that decide the workers, defined once: a one-off cell's (%%enot_distributed) and a
# session's (%enot_session start / restart). A session cell refuses them (WORKER_FLAGS).
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
    @_with_arguments(_WORKER_ARGUMENTS[6], *_NODE_ARGUMENTS)
    @argument(
        "--export",
        default=None,
        metavar="PATH",
        help="do not run: write a torchrun script for this cell at PATH, with the variables "
        "it uses beside it (see enot_nb.load_results)",
    )
    @argument("--fresh", action="store_true", help="while a session runs: run this cell as a one-off launch")
    @cell_magic
    def enot_distributed(self, line: str, cell: str) -> Any:
        """Run this cell on several processes; the master's results come back to the notebook.
        While a session runs (%enot_session start), the cell runs on its workers."""
        from enot_nb.sessions import session

        live = session()
        if live is not None:
            args = parse_argstring(EnotMagics.enot_distributed, line)
            if not args.fresh:
                return run_session_cell(self.shell, live, cell, args, line)
        args, plan = parse_options(line)
        return run_distributed_cell(self.shell, cell, args, plan, line)

    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        choices=["start", "stop", "restart", "status"],
        default="status",
        help="start the session's workers, stop them, start them again, or show them (the default)",
    )
    @_with_arguments(*_WORKER_ARGUMENTS)
    @argument(
        "--mirror",
        choices=["all", "none"],
        default="all",
        help="all: the notebook mirrors the master after every cell, and plain cells' changes reach "
        "every rank; none: nothing flows unless asked (%%enot_pull, session.push)",
    )
    @line_magic
    def enot_session(self, line: str) -> Any:
        """Workers that live across cells: ``%enot_session start -n 2``, ``%enot_session``
        (their table), ``%enot_session restart``, ``%enot_session stop``."""
        return run_session_magic(self.shell, line)

    @line_magic
    def enot_pull(self, line: str) -> None:
        """``%enot_pull NAME[,NAME]``: bind the session master's values in the notebook."""
        from enot_nb.sessions import session

        live = session()
        if live is None:
            raise UsageError("%enot_pull: no session is running; start one with `%enot_session start -n N`")
        names = [n for n in line.replace(",", " ").split() if n]
        bad = [n for n in names if not n.isidentifier()]
        if bad or not names:
            raise UsageError(
                f"%enot_pull NAME[,NAME]: name the variables to bring back, e.g. %enot_pull model (got {line!r})"
            )
        live.pull(*names)


def check_cell_options(args: argparse.Namespace) -> None:
    """The per-cell options a one-off cell and a session cell share: UsageError if they
    contradict each other or name no variable."""
    if args.sync and args.no_sync:
        raise UsageError("--sync and --no-sync contradict each other; keep one")
    if args.returns and args.no_return:
        raise UsageError("--return and --no-return contradict each other; keep one")
    _names(args.sync)
    _names(args.returns)


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


# An option as the launcher's messages write it: name=value (a Python literal), or the bare name
# where it is no English word (nprocs, master_port; not backend, seed, output or timeout). Never
# inside a path or a longer name.
_ENGLISH = {"backend", "seed", "output", "timeout"}
_OPTION_WORDS = re.compile(
    r"(?<![\w/.-])("
    + "|".join(sorted(LaunchOptions.FLAGS, key=len, reverse=True))
    + r")(?:=('[^']*'|\"[^\"]*\"|[\w.+-]+)|(?![\w/.=-]))"
)


def in_magic_words(message: str) -> str:
    """A launcher message in the magic's words: ``nprocs=2, backend='gloo'`` -> ``-n 2,
    --backend gloo``, ``master_port=None`` -> ``no --master-port`` (the flags of
    LaunchOptions.FLAGS, the one definition of each option)."""

    def one(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        flag = LaunchOptions.FLAGS[name]
        if value is None:
            return match.group(0) if name in _ENGLISH else flag
        if value in ("None", "False"):
            return f"no {flag}"
        if value == "True":
            return flag
        text = value[1:-1] if value[:1] in "'\"" else value
        return f"{flag} {shlex.quote(text)}"

    return _OPTION_WORDS.sub(one, message)


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    """The magic's parsed flags as LaunchOptions (the field each flag sets: LaunchOptions.FLAGS)."""
    dests = {"cuda_optimize_for_speed": "speed", "cuda_reproducible": "reproducible"}
    return LaunchOptions(**{name: getattr(args, dests.get(name, name)) for name in LaunchOptions.names()})


def run_distributed_cell(
    shell: InteractiveShell | None, cell: str, args: argparse.Namespace, plan: LaunchPlan | None, line: str = ""
) -> Any:
    """Run ``cell`` as ``args``/``plan`` ask; make the notebook hold what the master holds."""
    if shell is None:
        raise UsageError(
            "%%enot_distributed runs inside IPython or Jupyter; elsewhere call enot_nb.notebook_launcher(fn, nprocs=N)"
        )
    code = transformed(shell, cell)
    NOTES.start_cell()  # a failed or --no-return cell leaves no notes: last_notes() says so
    if args.export:
        return _export(shell, code, args)
    assert plan is not None
    options = _cell.CellOptions(
        sync=_names(args.sync),
        no_sync=args.no_sync,
        returns=_names(args.returns),
        no_return=args.no_return,
        source_header=f"%%enot_distributed {line}\n",
        shown=args.output != "none",
        keep_on_error=args.on_error == "keep",
    )
    compile(code, _cell.CELL_FILENAME, "exec")  # a syntax error: raised before anything starts
    _check_sync(shell.user_ns, options.sync)
    try:
        return _run_cell_job(shell, code, args, options, plan)
    finally:
        preload.PRELOADER.start_pending()  # what the master imported; the next cell waits for it


def _run_cell_job(
    shell: InteractiveShell, code: str, args: argparse.Namespace, options: _cell.CellOptions, plan: LaunchPlan
) -> Any:
    namespace = shell.user_ns
    job, registry = _cell_job(shell, code, options, plan.start_method)
    failure: BaseException | None = None
    try:
        outcome: _cell.CellOutcome | None = launch_job(plan, job, namespace=namespace, on_message=relay.show)
    except LaunchInterrupted as err:
        _after_interrupt(shell, registry, options, err.partial_result)
        failure = CellInterrupted()
    except WorkerFailedError as err:
        _after_failure(shell, registry, options, err.partial_result, code)
        failure = err.with_traceback(None)  # the launcher's frames hold the job
    if failure is not None:
        # IPython keeps the traceback (sys.last_traceback) until the next error: it must not
        # keep the notebook's objects alive, so neither may this frame.
        del job, registry
        raise failure
    if outcome is None:  # this node has no global rank 0
        return None
    if args.no_return:
        print("enot_nb: --no-return: nothing came back; the notebook is as it was before the cell", file=sys.stderr)
    return bring_back(shell.user_ns, registry, outcome, options).value


def _check_sync(namespace: dict[str, Any], names: list[str] | None) -> None:
    """--sync names models the notebook holds: checked here, before any process starts."""
    import torch

    for name in names or []:
        if name not in namespace:
            raise UsageError(
                f"--sync {name}: the notebook has no variable {name!r}; --sync takes "
                "the names of models (torch.nn.Module) to broadcast before the cell"
            )
        if not isinstance(namespace[name], torch.nn.Module):
            raise UsageError(
                f"--sync {name}: {name!r} is a {type(namespace[name]).__name__}, not a "
                "torch.nn.Module; --sync takes models"
            )


def _after_interrupt(shell: InteractiveShell, registry: Registry, options: _cell.CellOptions, partial: Any) -> None:
    if options.no_return:
        return
    if isinstance(partial, _cell.CellOutcome):
        bring_back(shell.user_ns, registry, partial, options, show_value=False)
        print(
            "enot_nb: interrupted; the notebook keeps the state rank 0 had reached, as a local cell would",
            file=sys.stderr,
        )
    else:
        print(
            "enot_nb: interrupted; rank 0 could not save its state in time (it was probably "
            "waiting in a collective), so the notebook is unchanged",
            file=sys.stderr,
        )


def _after_failure(
    shell: InteractiveShell, registry: Registry, options: _cell.CellOptions, partial: Any, code: str
) -> None:
    if options.keep_on_error and isinstance(partial, _cell.CellOutcome):
        bring_back(shell.user_ns, registry, partial, options, show_value=False)
        print(
            "enot_nb: --on-error keep: the notebook holds the state rank 0 had reached when the cell failed",
            file=sys.stderr,
        )
        return
    if options.keep_on_error:
        print(
            "enot_nb: --on-error keep: rank 0 sent no state (it did not fail in Python); the notebook is unchanged",
            file=sys.stderr,
        )
    if options.no_return:  # nothing was walked under fork: walk now, on this rare path
        registry = reach.reach(shell.user_ns, code, shell.user_ns_hidden).registry
    shared = apply.shared_memory_tensors(registry)
    if shared:
        print(
            f"enot_nb: the cell failed, so the notebook is unchanged, except {shared} tensor(s) "
            "in shared memory (share_memory_()), which may hold partial writes",
            file=sys.stderr,
        )


def _cell_job(
    shell: InteractiveShell, code: str, options: _cell.CellOptions, start_method: str
) -> tuple[bootstrap.Job, Registry]:
    """The job that runs the cell in each worker, and the registry of the notebook's objects it
    may change."""
    namespace = shell.user_ns
    if start_method == "fork":
        # The workers inherit these objects at the same addresses: index i names one object on
        # both sides, so only what changed needs to come back. Only what the cell can reach can
        # change; with --no-return nothing comes back, so nothing is walked.
        if options.no_return:
            registry = Registry.of_namespace(namespace, [])
        else:
            registry = reach.reach(namespace, code, shell.user_ns_hidden).registry
        return bootstrap.Job(_cell.run_cell, (code, namespace, options, registry), gather_shards=False), registry
    values, left_out, registry = reach.shippable_namespace(namespace, code)
    objects = reach.shippable_objects(registry, namespace)
    return bootstrap.Job(
        _cell.run_shipped_cell, (values, left_out, objects, code, options), gather_shards=False
    ), registry


def _export(shell: InteractiveShell, code: str, args: argparse.Namespace) -> None:
    from enot_nb.export import export_cell

    options = launch_options(args)  # every launch option, as the exported script takes it
    exported_options = {
        k: v for k, v in vars(options).items() if k not in ("start_method", "node_rank", "max_restarts")
    }
    exported_options["timeout"] = cast(datetime.timedelta, options.timeout).total_seconds()  # see LaunchOptions
    try:
        exported = export_cell(
            code,
            args.export,
            shell.user_ns,
            sync=_names(args.sync),
            no_sync=args.no_sync,
            returns=_names(args.returns),
            no_return=args.no_return,
            **exported_options,
        )
    except SyntaxError:
        shell.showsyntaxerror()
        return None
    except ValueError as err:  # a bad option (LaunchConfigError) or a planted link
        text = in_magic_words(str(err)) if isinstance(err, LaunchConfigError) else str(err)
        raise UsageError(f"%%enot_distributed --export: {text}") from None
    except OSError as err:
        raise UsageError(f"--export {args.export}: cannot write there ({err})") from None
    print(exported.describe())
    return None


# ----------------------------------------------------------------------------- sessions


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


def run_session_cell(shell: InteractiveShell | None, live: Any, cell: str, args: argparse.Namespace, line: str) -> Any:
    """``%%enot_distributed`` while a session runs: the cell runs on the session's workers."""
    from enot_nb._launch.session_flow import CellRun

    if shell is None:
        raise UsageError("%%enot_distributed runs inside IPython or Jupyter")
    given = given_options(EnotMagics.enot_distributed, line)
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
    if args.export:
        if live.mirror_mode == "none":
            raise UsageError(
                "%%enot_distributed --export: refused under --mirror none, where the notebook does not hold "
                "the session's state; pull what the script needs first (%enot_pull NAME)"
            )
        parsed, plan = parse_options(line)
        return run_distributed_cell(shell, cell, parsed, plan, line)
    check_cell_options(args)
    code = transformed(shell, cell)
    NOTES.start_cell()
    run = CellRun(
        output=args.output,
        returns=_names(args.returns),
        no_return=args.no_return,
        sync=None if args.no_sync else _names(args.sync),
        first_line=2,
        source_header=f"%%enot_distributed {line}\n",
    )
    _check_sync(shell.user_ns, run.sync)
    failure: BaseException | None = None
    try:
        return live.run_cell(code, run)
    except WorkerFailedError as err:
        failure = err.with_traceback(None)
    except LaunchError as err:  # a stale variable changed here, a closed session
        failure = UsageError(f"%%enot_distributed: {err}")
    raise failure


def run_session_magic(shell: InteractiveShell | None, line: str) -> Any:
    """``%enot_session [start|stop|restart|status] [options]``."""
    from enot_nb.sessions import Session, session

    args = parse_argstring(EnotMagics.enot_session, line)
    live = session()
    given = given_options(EnotMagics.enot_session, line)
    if args.action == "status":
        if given:
            raise UsageError("%enot_session: options go with start or restart, e.g. %enot_session start -n 2")
        if live is None:
            print("enot_nb: no session is running; start one with `%enot_session start -n N`")
            return None
        return live.status()
    if args.action == "stop":
        if live is None:
            print("enot_nb: no session is running")
            return None
        live.close()
        print("enot_nb: session stopped; its workers are gone, the notebook keeps what it holds", file=sys.stderr)
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
    try:
        plan_launch(LaunchOptions(**{k: v for k, v in options.items() if k != "mirror"}))  # checked first
        if live is not None:
            live.close()
        Session(**options, namespace=shell.user_ns if shell is not None else None)
    except LaunchConfigError as err:
        flag = LaunchOptions.FLAGS.get(err.parameter or "")
        raise UsageError(f"%enot_session{' ' + flag if flag else ''}: {in_magic_words(str(err))}") from None
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
    }
    options: dict[str, Any] = {}
    for name, dest in dests.items():
        keep = live is not None and dest not in given
        options[name] = getattr(live.options, name) if keep else getattr(args, dest)
    options["mirror"] = live.mirror_mode if live is not None and "mirror" not in given else args.mirror
    return options


def check_cell_syntax(lines: list[str]) -> list[str]:
    """An input transformer: a distributed cell's syntax error is raised while IPython prepares
    the cell, so it is shown and replied to exactly as a local cell's (no magic frames, and the
    execute reply is an error, which stops Run All, nbclient and papermill)."""
    if not lines or not lines[0].startswith("%%enot_distributed"):
        return lines
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return lines
    body = "".join(lines[1:])
    try:
        code = shell.transform_cell(body)
        compile(code, "<cell>", "exec")
    except SyntaxError as err:
        if err.lineno is not None:
            err.lineno += 1  # the %%enot_distributed line
        if err.end_lineno is not None:
            err.end_lineno += 1
        err.filename = shell.compile.cache("".join(lines), shell.execution_count, raw_code="".join(lines))
        raise
    _CHECKED.body, _CHECKED.code = body, code
    return lines


@dataclass
class _CheckedCell:
    """The body of the ``%%enot_distributed`` cell that check_cell_syntax last transformed, and
    the code it made: the magic, called next with that body, takes it instead of transforming
    it again (IPython's transforms tokenize the cell; twice was a third of what the magic adds
    to a session cell in the kernel)."""

    body: str = ""
    code: str = ""


_CHECKED = _CheckedCell()


def transformed(shell: InteractiveShell, cell: str) -> str:
    """``shell.transform_cell(cell)``: the code check_cell_syntax made of this very cell, where
    it just made it (taken once), else transformed now (the magic called from code)."""
    body, code = _CHECKED.body, _CHECKED.code
    _CHECKED.body = _CHECKED.code = ""
    return code if body and body == cell else shell.transform_cell(cell)


def _wait_for_imports(info: Any = None) -> None:
    """Before any cell: the imports a distributed cell's master left (see preload) are done, so
    that the cell never imports beside them."""
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
