"""What the launcher, its workers and its fork server say to each other: one record per message.

How the records travel (framed pickles, descriptors in batches) is
``enot_nb._processes.framing``. Each message is a NamedTuple, read with ``match`` on its
class: a kind and its fields cannot disagree, and a reader that forgets a kind fails the type
check (``assert_never``), not a notebook.

worker -> launcher, on one message pipe per rank, in this order::

    Connected()                       past init_process_group and the first barrier
    Display(data, metadata, ...)      \\
    ClearOutput(wait)                  > what its front end publishes (see frontend, relay)
    CommMessage(msg_type, ...)        /
    Partial(payload)                  rank 0's state at an interrupt or failure
    then exactly one of Result(payload) (rank 0), Done(), ErrorReport(...): its outcome

A session's worker (see _session/worker/loop) also reads commands from its message socket
(RunTask, ReportGroups, AbortGroups, Regroup, Repair, StopWorker) and answers each task with an outcome;
it may send Groups(sequence) and DeviceMemory on the way. Every message, outcomes included, is
sent after a fence in the worker's output streams (see OUTPUT_FENCE).

A payload is InMemfd(size) (written into the result memfd) or Inline(data) (pickle bytes).
launcher <-> fork server, on its Unix socket: Ready, Launch (+ descriptors laid out by
LaunchFds), Started (+ a pidfd per rank) or StartFailed, Exit (see forkserver).
"""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

from enot_nb._processes.framing import LaunchFds

# Written by a worker into its stdout and stderr pipes just before each message (see
# bootstrap.send): the launcher shows the output before it, then the message, then
# what follows (output.Fenced), so prints, display data and widgets keep the worker's order.
# An APC escape sequence: a terminal that ever received it would show nothing.
OUTPUT_FENCE = b"\x1b_enot_nb\x1b\\"


# ----------------------------------------------------------------------------- payloads


class InMemfd(NamedTuple):
    """A result laid out in the launch's result memfd (result_file.write_result)."""

    size: int


class Inline(NamedTuple):
    """A result pickled into the message itself: where no memfd exists (result_file.dump_inline),
    or a small one on a Ray rank (its out-of-band buffers beside it, see bootstrap)."""

    data: bytes
    buffers: tuple[bytes, ...] = ()


Payload: TypeAlias = InMemfd | Inline


def payload_size(payload: Payload) -> int:
    """The bytes a payload carries, wherever it lies."""
    return payload.size if isinstance(payload, InMemfd) else len(payload.data) + sum(map(len, payload.buffers))


# ----------------------------------------------------------------------------- worker -> launcher


class Connected(NamedTuple):
    """The rank got past init_process_group and the first barrier: user code may run."""


class Display(NamedTuple):
    """What IPython's display publisher was given in the worker."""

    data: dict
    metadata: dict
    transient: dict
    update: bool


class ClearOutput(NamedTuple):
    """``IPython.display.clear_output(wait)`` in the worker."""

    wait: bool


class CommMessage(NamedTuple):
    """What a worker's comm (a widget) would publish on iopub."""

    msg_type: str
    """comm_open, comm_msg or comm_close."""
    content: dict
    metadata: dict
    buffers: list[bytes]
    topic: bytes


class Partial(NamedTuple):
    """Rank 0's state at an interrupt or failure, sent before its error (a stopped cell keeps
    what it reached)."""

    payload: Payload


class Imported(NamedTuple):
    """The modules a cell's master imported while the cell ran, that the kernel may import too
    (see preload): sent once the cell ended, whether it failed or not."""

    modules: tuple[str, ...]


class Groups(NamedTuple):
    """A session rank's answer to ``ReportGroups``: the sequence number (how many collectives it
    began) of each process group it belongs to, by the group's name; None where a backend does
    not count. Equal on every member of each group: no collective was left half done, so the
    groups may be kept after a failed cell."""

    sequences: dict[str, int] | None


class Pushed(NamedTuple):
    """A session rank applied a task's push and waits for ``Proceed``: the cell runs on no rank
    unless every rank could apply it."""


class DeviceMemory(NamedTuple):
    """A session rank's GPU memory after a task (where it uses CUDA), for the session's table."""

    allocated_mib: float
    reserved_mib: float


class Result(NamedTuple):
    """Rank 0's outcome: what the function returned (or the cell's changes)."""

    payload: Payload


class Done(NamedTuple):
    """The outcome of a rank other than 0 that finished."""


class ErrorReport(NamedTuple):
    """The outcome of a rank that raised (or called sys.exit)."""

    type: str | None
    """The exception's class name; None for sys.exit."""
    message: str
    traceback: str | None
    exitcode: int
    connecting: bool = False
    """It failed while the ranks were connecting (gloo's connectFullMesh), before any user code
    ran: the launcher starts the attempt again (see launcher.run_plan)."""
    collectives: str = ""
    """A collective timed out: the rank's collectives as it failed (_worker/collectives.encoded),
    which the kernel sets beside the other ranks'; empty otherwise."""


