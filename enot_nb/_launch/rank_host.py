"""Where a session's ranks run, as the kernel side sees them: one interface, written down as
torch elastic's ``PContext`` writes its own (see below for what stays above it). A session's
kernel side (_session/kernel/workers) talks to its
ranks only through it::

    start(serve)            the ranks started with their environment (torchrun's variables, the
                            rendezvous), each running ``serve`` (the session loop); back once
                            every rank is connected, else WorkerFailedError
    put_task(main, buffers) the task laid out where every rank reads it; its size
    send(command, ranks)    a command to each running rank, as one step
    poll(timeout)           what the ranks sent, received: output (shown as ``show`` says),
                            display data, and each rank's messages and outcome, into its record
                            (``ranks``: outcome, payload, partial, groups, pushed); deaths learnt
    wait(seconds, until)    poll until ``until()`` holds, or for ``seconds`` at most
    dump_stacks(ranks)      where each rank is, as its dump's text (stack, collectives: see attempt.where_ranks_are)
    interrupt(ranks)        KeyboardInterrupt raised in each rank
    stop(ranks)             the ranks ended: asked, then forced
    peers()                 the ends (address, port) of the ranks' TCP sockets: a rank cuts its
                            connections with them when it aborts its groups (_processes/sockets)
    cpu_seconds(rank)       the rank's CPU time so far: its progress while it does not answer
    meeting_point()         where the ranks meet to make their world group again (a fresh one)
    load(payload)           a rank's result, loaded
    resident_mib(rank)      the rank's resident memory (for the session's table), or None
    why_ended(rank)         how a dead rank ended, in words (a signal's name, an exit code)
    show(output)            whose output is shown ("master", "all", "none"), prefixed by rank
    location(rank)          (node, node IP) where the rank runs, for the table; None: this machine
    device(rank)            the rank's device as the host assigned it; None: the plan's (LOCAL_RANK's)
    close()                 every rank ended, everything released; it can run again

``LocalRanks`` (_launch/local_ranks.py): processes of this machine (fork or a fork server, pidfds,
pipes and socket pairs, a memfd task file, the watchdog). ``RayRanks`` (_launch/ray_ranks.py,
``engine="ray"``): one Ray actor per rank, each starting its rank as a local child on its node
and relaying its traffic (ray_agent).

Above it, nothing opens a pipe, reads ``/proc``, maps a task file or sends a signal: a rank's
record (``ranks``) carries what it answered and whether it runs; ``pid`` is the host's name for
it (shown in the session's table); ``peers()`` names the ranks by their sockets' ends, which
mean the same on every node (a rank finds its own connections with them, see
_session/worker/groups). One-off launches still run on
an ``Attempt`` directly (the local engine this implementation is built on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from enot_nb._launch.ranks import Rank
from enot_nb._processes.protocol import Payload, SessionCommand
from enot_nb._processes.sockets import End
from enot_nb.errors import WorkerFailure


class RankHost(Protocol):
    """Where a session's ranks run (see the module's docstring)."""

    @property
    def ranks(self) -> list[Rank]:
        """Each rank's record: what it answered, whether it runs."""
        ...

    failures: list[WorkerFailure]
    """The failures seen since the caller last emptied it (a raised error, a death)."""

    def start(self, serve: Callable[..., Any]) -> None: ...

    def put_task(self, main: bytes, buffers: Sequence[Any]) -> int: ...

    def send(self, command: SessionCommand, ranks: list[Rank]) -> None: ...

    def poll(self, timeout: float | None) -> None: ...

    def wait(self, seconds: float, until: Callable[[], bool]) -> None: ...

    def dump_stacks(self, ranks: list[Rank]) -> dict[int, str]: ...

    def interrupt(self, ranks: list[Rank]) -> None: ...

    def stop(self, ranks: list[Rank]) -> None: ...

    def peers(self) -> tuple[End, ...]: ...

    def cpu_seconds(self, rank: Rank) -> float | None: ...

    def meeting_point(self) -> str: ...

    def load(self, payload: Payload) -> Any: ...

    def resident_mib(self, rank: Rank) -> float | None: ...

    def why_ended(self, rank: Rank) -> str: ...

    def show(self, output: str) -> None: ...

    def location(self, rank: Rank) -> tuple[str, str] | None: ...

    def device(self, rank: Rank) -> str | None: ...

    def close(self) -> None: ...
