"""A session's table: a row per rank (pid, device, state, memory, cells, uptime), rich in a
notebook, plain text elsewhere (``%enot_session``, ``Session.status()``)."""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

from enot_nb._launch.plan import LaunchPlan
from enot_nb._session.kernel.workers import RankState, SessionWorkers


@dataclass
class RankStatus:
    """One row of ``Session.status()``."""

    rank: int
    pid: int | None
    device: str
    state: str
    rss_mib: float | None
    gpu_allocated_mib: float | None
    gpu_reserved_mib: float | None
    cells: int
    uptime_s: float
    node: str | None = None
    """The node it runs on, where the ranks run on a cluster (the Ray engine); None: here."""
    node_ip: str | None = None


@dataclass
class SessionStatus:
    """The session's ranks, a row each: a table in a notebook, plain text elsewhere."""

    rows: list[RankStatus] = field(default_factory=list)
    backend: str = ""
    mirror: str = "all"

    _COLUMNS = ("rank", "pid", "device", "state", "RSS (MiB)", "GPU alloc/reserved (MiB)", "cells", "uptime (s)")

    @property
    def _on_nodes(self) -> bool:
        return any(row.node is not None for row in self.rows)

    def _columns(self) -> tuple[str, ...]:
        return ("rank", "node", "node IP", *self._COLUMNS[1:]) if self._on_nodes else self._COLUMNS

    def _cells(self, row: RankStatus) -> list[str]:
        gpu = "-" if row.gpu_allocated_mib is None else f"{row.gpu_allocated_mib:.0f}/{row.gpu_reserved_mib or 0:.0f}"
        rss = "-" if row.rss_mib is None else f"{row.rss_mib:.0f}"
        where = [row.node or "-", row.node_ip or "-"] if self._on_nodes else []
        rest = [str(row.pid), row.device, row.state, rss, gpu, str(row.cells), f"{row.uptime_s:.0f}"]
        return [str(row.rank), *where, *rest]

    def __str__(self) -> str:
        columns = self._columns()
        table = [list(columns)] + [self._cells(r) for r in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
        return "\n".join([f"enot_nb session: {len(self.rows)} rank(s), {self.backend}, --mirror {self.mirror}", *lines])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self._columns())
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>" for r in self.rows
        )
        caption = html.escape(f"enot_nb session: {len(self.rows)} rank(s), {self.backend}, --mirror {self.mirror}")
        return f"<table><caption>{caption}</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def devices(plan: LaunchPlan) -> list[str]:
    """Each rank's device: its GPU under nccl (LOCAL_RANK's), else the CPU."""
    return [f"cuda:{r}" for r in range(plan.nprocs)] if plan.backend == "nccl" else ["cpu"] * plan.nprocs


def status_of(workers: SessionWorkers | None, plan: LaunchPlan, mirror: str) -> SessionStatus:
    status = SessionStatus(backend=plan.backend, mirror=mirror)
    if workers is None:
        return status
    workers.host.poll(0)  # a rank that died since its last task shows as dead
    uptime = time.monotonic() - workers.started_at
    for r in workers.host.ranks:
        state = RankState.IDLE if r.running else RankState.DEAD
        memory = r.device_memory  # (allocated, reserved) MiB after its last task, where CUDA is used
        node, node_ip = workers.host.location(r) or (None, None)
        status.rows.append(
            RankStatus(
                rank=r.rank,
                pid=r.pid,
                device=workers.host.device(r) or devices(plan)[r.rank],
                state=state.value,
                rss_mib=workers.host.resident_mib(r) if state is not RankState.DEAD else None,
                gpu_allocated_mib=memory[0] if memory else None,
                gpu_reserved_mib=memory[1] if memory else None,
                cells=workers.cells,
                uptime_s=uptime,
                node=node,
                node_ip=node_ip,
            )
        )
    return status
