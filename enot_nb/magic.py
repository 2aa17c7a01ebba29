"""``%%enot_distributed``: run a notebook cell on every process and keep the notebook's state.

The magic only parses its options; :func:`run_distributed_cell` does the work, and the worker
side lives in :mod:`enot_nb._cell`.

Example::

    %load_ext enot_nb

    %%enot_distributed -n 2 --backend gloo --seed 0
    model = train(model)          # runs on 2 processes; `model` is updated in the notebook
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from enot_nb import _cell, _worker
from enot_nb.errors import LaunchError
from enot_nb.launcher import LaunchConfigError, LaunchPlan, launch_job, plan_launch


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad or not names:
        raise UsageError(f"expected NAME[,NAME...], got {text!r}; e.g. --sync model,ema")
    return names


@magics_class
class EnotMagics(Magics):
    """The ``%%enot_distributed`` cell magic."""

    @magic_arguments()
    @argument("-n", "--nprocs", type=int, default=None,
              help="processes to start (default: one per visible GPU)")
    @argument("--backend", default=None, help="nccl or gloo (default: nccl when each rank has a GPU)")
    @argument("--seed", type=int, default=None, help="seed random, NumPy and torch on every rank")
    @argument("--speed", action="store_true", help="cuDNN benchmark and TF32 (init_torch's "
              "cuda_optimize_for_speed)")
    @argument("--reproducible", action="store_true", help="deterministic algorithms (init_torch's "
              "cuda_reproducible)")
    @argument("--start-method", choices=["fork", "spawn"], default=None,
              help="fork the kernel, or start clean workers (default: fork unless CUDA is "
              "initialized in the kernel)")
    @argument("--output", choices=["master", "all", "none"], default="master",
              help="whose output to show (default: master)")
    @argument("--sync", default=None, metavar="NAME[,NAME]",
              help="models to sync before the cell (default: every model the cell uses)")
    @argument("--no-sync", action="store_true", help="do not sync models before the cell")
    @argument("--return", dest="returns", default=None, metavar="NAME[,NAME]",
              help="bring back only these variables (default: all the cell bound or changed)")
    @argument("--no-return", action="store_true", help="bring nothing back")
    @argument("--timeout", type=float, default=1800.0, metavar="SECONDS",
              help="process group timeout for collectives (default: 1800)")
    @argument("--master-addr", default="127.0.0.1", help="address of node 0 (multi-node)")
    @argument("--master-port", type=int, default=None, help="port on node 0 (default: a free one)")
    @argument("--nnodes", type=int, default=1, help="number of nodes running this cell")
    @argument("--node-rank", type=int, default=0, help="rank of this node")
    @argument("--max-restarts", type=int, default=0, help="restart a failed group this many times")
    @argument("--export", default=None, metavar="PATH",
              help="do not run: write a torchrun script for this cell at PATH, with the variables "
              "it uses beside it (see enot_nb.load_results)")
    @cell_magic
    def enot_distributed(self, line: str, cell: str) -> Any:
        """Run this cell on several processes; the master's results come back to the notebook."""
        args, plan = parse_options(line)
        return run_distributed_cell(self.shell, cell, args, plan, line)


@dataclass
class _Bundle:
    """Shows display data computed in a worker as this cell's Out."""

    data: dict
    metadata: dict

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
        return self.data, self.metadata


def parse_options(line: str) -> tuple[Any, LaunchPlan | None]:
    """The magic's options and the launch they describe (None with --export); UsageError
    (no traceback) if bad."""
    args = parse_argstring(EnotMagics.enot_distributed, line)
    if args.sync and args.no_sync:
        raise UsageError("--sync and --no-sync contradict each other; keep one")
    if args.returns and args.no_return:
        raise UsageError("--return and --no-return contradict each other; keep one")
    _names(args.sync)
    _names(args.returns)
    if args.export:  # nothing starts here; torchrun decides the processes (-n may be omitted)
        if args.speed and args.reproducible:
            raise UsageError("%%enot_distributed: --speed and --reproducible are mutually exclusive")
        return args, None
    try:
        plan = plan_launch(args.nprocs, args.backend, args.seed, args.speed, args.reproducible,
                           args.start_method, args.output, args.master_addr, args.master_port,
                           args.nnodes, args.node_rank, args.max_restarts, args.timeout)
    except LaunchConfigError as err:
        raise UsageError(f"%%enot_distributed: {err}".replace("nprocs=N", "-n N")) from None
    except RuntimeError as err:  # both CUDA flags
        raise UsageError(f"%%enot_distributed: {err} (--speed, --reproducible)") from None
    return args, plan