class InputRequest(NamedTuple):
    """A session rank asks the notebook's front end for a line (``input()``, the debugger): the
    kernel shows ``shown`` (what the rank's debugger printed since its last prompt: shown
    whatever --output says), asks with ``prompt`` (naming the rank) and answers InputReply."""

    prompt: str
    shown: str = ""
    password: bool = False


class InputReply(NamedTuple):
    """The line typed, without its newline; None where the front end has no stdin (``error``:
    ipykernel's StdinNotImplementedError's words) or where the cell is being stopped
    (``interrupted``: a stop press, a peer's failure; the rank's debugger closes)."""

    line: str | None
    error: str = ""
    interrupted: bool = False


FrontEndMessage: TypeAlias = Display | ClearOutput | CommMessage
"""What the kernel publishes for the ranks whose output is shown (relay.show)."""
FencedMessage: TypeAlias = Connected | Partial | Imported | FrontEndMessage
"""What a worker fences its output for: shown between what it printed before and after."""
WorkerMessage: TypeAlias = FencedMessage | Groups | Pushed | DeviceMemory | InputRequest | Result | Done | ErrorReport


RankOutcome: TypeAlias = "Result | Done | ErrorReport"
"""A rank's outcome: the last message it sends (for a session's rank, per task)."""


# ----------------------------------------------------------------------------- launcher -> session worker
# A session's worker (see _session/worker/loop) reads these from its message socket while idle,
# and answers each with one outcome (Result on rank 0, Done elsewhere, or ErrorReport).


class RunTask(NamedTuple):
    """Run the task laid out in the session's task file (result_file's layout, ``size`` bytes):
    a Task pickled against the mirror's objects; ``specs`` say where each object it refers to
    sits in the rank's namespace (see _session/mirror/paths)."""

    size: int
    specs: tuple
    objects: int
    storages: int
    parent: dict | None = None
    """The message the kernel answers now (its cell's): the rank's widgets hang under it."""
    confirm: bool = False
    """The task carries a push: each rank answers ``Pushed`` once it applied it, then waits for
    ``Proceed``."""
    task: int = 0
    """The task's number: a ``Proceed`` meant for an earlier, interrupted task is not this one's."""


class Proceed(NamedTuple):
    """After every rank answered a push (``Pushed``, or an error): run the task (``go``), or skip it
    (a rank could not apply the push: it runs nowhere; each rank answers Done)."""

    go: bool
    task: int = 0


class ReportGroups(NamedTuple):
    """Answer with ``Groups``: after a failed cell, whether the process groups are still whole."""


class AbortGroups(NamedTuple):
    """Abort every process group: a peer blocked in a collective with this rank is released.
    ``peers``: the ends (address, port) of the ranks' TCP sockets; this rank's connections with
    them are shut down (see _processes/sockets)."""

    peers: tuple[tuple[str, int], ...]


class Regroup(NamedTuple):
    """Make the world group again (every rank gets this), meeting at ``init_method``."""

    init_method: str


class Repair(NamedTuple):
    """After a failed or interrupted command, the group kept or made again: every DDP wrapper
    moved onto the current world group with its reducer reset, and the replicated state made
    the master's where it differs (every rank gets this; each answers Done, or ErrorReport)."""


class StopWorker(NamedTuple):
    """Leave the loop: the session is closing."""


SessionCommand: TypeAlias = RunTask | Proceed | InputReply | ReportGroups | AbortGroups | Regroup | Repair | StopWorker


# ----------------------------------------------------------------------------- fork server


class Ready(NamedTuple):
    """fork server -> launcher: torch is imported, launches may come."""

    pid: int


class Launch(NamedTuple):
    """launcher -> fork server: start one worker per spec (descriptors follow, see LaunchFds)."""

    launch_id: int
    specs: list
    job_bytes: bytes
    layout: LaunchFds


class Preload(NamedTuple):
    """launcher -> fork server: import these modules before the next launch (see preload)."""

    modules: tuple[str, ...]


CallerMessage: TypeAlias = Launch | Preload
"""What the launcher sends the fork server."""


class Started(NamedTuple):
    """fork server -> launcher: every worker runs (a pidfd per rank follows, in rank order)."""

    launch_id: int
    pids: dict[int, int]


class StartFailed(NamedTuple):
    """fork server -> launcher: the workers could not be started; none is left."""

    launch_id: int
    errno: int | None
    reason: str


class Exit(NamedTuple):
    """fork server -> launcher: a worker ended and was reaped (its group killed first)."""

    launch_id: int
    rank: int
    exitcode: int


ServerMessage: TypeAlias = Ready | Started | StartFailed | Exit
"""What the fork server sends."""
