"""The functional API for distributed training (the ENOT ``enot.distributed`` reference).

The same code runs unchanged in a single process, in a worker started by
[enot_nb.notebook_launcher][] or ``%%enot_distributed``, and under ``torchrun`` on one node or
several: everything is driven by torchrun's environment variables (``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

Example:
    ```python
    from enot_nb.distributed import init_torch, is_master, sync_model
    init_torch(seed=0, backend="gloo")   # no-op group set-up when WORLD_SIZE is unset or 1
    model = make_model()
    sync_model(model)                    # identical weights on every rank
    if is_master():
        print("hello once")
    ```
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import random
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from enot_nb._defaults import DEFAULT_TIMEOUT
from enot_nb._runtime.devices import device_for
from enot_nb._runtime.env import read_layout
from enot_nb._runtime.ray_rank import RayContext, context
from enot_nb._runtime.sync import collective_device, sync_model
from enot_nb.errors import DistributedRuntimeException, LaunchConfigError

__all__ = [
    "DistributedRuntimeException",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "init_torch",
    "is_dist",
    "is_local_master",
    "is_master",
    "master_first",
    "master_only",
    "ray_context",
    "sync_model",
]

# cuBLAS needs a fixed workspace for deterministic results (CUDA docs, "Results reproducibility").
_CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"

F = TypeVar("F", bound=Callable[..., Any])


def init_process_group(
    backend: str = "nccl",
    init_method: str = "env://",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Create the default process group when ``WORLD_SIZE > 1``; otherwise do nothing.

    The arguments are those of torch's
    [torch.distributed.init_process_group](https://docs.pytorch.org/docs/stable/distributed.html#torch.distributed.init_process_group).

    Args:
        backend: ``backend`` of torch's ``init_process_group`` ("nccl" or "gloo").
        init_method: ``init_method`` of torch's ``init_process_group``.
        timeout: ``timeout`` of torch's ``init_process_group``.

    With ``nccl`` the current CUDA device is set to ``LOCAL_RANK`` and CUDA is initialized.
    Calling it again once the group exists is a no-op.

    Raises:
        DistributedRuntimeException: bad ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``, nccl without a
            GPU for this local rank, or any failure inside torch's own initialization (chained).
    """
    layout = read_layout()
    if layout.world_size == 1 or dist.is_available() and dist.is_initialized():
        return
    if not dist.is_available():
        raise DistributedRuntimeException(
            "this PyTorch build has no torch.distributed support; install a build that has it"
        )
    if backend == "nccl":
        _select_cuda_device(layout.local_rank)
    try:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            timeout=timeout,
            world_size=layout.world_size,
            rank=layout.rank,
        )
    except Exception as err:
        raise DistributedRuntimeException(
            f"rank {layout.rank}: torch.distributed.init_process_group(backend={backend!r}, "
            f"init_method={init_method!r}) failed: {type(err).__name__}: {err}. Check that "
            f"MASTER_ADDR={os.environ.get('MASTER_ADDR')!r} and "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')!r} reach rank 0, that every rank was "
            "started, and that the backend is available"
        ) from err


def _select_cuda_device(local_rank: int) -> None:
    """Bind this process to GPU ``local_rank`` and initialize CUDA, as nccl requires."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        index = device_for(local_rank, visible)
    except ValueError as err:
        raise DistributedRuntimeException(str(err)) from None
    torch.cuda.set_device(index)
    torch.cuda.init()


def init_torch(
    seed: int | None = None,
    cuda_optimize_for_speed: bool = False,
    cuda_reproducible: bool = False,
    backend: str = "nccl",
    init_method: str = "env://",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> None:
    """Seed, set the cuDNN/cuBLAS flags, and create the process group.

    The group is made by [init_process_group][enot_nb.distributed.init_process_group].

    Args:
        seed: seeds Python's ``random``, NumPy and torch (every device); None leaves them alone.
        cuda_optimize_for_speed: cuDNN benchmark mode and TF32 matmuls (not reproducible).
        cuda_reproducible: deterministic cuDNN, deterministic algorithms and the cuBLAS
            workspace setting they need (may be slower).
        backend: passed to ``init_process_group``.
        init_method: passed to ``init_process_group``.
        timeout: passed to ``init_process_group``.

    Raises:
        RuntimeError: both CUDA flags are set (checked before anything is touched).
        LaunchConfigError: (a ValueError) ``seed`` is not an int in [0, 2**32) or None.
        DistributedRuntimeException: the process group could not be created.
    """
    if cuda_optimize_for_speed and cuda_reproducible:
        raise RuntimeError("cuda_optimize_for_speed and cuda_reproducible are mutually exclusive; set at most one")
    if seed is not None:
        # Checked before any generator is seeded: a bad seed leaves them all as they were.
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise LaunchConfigError(
                f"seed={seed!r} must be an int in [0, 2**32) (NumPy's range) or None", parameter="seed"
            )
        _seed_everything(seed)
    if cuda_optimize_for_speed:
        torch.backends.cudnn.benchmark = True
        torch.backends.cudnn.deterministic = False
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if cuda_reproducible:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", _CUBLAS_DETERMINISTIC_WORKSPACE)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
        torch.use_deterministic_algorithms(True)
    init_process_group(backend=backend, init_method=init_method, timeout=timeout)


def _seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seeding accepts 32 bits only
    torch.manual_seed(seed)  # seeds every CUDA device too, lazily, without initializing CUDA


def is_dist() -> bool:
    """Whether torch.distributed is initialized with more than one process.

    Returns:
        False in a single process, or before the process group exists.

    Example:
        ```python
        if is_dist():
            torch.distributed.barrier()
        ```
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_world_size() -> int:
    """Number of processes in the job.

    Returns:
        The process group's size; before it exists, ``WORLD_SIZE`` (1 in a single process).

    Example:
        ```python
        batch_per_rank = global_batch // get_world_size()
        ```
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return read_layout().world_size


def get_rank() -> int:
    """Global rank of this process.

    Returns:
        Its rank in the process group; before it exists, ``RANK`` (0 in a single process).

    Example:
        ```python
        sampler = DistributedSampler(data, num_replicas=get_world_size(), rank=get_rank())
        ```
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return read_layout().rank


