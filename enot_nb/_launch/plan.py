"""The validated plan of a launch: what depends on this machine (GPUs, backends, addresses, the
start method), decided once by ``plan_launch`` for options already checked, and run by attempt."""

from __future__ import annotations

import datetime
import errno
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Any, cast

from enot_nb._launch.options import LaunchOptions
from enot_nb._processes import rendezvous as _rendezvous
from enot_nb._runtime.devices import default_backend
from enot_nb._worker import bootstrap
from enot_nb.errors import LaunchConfigError, LaunchError


@dataclass(frozen=True)
class LaunchPlan:
    """The validated launch: what every attempt starts."""

    nprocs: int
    nnodes: int
    node_rank: int
    backend: str
    start_method: str
    output: str
    master_addr: str
    """An IP literal (resolved once, by plan_launch)."""
    master_port: int | None
    threads: int
    init_kwargs: dict[str, Any]
    max_restarts: int
    run_id: str
    """TORCHELASTIC_RUN_ID: one per launch, the same on every node and every restart."""
    hang_after: float | None = None
    """LaunchOptions.hang_after."""

    @property
    def world_size(self) -> int:
        return self.nprocs * self.nnodes


def plan_launch(options: LaunchOptions) -> LaunchPlan:
    """Decide what depends on this machine (GPUs, backends, addresses, the start method) for
    options already checked; starts nothing."""
    if os.environ.get(bootstrap.WORKER_MARKER):
        raise LaunchError(
            "notebook_launcher was called inside a worker process; launches do not "
            "nest: call the function directly in the worker"
        )
    gpus = visible_gpu_count()
    nprocs = options.nprocs
    if nprocs is None:
        if gpus == 0:
            raise LaunchConfigError(
                "no GPU is visible, so nprocs cannot default to one process per "
                "GPU; pass nprocs=N (for example nprocs=2, backend='gloo')",
                parameter="nprocs",
            )
        nprocs = gpus
    backend = options.backend or default_backend(nprocs, gpus)
    if backend == "nccl" and nprocs > gpus:
        raise LaunchConfigError(
            f"backend='nccl' needs one GPU per process, but nprocs={nprocs} and "
            f"{gpus} GPU(s) are visible; lower nprocs or use backend='gloo'",
            parameter="nprocs",
        )
    _check_backend(backend)
    master_addr = _resolve(options.master_addr)
    _check_port_free(master_addr, options)
    return LaunchPlan(
        nprocs=nprocs,
        nnodes=options.nnodes,
        node_rank=options.node_rank,
        backend=backend,
        start_method=_choose_start_method(options.start_method),
        output=options.output,
        master_addr=master_addr,
        master_port=options.master_port,
        threads=_threads_per_worker(nprocs),
        max_restarts=options.max_restarts,
        hang_after=options.hang_after,
        run_id=(
            f"enot_nb-{master_addr}-{options.master_port}" if options.nnodes > 1 else f"enot_nb-{uuid.uuid4().hex[:12]}"
        ),
        init_kwargs=bootstrap.init_kwargs(
            options.seed,
            options.cuda_optimize_for_speed,
            options.cuda_reproducible,
            backend,
            cast(datetime.timedelta, options.timeout),  # a timedelta once checked (LaunchOptions)
        ),
    )


def _check_backend(backend: Any) -> None:
    """A backend torch.distributed has here (plugins registered with it included)."""
    import torch.distributed as dist

    if not isinstance(backend, str) or not backend:
        raise LaunchConfigError(f"backend={backend!r} must be a name such as 'nccl' or 'gloo'", parameter="backend")
    try:
        available = dist.is_available() and dist.is_backend_available(backend)
    except Exception:  # noqa: BLE001 - an unknown name may raise instead of answering False
        available = False
    if not available:
        known = [
            b for b in ("gloo", "nccl", "mpi", "ucc", "xccl") if dist.is_available() and dist.is_backend_available(b)
        ]
        raise LaunchConfigError(
            f"backend={backend!r} is not available in this PyTorch build; available here: {', '.join(known) or 'none'}",
            parameter="backend",
        )


def _resolve(master_addr: Any) -> str:
    """master_addr as an IP literal, resolved once, here, before anything starts."""
    if not isinstance(master_addr, str) or not master_addr:
        raise LaunchConfigError(
            f"master_addr={master_addr!r} must be a host name or an IP address (node 0's, as every node reaches it)",
            parameter="master_addr",
        )
    try:
        return _rendezvous.resolve(master_addr)
    except OSError as err:
        raise LaunchConfigError(
            f"master_addr={master_addr!r} cannot be resolved ({err}); give node 0's IP address instead",
            parameter="master_addr",
        ) from err


def visible_gpu_count() -> int:
    """GPUs this process may use, counted without initializing CUDA (NVML, as torch does)."""
    import torch

    return torch.cuda.device_count()  # 0 on a CPU build; NVML-based, so fork stays safe


def cuda_initialized() -> bool:
    """Whether this process has initialized CUDA (then a forked child cannot use it)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


_said_why_not_fork = False


def _choose_start_method(requested: str | None) -> str:
    global _said_why_not_fork
    can_fork = hasattr(os, "fork") and sys.platform != "darwin"
    if requested == "fork":
        if not can_fork:
            raise LaunchConfigError(
                "start_method='fork' is not available on this platform; use start_method='spawn' or None",
                parameter="start_method",
            )
        if cuda_initialized():
            raise LaunchConfigError(
                "start_method='fork' cannot be used: CUDA is already initialized in this process, "
                "and a forked worker cannot use CUDA. Use start_method=None or 'spawn', or restart "
                "the kernel and launch before any cell touches the GPU",
                parameter="start_method",
            )
        return "fork"
    if requested == "spawn" or not can_fork:
        return "spawn"
    if cuda_initialized():
        if not _said_why_not_fork:
            print(
                "enot_nb: CUDA is already initialized in this process, so workers start from a "
                "clean fork server instead of a fork of it (a forked child cannot use CUDA).",
                file=sys.stderr,
                flush=True,
            )
            _said_why_not_fork = True
        return "spawn"
    return "fork"


def _check_port_free(master_addr: str, options: LaunchOptions) -> None:
    """On node 0, an explicit master_port must be free where the store will bind it."""
    if options.master_port is None or options.node_rank != 0:
        return
    address = master_addr if options.nnodes > 1 else _rendezvous.loopback_for(master_addr)
    try:
        _rendezvous.listen(address, options.master_port).close()
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise LaunchConfigError(
                f"master_port={options.master_port} on {address} is busy (another process listens "
                "there); pass master_port=None to pick a free port",
                parameter="master_port",
            ) from err
        raise LaunchConfigError(
            f"cannot listen on {address}:{options.master_port}: {err}", parameter="master_port"
        ) from err


def _threads_per_worker(nprocs: int) -> int:
    """The user's OMP_NUM_THREADS if set, else this node's cores shared by its workers."""
    configured = os.environ.get("OMP_NUM_THREADS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // nprocs)