def run_distributed_cell(shell: Any, cell: str, args: Any, plan: LaunchPlan | None,
                         line: str = "") -> Any:
    """Run ``cell`` as ``args``/``plan`` ask; apply the master's state to the notebook."""
    if shell is None:
        raise UsageError("%%enot_distributed runs inside IPython or Jupyter; elsewhere call "
                         "enot_nb.notebook_launcher(fn, nprocs=N)")
    code = shell.transform_cell(cell)
    if args.export:
        return _export(shell, code, args)
    assert plan is not None
    options = _cell.CellOptions(
        sync=_names(args.sync), no_sync=args.no_sync, returns=_names(args.returns),
        no_return=args.no_return, source_header=f"%%enot_distributed {line}\n",
        shown=args.output != "none",
    )
    try:
        compile(code, _cell.CELL_FILENAME, "exec")
    except SyntaxError:
        shell.showsyntaxerror()
        return None
    plan.on_message = _show_message
    if plan.start_method == "fork":
        job = _worker.Job(_cell.run_cell, (code, shell.user_ns, options))
    else:
        job = _worker.Job(_run_shipped_cell, _cell.shippable_namespace(shell.user_ns, code) + (code, options))
    try:
        outcome: _cell.CellOutcome | None = launch_job(plan, job)
    except LaunchError as err:
        if "could not be loaded" in str(err):
            raise LaunchError(f"{err}. Choose what comes back with --return NAME[,NAME], or skip it "
                              "with --no-return") from err.__cause__
        raise
    if outcome is None:  # this node has no global rank 0
        return None
    return _bring_back(shell, outcome)


def _export(shell: Any, code: str, args: Any) -> None:
    from enot_nb.export import export_cell

    try:
        exported = export_cell(
            code, args.export, shell.user_ns, nprocs=args.nprocs, nnodes=args.nnodes,
            backend=args.backend, seed=args.seed, cuda_optimize_for_speed=args.speed,
            cuda_reproducible=args.reproducible, output=args.output, sync=_names(args.sync),
            no_sync=args.no_sync, returns=_names(args.returns), no_return=args.no_return,
            timeout=args.timeout, master_addr=args.master_addr, master_port=args.master_port)
    except SyntaxError:
        shell.showsyntaxerror()
        return None
    except OSError as err:
        raise UsageError(f"--export {args.export}: cannot write there ({err})") from None
    print(exported.describe())
    return None


def _show_message(kind: str, payload: Any) -> None:
    from IPython.display import clear_output, publish_display_data

    if kind == "display":
        publish_display_data(payload["data"], payload["metadata"], transient=payload["transient"],
                             update=payload["update"])
    elif kind == "clear_output":
        clear_output(wait=payload)


def _run_shipped_cell(values: dict[str, Any], left_out: dict[str, str], code: str,
                      options: _cell.CellOptions) -> Any:
    """Worker side under spawn: the shipped variables become the cell's namespace."""
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    namespace.update(values)
    try:
        return _cell.run_cell(code, namespace, options)
    except NameError as err:
        if err.name in left_out:
            raise NameError(
                f"variable {err.name!r} could not be sent to the workers: {left_out[err.name]}. "
                "Create it inside this cell, or use --start-method fork"
            ) from err
        raise


def _bring_back(shell: Any, outcome: _cell.CellOutcome) -> Any:
    state = outcome.state
    _cell.apply_state(shell.user_ns, state)
    for name, reason in outcome.not_returned.items():
        print(f"enot_nb: {name!r} was not brought back: {reason}", file=sys.stderr)
    if outcome.moved_to_cpu:
        print(f"enot_nb: {outcome.moved_to_cpu} CUDA tensor(s) came back on the CPU, so this kernel "
              "does not initialize CUDA and later cells still start fast", file=sys.stderr)
    if not outcome.has_value:
        return None
    if outcome.value_name is not None:
        return shell.user_ns[outcome.value_name]
    if "value" in state:
        return state["value"]
    return _Bundle(*outcome.value_bundle) if outcome.value_bundle else None


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext enot_nb``: register ``%%enot_distributed``."""
    if ipython is None:
        raise UsageError("enot_nb's magic needs IPython: run `%load_ext enot_nb` in a notebook")
    ipython.register_magics(EnotMagics)
