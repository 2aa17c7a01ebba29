"""The process layout (rank, local rank, world size) read from torchrun's environment variables.

Kept apart from [enot_nb.distributed][] so that the launcher can validate the same variables
without importing torch.distributed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from enot_nb.errors import DistributedRuntimeException

_HOW_TO_FIX = (
    "launch with torchrun (or enot_nb.notebook_launcher), or set WORLD_SIZE, RANK and LOCAL_RANK "
    "to integers with 0 <= RANK < WORLD_SIZE"
)


@dataclass(frozen=True)
class Layout:
    """Where this process sits in the job: global rank, rank on its node, number of processes."""

    rank: int
    local_rank: int
    world_size: int


def _read_int(name: str, default: int | None, low: int, high: int | None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise DistributedRuntimeException(
                f"environment variable {name} is not set but WORLD_SIZE={os.environ.get('WORLD_SIZE')} "
                f"asks for a distributed run; {_HOW_TO_FIX}"
            )
        return default
    try:
        value = int(raw)
    except ValueError:
        raise DistributedRuntimeException(
            f"environment variable {name}={raw!r} is not an integer; {_HOW_TO_FIX}"
        ) from None
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise DistributedRuntimeException(
            f"environment variable {name}={value} is out of range (must be {bound}); {_HOW_TO_FIX}"
        )
    return value


def read_layout() -> Layout:
    """Validate and return the layout described by WORLD_SIZE, RANK and LOCAL_RANK.

    No WORLD_SIZE, or WORLD_SIZE=1, is a single process: rank 0 of 1. With WORLD_SIZE > 1,
    LOCAL_RANK is required and RANK defaults to LOCAL_RANK.

    Raises:
        DistributedRuntimeException: a variable is missing, not an integer, or out of range;
            the message names the variable, its value and the fix.
    """
    world_size = _read_int("WORLD_SIZE", default=1, low=1, high=None)
    if world_size == 1:
        return Layout(rank=0, local_rank=0, world_size=1)
    local_world_size = _read_int("LOCAL_WORLD_SIZE", default=world_size, low=1, high=world_size + 1)
    local_rank = _read_int("LOCAL_RANK", default=None, low=0, high=local_world_size)
    rank = _read_int("RANK", default=local_rank, low=0, high=world_size)
    return Layout(rank=rank, local_rank=local_rank, world_size=world_size)
