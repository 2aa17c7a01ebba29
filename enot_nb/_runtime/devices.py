"""Which backend and which GPU: pure decisions, unit-tested on the CPU (no GPU needed to check
the logic a single lent GPU cannot exercise)."""

from __future__ import annotations


def default_backend(nprocs: int, gpus: int) -> str:
    """nccl when every local rank has a GPU of its own, else gloo."""
    return "nccl" if gpus >= nprocs > 0 else "gloo"


def device_for(local_rank: int, visible: int) -> int:
    """The CUDA device index of a local rank: one GPU per rank, in order of CUDA_VISIBLE_DEVICES.

    Raises:
        ValueError: no GPU is visible, or fewer than the local ranks (the message says what to do).
    """
    if visible <= 0:
        raise ValueError(
            "backend 'nccl' needs CUDA, but no GPU is available to this process; use backend='gloo' to train on the CPU"
        )
    if not 0 <= local_rank < visible:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but only {visible} GPU(s) are visible; start at "
            f"most {visible} processes per node with nccl, or use backend='gloo'"
        )
    return local_rank
