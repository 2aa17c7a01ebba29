"""``notebook_launcher``: run a function on N supervised worker processes from a notebook.

Data flow::

    caller (Jupyter kernel or any Python process)
      |  fork, from a clean thread                  (fast; when CUDA is not initialized here)
      |  or fork server <- cloudpickled job + fds   (when CUDA is initialized, or start_method="spawn")
      v
    workers, rank 0..N-1: init_torch -> fn(*args, **kwargs) -> os._exit
      |  fd 1, fd 2  -> pipes -> rank 0 (or every rank, prefixed) printed live in the notebook
      |  message pipe -> "result" (rank 0) / "done" / "error" with the worker's traceback
      |  process exit -> pidfd (forked here) or the fork server's "exit" message
      v
    caller: fn's result from rank 0, or WorkerFailedError naming the rank that failed first

The launch is a pipeline read top to bottom: validate -> plan each rank -> start -> supervise
-> collect -> close. Whatever happens (failure, interrupt, a bug here) ``close`` kills every
worker's process group and reaps it, so no process outlives the call.
"""

from __future__ import annotations

import datetime
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from enot_nb._defaults import DEFAULT_TIMEOUT
from enot_nb._launch import relay
from enot_nb._launch.attempt import RECONNECTS, Attempt
from enot_nb._launch.options import ConflictingFlagsError, LaunchOptions
from enot_nb._launch.plan import LaunchPlan, plan_launch
from enot_nb._log import unwarned
from enot_nb._processes.interrupts import finish, interrupts_deferred
from enot_nb._processes.protocol import FrontEndMessage
from enot_nb._serialize import picklers, shm
from enot_nb._worker import bootstrap
from enot_nb.errors import LaunchConfigError, LaunchError, WorkerFailedError, WorkerFailure

__all__ = [
    "ConflictingFlagsError",
    "LaunchConfigError",
    "LaunchOptions",
    "launch_job",
    "notebook_launcher",
    "plan_launch",
]


