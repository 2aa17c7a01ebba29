"""One-off distributed cells: ``%%enot_distributed`` without a session (the counterpart of
sessions.py, which runs a cell on a session's workers).

The magic parses the options (magic.py); ``run_distributed_cell`` walks what the cell reaches,
launches it on N processes (launcher.launch_job), and makes the notebook hold what the master
holds (bring_back); a failure or a stop press leaves the notebook as the options say. The worker
side is _worker/cell.py.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from IPython.core.error import UsageError

from enot_nb._launch import relay
from enot_nb._launch.bring_back import CellInterrupted, bring_back
from enot_nb._launch.notes import NOTES
from enot_nb._launch.options import LaunchOptions, in_magic_words
from enot_nb._launch.plan import LaunchPlan
from enot_nb._log import unwarned
from enot_nb._state import apply, reach
from enot_nb._state.registry import Registry
from enot_nb._worker import bootstrap, preload
from enot_nb._worker import cell as _cell
from enot_nb.errors import LaunchConfigError, LaunchInterrupted, WorkerFailedError
from enot_nb.launcher import launch_job

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


def option_names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad or not names:
        raise UsageError(f"expected NAME[,NAME...], got {text!r}; e.g. --sync model,ema")
    return names


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
        sync=option_names(args.sync),
        no_sync=args.no_sync,
        returns=option_names(args.returns),
        no_return=args.no_return,
        source_header=f"%%enot_distributed {line}\n",
        shown=args.output != "none",
        keep_on_error=args.on_error == "keep",
        future_flags=_cell.notebook_future_flags(shell),
        check_replicas=args.check_replicas,
    )
    compile(code, _cell.CELL_FILENAME, "exec")  # a syntax error: raised before anything starts
    check_sync(shell.user_ns, options.sync)
    try:
        return _run_cell_job(shell, code, args, options, plan)
    finally:
        preload.PRELOADER.start_pending()  # what the master imported; the next cell waits for it


def _run_cell_job(
    shell: InteractiveShell, code: str, args: argparse.Namespace, options: _cell.CellOptions, plan: LaunchPlan
) -> Any:
    namespace = shell.user_ns
    with unwarned():
        job, registry = _cell_job(shell, code, options, plan.start_method)
    failure: BaseException | None = None
    try:
        outcome: _cell.CellOutcome | None = launch_job(plan, job, namespace=namespace, on_message=relay.show)
    except LaunchInterrupted as err:
        with unwarned():
            _after_interrupt(shell, registry, options, err.partial_result)
        failure = CellInterrupted()
    except WorkerFailedError as err:
        with unwarned():
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
    with unwarned():
        return bring_back(shell.user_ns, registry, outcome, options).value


def check_sync(namespace: dict[str, Any], names: list[str] | None) -> None:
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
        _cell.run_shipped_cell, (values, left_out, objects, code, options, registry.parents), gather_shards=False
    ), registry


def _export(shell: InteractiveShell, code: str, args: argparse.Namespace) -> None:
    from enot_nb.export import export_cell

    options = launch_options(args)  # every launch option, as the exported script takes it
    exported_options = {
        k: v
        for k, v in vars(options).items()
        if k not in ("start_method", "node_rank", "max_restarts", "hang_after")  # no launcher there
    }
    exported_options["timeout"] = cast(datetime.timedelta, options.timeout).total_seconds()  # see LaunchOptions
    try:
        exported = export_cell(
            code,
            args.export,
            shell.user_ns,
            sync=option_names(args.sync),
            no_sync=args.no_sync,
            returns=option_names(args.returns),
            no_return=args.no_return,
            check_replicas=args.check_replicas,
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
