"""Do the replicas still agree? Every tensor replicated by construction (see replicas: DDP's
parameters and buffers, a replicated optimizer's state) compared across the ranks, each rank
against the master, as ``Session.check()``, ``%enot_session check`` and ``%%enot_distributed
--check-replicas`` ask.

A checksum per replica, taken where its bytes live and gathered from every rank, finds the ones
that differ at the cost of one pass over the bytes; only those travel (the master's, broadcast
one at a time), so that each rank measures its own distance from the master (the maximum
absolute difference). Sharded state is named as sharded, never compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from enot_nb._memory.digests import device_checksum
from enot_nb._worker.held import HELD_KINDS, imported_classes, reach, tracked
from enot_nb._worker.replicas import Replica, agreed, replicated_by_construction

_NAMED_AT_MOST = 20
"""How many differing tensors the report's text names (then how many more)."""


class ReplicaDifference(NamedTuple):
    """A replica on one rank that is not the master's."""

    where: str
    """How the rank's variables reach it (``ddp.module.0.weight``)."""
    rank: int
    max_abs_difference: float
    """The largest absolute difference from the master's, elementwise (0.0 where only the
    bits differ, as -0.0 and 0.0 do; nan where one side holds a nan the other does not)."""
    resynced: bool = False
    """A buffer DDP sends from rank 0 at its next forward (BatchNorm's running statistics
    differ between forwards by design): named, but no disagreement."""


@dataclass
class ReplicaReport:
    """What a replica check found: ``differences`` empty and ``not_everywhere`` too when the
    ranks agree (``agree``). Shown as a short text in a notebook."""

    ranks: int
    compared: int
    """How many replicated tensors every rank holds under the same name and size."""
    differences: list[ReplicaDifference] = field(default_factory=list)
    sharded: list[str] = field(default_factory=list)
    """Sharded state (ZeRO, FSDP, DTensor shards), with what it is: each rank holds its own."""
    not_everywhere: list[str] = field(default_factory=list)
    """The master's replicas that some rank does not hold under the same name and size."""
    not_everywhere_elsewhere: int = 0
    """The most replicas a rank holds that some rank does not."""

    @property
    def drifted(self) -> list[ReplicaDifference]:
        """The differences DDP will not undo: all but buffers it sends from rank 0 at its next forward."""
        return [d for d in self.differences if not d.resynced]

    @property
    def agree(self) -> bool:
        """No replica drifted, and every rank holds the same ones."""
        return not self.drifted and not self.not_everywhere and not self.not_everywhere_elsewhere

    def __str__(self) -> str:
        if not self.compared and not self.not_everywhere and not self.not_everywhere_elsewhere:
            lines = [
                "enot_nb: no replicated state to compare (DDP parameters and buffers, a replicated optimizer's state)"
            ]
        else:
            verdict = "the replicas agree" if self.agree else f"{len(self.drifted)} difference(s)"
            lines = [f"enot_nb: replica check on {self.ranks} ranks: {self.compared} tensor(s) compared, {verdict}"]
        drifted = self.drifted
        for d in drifted[:_NAMED_AT_MOST]:
            lines.append(f"  {d.where}: rank {d.rank} differs from rank 0, max abs difference {_shown(d)}")
        if len(drifted) > _NAMED_AT_MOST:
            lines.append(f"  and {len(drifted) - _NAMED_AT_MOST} more")
        resynced = sorted({d.where for d in self.differences if d.resynced})
        if resynced:
            lines.append(
                f"  buffers that DDP sends from rank 0 at its next forward differ, as after any forward: "
                f"{_listed(resynced)}"
            )
        if self.not_everywhere or self.not_everywhere_elsewhere:
            named = _listed(self.not_everywhere) or f"{self.not_everywhere_elsewhere} that rank 0 does not hold"
            lines.append(f"  not held alike on every rank, not compared: {named}")
        if self.sharded:
            lines.append(f"  sharded, not compared: {_listed(self.sharded)}")
        if drifted:
            lines.append(
                "  to make a model rank 0's again: enot_nb.distributed.sync_model(model, reduce_parameters=False, "
                "reduce_buffers=False); in a session, a stopped or failed cell makes every replica the master's, "
                "optimizer state included"
            )
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))


def _listed(places: list[str]) -> str:
    shown = ", ".join(places[:_NAMED_AT_MOST])
    return shown + (f" and {len(places) - _NAMED_AT_MOST} more" if len(places) > _NAMED_AT_MOST else "")


def _shown(difference: ReplicaDifference) -> str:
    value = difference.max_abs_difference
    if value == 0.0:
        return "0.0 (the bits differ)"
    return repr(float(f"{value:.6g}")) if math.isfinite(value) else repr(value)


def check_replicas(namespace: dict[str, Any]) -> ReplicaReport:
    """Compare what the rank's variables hold replicated by construction with the master's;
    the same report on every rank. A collective: every rank calls it, after the same cells."""
    import torch.distributed as dist

    held = reach(namespace, tracked(imported_classes(*HELD_KINDS)))
    replication = replicated_by_construction(held)
    agreement = agreed(replication.replicas)
    return ReplicaReport(
        ranks=dist.get_world_size(),
        compared=len(agreement.common),
        differences=_differences(agreement.common, agreement.device),
        sharded=[str(s) for s in replication.sharded],
        not_everywhere=agreement.apart if dist.get_rank() == 0 else [],
        not_everywhere_elsewhere=agreement.apart_elsewhere,
    )


def _differences(common: list[Replica], device: Any) -> list[ReplicaDifference]:
    """Each of ``common`` (the same replicas, in one order, on every rank) that differs from
    the master's on some rank, and by how much there."""
    import torch
    import torch.distributed as dist

    if not common:
        return []
    world = dist.get_world_size()
    sums = torch.tensor([device_checksum(r.storage)[1] for r in common], dtype=torch.int64, device=device)
    every = [torch.empty_like(sums) for _ in range(world)]
    dist.all_gather(every, sums)
    table = torch.stack(every).cpu()  # [rank, replica]
    differs = (table != table[0]).any(dim=0).nonzero().flatten().tolist()
    if not differs:
        return []
    mine = torch.zeros(len(differs), dtype=torch.float64, device=device)
    for j, i in enumerate(differs):
        local = common[i].tensor.detach().to(device).contiguous()
        master = local.clone() if dist.get_rank() == 0 else torch.empty_like(local)
        dist.broadcast(master, 0)
        mine[j] = _max_abs_difference(local, master)
    distances = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(distances, mine)
    by_rank = torch.stack(distances).cpu()
    return [
        ReplicaDifference(common[i].where, rank, float(by_rank[rank, j]), common[i].resynced)
        for j, i in enumerate(differs)
        for rank in range(1, world)
        if table[rank, i] != table[0, i]
    ]


def _max_abs_difference(mine: Any, master: Any) -> Any:
    """The largest elementwise distance between two tensors of one shape, as a float64 scalar
    tensor; a nan both hold at the same place is no difference."""
    import torch

    if mine.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=mine.device)
    wide = torch.complex128 if mine.is_complex() else torch.float64
    a, b = mine.to(wide), master.to(wide)
    distance = (a - b).abs().to(torch.float64)
    both_nan = torch.isnan(a) & torch.isnan(b)
    return torch.where(both_nan, torch.zeros_like(distance), distance).max()
