"""The trivial job every launcher runs: join a gloo/nccl group, one all_reduce, leave.

Also a script: ``torchrun --nproc-per-node 2 benchmarks/trivial_job.py``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def one_all_reduce() -> float:
    """What runs inside a group that is already initialized (enot_nb's launcher did it)."""
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    value = torch.ones(1, device=device)
    dist.all_reduce(value)
    return value.item()


def init_and_all_reduce(*_: object) -> float:
    """For launchers that only start processes (Accelerate, multiprocessing, torchrun)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    result = one_all_reduce()
    dist.destroy_process_group()
    return result


def spawned(index: int, port: int, world_size: int) -> None:
    """Entry point for torch.multiprocessing's spawn (rank = index)."""
    os.environ.update(
        WORLD_SIZE=str(world_size),
        RANK=str(index),
        LOCAL_RANK=str(index),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    init_and_all_reduce()


if __name__ == "__main__":
    init_and_all_reduce()
