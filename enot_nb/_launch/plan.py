"""The validated plan of a launch (built by enot_nb.launcher.plan_launch, run by attempt)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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

    @property
    def world_size(self) -> int:
        return self.nprocs * self.nnodes