def notebook_launcher(
    fn: Callable[..., Any],
    args: tuple = (),
    kwargs: dict[str, Any] | None = None,
    nprocs: int | None = None,
    *,
    backend: str | None = None,
    seed: int | None = None,
    cuda_optimize_for_speed: bool = False,
    cuda_reproducible: bool = False,
    start_method: str | None = None,
    output: str = "master",
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    max_restarts: int = 0,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    hang_after: float | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` processes and return global rank 0's result.

    Each worker gets torchrun's variables (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), its share of the CPU
    threads, then runs [enot_nb.distributed.init_torch][] with the given options, then ``fn``.

    Args:
        fn: the function to run; under spawn it is shipped with cloudpickle, so functions and
            classes defined in notebook cells work.
        args: its positional arguments.
        kwargs: its keyword arguments.
        nprocs: processes on this node; None means one per visible GPU.
        backend: "nccl" or "gloo"; None picks nccl when every rank has its own GPU, else gloo.
        seed: passed to init_torch.
        cuda_optimize_for_speed: passed to init_torch.
        cuda_reproducible: passed to init_torch.
        start_method: "fork" (fork this process: fast, shares its memory) or "spawn" (workers
            start clean from a fork server); None forks unless CUDA is initialized here.
        output: "master" shows rank 0's output, "all" every rank's prefixed by ``[rank N]``,
            "none" nothing. Failing ranks' tracebacks are always shown.
        master_addr: the address of rank 0's rendezvous.
        master_port: its port; a free port is chosen when None.
        nnodes: run the same call on this many nodes; global rank is
            ``node_rank * nprocs + local_rank``. Nodes other than 0 return None.
        node_rank: this node's rank among them.
        max_restarts: start a failed group again up to this many times.
        timeout: the process group's timeout (how long a collective may wait).
        hang_after: when no rank has made progress (used CPU time) for this many seconds, show
            each rank's last collective and where it waits (the launch goes on); None: never.

    Returns:
        What ``fn`` returned on global rank 0.

    Raises:
        WorkerFailedError: a worker raised or died (the first failure is the root cause).
        ValueError: a bad argument, before any process starts.
        LaunchError: a launch from inside a worker, or while another launch runs.

    Example:
        ```python
        def train(lr):
            ...
            return model.state_dict()

        state = notebook_launcher(train, args=(0.1,), nprocs=2, backend="gloo")
        ```
    """
    if not callable(fn):
        raise LaunchConfigError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        hint = (
            f"; to start {args} processes pass nprocs={args}"
            if isinstance(args, int) and not isinstance(args, bool)
            else ""
        )
        raise LaunchConfigError(
            f"args={args!r} must be a tuple of fn's arguments, e.g. args=(0.1,){hint}", parameter="args"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise LaunchConfigError(f"kwargs={kwargs!r} must be a dict of fn's keyword arguments")
    options = LaunchOptions(
        nprocs=nprocs,
        backend=backend,
        seed=seed,
        cuda_optimize_for_speed=cuda_optimize_for_speed,
        cuda_reproducible=cuda_reproducible,
        start_method=start_method,
        output=output,
        master_addr=master_addr,
        master_port=master_port,
        nnodes=nnodes,
        node_rank=node_rank,
        max_restarts=max_restarts,
        timeout=timeout,
        hang_after=hang_after,
    )
    return launch_job(
        plan_launch(options),
        bootstrap.Job(fn, tuple(args), dict(kwargs or {})),
        on_message=relay.show if relay.in_ipython() else None,
    )


def launch_job(
    plan: LaunchPlan,
    job: bootstrap.Job,
    namespace: dict | None = None,
    on_message: Callable[[FrontEndMessage], None] | None = None,
) -> Any:
    """Run a job under a validated plan, one launch at a time per process. ``namespace``: the
    notebook's globals, which spawned copies of its functions keep sharing. ``on_message``:
    called with the front-end messages (Display, ...) of the ranks whose output is shown."""
    with _single_launch():
        shared: list[int] = []  # the shipped tensors' memfd, recorded the moment it is made

        def release() -> None:  # once, however often it runs
            shm.release_later([shared.pop() for _ in range(len(shared))])

        try:
            shipped = None
            if plan.start_method == "spawn":
                with unwarned():  # pickling reads the user's objects (see unwarned)
                    shipped = (_pickle_job(job, shared, namespace), shared)
            return run_plan(plan, job, shipped, on_message)
        finally:
            try:
                finish(release)
            finally:
                finish(release)  # a no-op, unless a press landed on the line above


def run_plan(
    plan: LaunchPlan,
    job: bootstrap.Job,
    shipped: tuple[bytes, list[int]] | None,
    on_message: Callable[[FrontEndMessage], None] | None = None,
) -> Any:
    """Run every attempt of a validated plan; return rank 0's result or raise the last failure."""
    root_causes: list[WorkerFailure] = []
    reconnects = 0
    attempt = 0
    while True:
        outcome = Attempt(plan, job, shipped, attempt, on_message).run()
        if outcome.ok:
            return outcome.result
        if outcome.reconnectable and reconnects < RECONNECTS:
            # Nothing of the user's ran: the same attempt starts again, not counted as a restart.
            reconnects += 1
            print(
                f"enot_nb: the ranks could not connect ({outcome.failures[0].summary()}); starting them again",
                file=sys.stderr,
                flush=True,
            )
            continue
        root_causes.append(outcome.failures[0])
        if attempt == plan.max_restarts:
            break
        print(
            f"enot_nb: {outcome.failures[0].summary()}; restarting ({attempt + 1} of {plan.max_restarts})",
            file=sys.stderr,
            flush=True,
        )
        attempt += 1
    raise WorkerFailedError(outcome.failures, root_causes, partial_result=outcome.partial)


# ----------------------------------------------------------------------------- validate


def _pickle_job(job: bootstrap.Job, owned: list[int], namespace: dict | None = None) -> bytes:
    """Pickle the job for spawned workers, naming the first piece that cannot be pickled."""
    pieces = {"fn": job.fn} | {f"args[{i}]": a for i, a in enumerate(job.args)}
    pieces |= {f"kwargs[{k!r}]": v for k, v in job.kwargs.items()}
    ship = {"namespace": namespace, "pickler_class": picklers.ShipPickler}
    for name, reason in picklers.unpicklable(pieces, **ship).items():
        raise LaunchConfigError(
            f"{name}: {reason}, but spawned workers need it pickled. Create it "
            "inside fn instead, or use start_method='fork'"
        )
    try:
        return picklers.dumps(job, owned, namespace)
    except Exception as err:  # noqa: BLE001 - e.g. a tensor that failed to copy
        raise LaunchConfigError(f"the job cannot be pickled: {err}") from err


_launch_lock = threading.Lock()


@contextmanager
def _single_launch() -> Iterator[None]:
    """One launch at a time per process. A stop press must not keep the lock: it is taken and
    recorded as one step, and released by a cleanup that a press cannot skip."""
    held: list[bool] = []

    def release() -> None:  # once, however often it runs
        if held:
            held.pop()
            _launch_lock.release()

    try:
        with interrupts_deferred():
            if _launch_lock.acquire(blocking=False):
                held.append(True)
        if not held:
            raise LaunchError(
                "another enot_nb launch is running in this process (from another "
                "thread); wait for it to finish, launches do not run concurrently"
            )
        yield
    finally:
        try:
            finish(release)
        finally:
            finish(release)  # a no-op, unless a press landed on the line above