def get_local_rank() -> int:
    """Rank of this process on its node.

    Returns:
        ``LOCAL_RANK`` (0 in a single process): the GPU this process uses.

    Example:
        ```python
        device = torch.device("cuda", get_local_rank())
        ```
    """
    return read_layout().local_rank


def is_master() -> bool:
    """Whether this is the global master (global rank 0).

    Returns:
        True on global rank 0 (and in a single process).

    Example:
        ```python
        if is_master():
            torch.save(model.state_dict(), "model.pt")
        ```
    """
    return get_rank() == 0


def is_local_master() -> bool:
    """Whether this is the master of its node (local rank 0).

    Returns:
        True on local rank 0 of every node (so on one process per node, unlike is_master).

    Example:
        ```python
        if is_local_master():
            download_dataset_to_local_disk()
        ```
    """
    return get_local_rank() == 0


def master_only(fn: F) -> F:
    """Decorate ``fn`` to run on the global master only; other ranks get None.

    Args:
        fn: the function to run on global rank 0.

    Returns:
        A wrapper that calls ``fn`` on the master and returns None elsewhere.

    Example:
        ```python
        @master_only
        def log(msg):
            print(msg)
        ```
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_master():
            return fn(*args, **kwargs)
        return None

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def master_first() -> Iterator[None]:
    """Run the block on the master first, then on every other rank (downloads, caches).

    The others wait until the master leaves the block.

    Raises:
        DistributedRuntimeException: on the other ranks, where the master's block raised (they
            do not wait forever).

    Example:
        ```python
        with master_first():
            data = torchvision.datasets.MNIST(root, download=True)
        ```
    """
    if not is_dist():
        yield
        return
    if is_master():
        try:
            yield
        except BaseException:
            _broadcast_master_status(ok=False)
            raise
        _broadcast_master_status(ok=True)
    else:
        if not _broadcast_master_status(ok=True):
            raise DistributedRuntimeException(
                f"rank {get_rank()}: the master (rank 0) failed inside master_first(), so this "
                "rank did not run the block; see rank 0's error"
            )
        yield


def _broadcast_master_status(ok: bool) -> bool:
    device = collective_device()
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def ray_context() -> RayContext:
    """Where this rank of a session on Ray runs: its node, its agent actor, its bundle and GPUs.

    A rank is a child of its Ray actor, not a Ray worker, and Ray's own API refuses to run in it
    (it would connect the rank to the cluster as a new driver): this answers from what the actor
    handed the rank when it started it.

    Returns:
        The rank's ``RayContext`` (``node_id``, ``node_ip``, ``actor_id``, ``actor_name``,
        ``placement_group_id``, ``bundle_index``, ``gpu_ids``).

    Raises:
        RuntimeError: this process is not a rank of a session on Ray.

    Example:
        ```python
        %%enot_distributed
        from enot_nb.distributed import ray_context
        print(get_rank(), ray_context().node_ip)
        ```
    """
    found = context()
    if found is None:
        raise RuntimeError(
            "ray_context() answers in a rank of a session on Ray only (`%enot_session start --engine ray`); "
            "this process is not one"
        )
    return found
