"""The ranks' collectives side by side: each rank's last one and where it waits, and the mismatch
when there is one ("rank 1 waits in all_reduce #812 on WORLD, float32[1024]; rank 0 is in
broadcast #813 on WORLD, float32[1024]", "rank 0 never reached all_reduce #812 on WORLD: it is at
Cell In[7], line 4"). Built from the snapshots the ranks' stack dumps carry (see
_worker/collectives), on a stop press and when no rank makes progress (see hang_watch).

A rank's collectives stay "scheduled" in torch's recorder under gloo, so where a rank waits is
told by comparing sequence numbers across the ranks: on one group, a rank whose last collective
has a lower number than another's waiting one never reached it.
"""

from __future__ import annotations

from typing import Any

from enot_nb._launch.ranks import Rank
from enot_nb._launch.tracebacks import as_in_the_notebook
from enot_nb._processes.protocol import ErrorReport
from enot_nb._worker.cell import CELL_FILENAME
from enot_nb._worker.collectives import Collective, Snapshot, decoded

TIMED_OUT = "a collective timed out (the process group's --timeout); where each rank stood:"
"""The line before the table when a rank's collective timed out."""


def timed_out(ranks: list[Rank]) -> dict[int, Snapshot]:
    """The snapshots the ranks whose collective timed out sent with their error (see
    _worker/collectives.timed_out)."""
    found = {}
    for r in ranks:
        if isinstance(r.outcome, ErrorReport) and r.outcome.collectives:
            snapshot = decoded(r.outcome.collectives)[1]
            if snapshot is not None:
                found[r.rank] = snapshot
    return found


def split_dumps(dumps: dict[int, str]) -> tuple[dict[int, str], dict[int, Snapshot]]:
    """Each rank's dump without its snapshot's line, and the snapshots found."""
    texts, snapshots = {}, {}
    for rank, text in dumps.items():
        texts[rank], found = decoded(text)
        if found is not None:
            snapshots[rank] = found
    return texts, snapshots


def table(snapshots: dict[int, Snapshot], shell: Any = None) -> str | None:
    """The short table: a line per rank, then what the ranks' numbers say; None where no rank
    has issued a collective (or none reported)."""
    if not any(s.collectives for s in snapshots.values()):
        return None
    ranks = sorted(snapshots)
    lines = ["enot_nb: each rank's last collective (#: its number on its group):"]
    for rank in ranks:
        if not snapshots[rank].collectives:
            where = _place(snapshots[rank].at, shell)
            lines.append(f"  rank {rank}: no collective yet{f', at {where}' if where else ''}")
            continue
        shown = _shown(snapshots[rank])
        state = "waiting in it" if shown.waiting else "done"
        where = _place(shown.line if shown.waiting else snapshots[rank].at, shell)
        lines.append(f"  rank {rank}: {shown.named()}, {state}{f', at {where}' if where else ''}")
    if not all(snapshots[r].recorded for r in ranks):
        lines.append("  (torch keeps no record of the ops here: the numbers say how far each rank got)")
    lines += [f"enot_nb: {finding}" for finding in findings(snapshots, shell)]
    return "\n".join(lines)


def findings(snapshots: dict[int, Snapshot], shell: Any = None) -> list[str]:
    """What the numbers say, per group where some rank waits: the ranks that never reached its
    collective, those in another one or past it, or that every rank waits in the same one. Without
    the recorder: the ranks whose count on a group is behind another's."""
    said: list[str] = []
    groups = sorted({c.group for s in snapshots.values() for c in s.collectives})
    for group in groups:
        last = {r: c for r, s in snapshots.items() if (c := _last_on(s, group)) is not None}
        if group == "WORLD":  # every rank is in it: one that recorded none there has not reached any
            last |= {r: Collective("none", group, 0, "", False, None) for r, s in snapshots.items() if r not in last}
        waiting = {r: w for r, s in snapshots.items() if (w := _waiting_on(s, group)) is not None}
        if not waiting:
            said += _behind(last, snapshots, shell) if not all(s.recorded for s in snapshots.values()) else []
            continue
        ahead, top = max(waiting.items(), key=lambda item: (item[1].seq, -item[0]))
        before = len(said)
        for rank in sorted(last):
            mine, latest = waiting.get(rank), last[rank]
            if rank == ahead or (mine is not None and _same(mine, top)):
                continue
            if mine is not None:
                said.append(f"rank {rank} waits in {mine.named()}; rank {ahead} is in {top.named()}")
            elif latest.seq < top.seq:
                where = _place(snapshots[rank].at, shell)
                said.append(f"rank {rank} never reached {top.named()}{f': it is at {where}' if where else ''}")
            elif latest.seq == top.seq and not _same(latest, top):
                said.append(f"rank {rank} issued {latest.named()} (done there); rank {ahead} waits in {top.named()}")
            elif latest.seq > top.seq:
                said.append(f"rank {rank} is past {top.named()}: its last is {latest.named()}")
        if len(said) == before and len(waiting) == len(last):
            said.append(f"every rank waits in {top.named()}: none is missing, one may be slow")
    return said


def _behind(last: dict[int, Collective], snapshots: dict[int, Snapshot], shell: Any) -> list[str]:
    """Without the recorder: the ranks whose count on a group is below the highest."""
    if not last:
        return []
    ahead, top = max(last.items(), key=lambda item: (item[1].seq, -item[0]))
    said = []
    for rank, mine in sorted(last.items()):
        if mine.seq < top.seq:
            where = _place(snapshots[rank].at, shell)
            said.append(
                f"rank {rank} ran {mine.seq} collective(s) on {top.group}, rank {ahead} {top.seq}: rank {rank} never "
                f"reached the next one{f': it is at {where}' if where else ''}"
            )
    return said


def _shown(snapshot: Snapshot) -> Collective:
    """The collective a rank's line shows: the one it waits in (the latest), else its latest."""
    waiting = [c for c in snapshot.collectives if c.waiting]
    return max(waiting or snapshot.collectives, key=lambda c: (c.group == "WORLD", c.seq))


def _waiting_on(snapshot: Snapshot, group: str) -> Collective | None:
    found = [c for c in snapshot.collectives if c.group == group and c.waiting]
    return max(found, key=lambda c: c.seq) if found else None


def _last_on(snapshot: Snapshot, group: str) -> Collective | None:
    found = [c for c in snapshot.collectives if c.group == group]
    return max(found, key=lambda c: c.seq) if found else None


def _same(a: Collective, b: Collective) -> bool:
    return (a.seq, a.op, a.tensors) == (b.seq, b.op, b.tensors)


def _place(line: tuple[str, int] | None, shell: Any) -> str | None:
    """A frame in the notebook's words: the running cell's ``Cell In[N], line L``, a function
    a notebook cell defined as IPython names it, else its file and line."""
    if line is None:
        return None
    filename, number = line
    if filename == CELL_FILENAME:
        count = getattr(shell if shell is not None else _shell(), "execution_count", None)
        return f"Cell In[{count}], line {number}" if count is not None else f"the cell, line {number}"
    named = as_in_the_notebook(f'File "{filename}", line {number}', shell) or ""
    return named.removeprefix("File ")


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()
