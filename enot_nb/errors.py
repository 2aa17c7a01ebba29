"""The exception hierarchy of enot_nb.

Every error the package raises derives from [EnotNbError][enot_nb.errors.EnotNbError]; each leaf also derives from
the builtin it refines, so ``except RuntimeError`` keeps working for users who do not know us.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class EnotNbError(Exception):
    """Root of every error raised by enot_nb."""


class DistributedRuntimeException(EnotNbError, RuntimeError):
    """A distributed set-up or collective failed (name kept from the ENOT reference API)."""


class LaunchError(EnotNbError, RuntimeError):
    """A launch could not start (nested launch, concurrent launch, fork server gone, processes
    started inside a worker)."""


class IncompatibleFrameworkError(EnotNbError, RuntimeError):
    """A framework in a worker has changed where enot_nb adapts it (see enot_nb._worker.frameworks)."""


class LaunchConfigError(EnotNbError, ValueError):
    """A launcher argument (or magic option) is invalid; raised before any process starts.

    Attributes:
        parameter: the option at fault (a field of LaunchOptions), or None.
    """

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter

    def __reduce__(self) -> tuple:
        return (type(self), (str(self), self.parameter))


_SIGNAL_HINTS = {
    "SIGSEGV": "a crash in native code (a C extension, CUDA or a bad pointer); the worker's "
    "stderr above may show where",
    "SIGABRT": "an abort in native code, e.g. a failed CUDA/NCCL/C++ assertion",
    "SIGBUS": "often a full /dev/shm (DataLoader workers; in Docker raise --shm-size)",
}


def sigkill_cause(before: int | None, after: int | None) -> str:
    """Who sent a SIGKILL, in words, from the OOM kill counts before and after it."""
    if before is None or after is None:
        return (
            "the out-of-memory killer if the kernel log says so (see `dmesg`), else a person, a scheduler "
            "(SLURM, Kubernetes) or another process; lower the batch size or nprocs if it was memory"
        )
    if after > before:
        return (
            "the kernel's out-of-memory killer (it counted an OOM kill in this cgroup); lower the batch size or nprocs"
        )
    return (
        "not the out-of-memory killer (the kernel counted none in this cgroup): a person, a scheduler "
        "(SLURM, Kubernetes), a parent process or `kill -9` sends SIGKILL"
    )


def signal_name_of(exitcode: int) -> str:
    """The name of the signal a negative exit code stands for (``-9``: ``"SIGKILL"``)."""
    import signal

    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


_PEER_LOSS_WORDS = (
    "Connection closed by peer",
    "Connection reset",
    "Broken pipe",
    "remote process",
    "communicator was aborted",
    "Socket Timeout",
    "ECONNRESET",
    "Connection refused",
    "closed by peer",
    "unexpected EOF",
)


@dataclass
class WorkerFailure:
    """What one worker's failure looked like from the launcher."""

    rank: int
    exitcode: int | None
    """Process exit code; ``-N`` for death by signal N (as multiprocessing reports it)."""
    signal_name: str | None
    error_type: str | None
    """Name of the exception class the worker raised, if it raised."""
    message: str
    traceback: str | None
    """The worker's own formatted traceback, if it raised."""
    attempt: int = 0
    output_tail: str = ""
    """The last lines the worker wrote to stderr (shown when it died without a traceback)."""
    connecting: bool = False
    """It failed while the ranks connected, before any user code ran (a transient gloo error)."""
    signal_cause: str | None = None
    """Who sent the signal that killed it, where that can be told (a SIGKILL: see sigkill_cause)."""
    released: bool = False
    """It waited in a collective with a failed rank and the session released it: no failure of
    its own (its transport error is the release, not a cause)."""
    node: str | None = None
    """Where it ran, where that is not this machine (a Ray node: its id and IP)."""

    @classmethod
    def raised(cls, rank: int, report: Any, attempt: int, output_tail: str) -> WorkerFailure:
        """A worker reported an exception (its ErrorReport)."""
        return cls(
            rank=rank,
            exitcode=report.exitcode,
            signal_name=None,
            error_type=report.type,
            message=report.message,
            traceback=report.traceback,
            attempt=attempt,
            output_tail=output_tail,
            connecting=report.connecting,
        )

    @classmethod
    def died(
        cls, rank: int, exitcode: int, attempt: int, output_tail: str, signal_cause: str | None = None
    ) -> WorkerFailure:
        """A worker ended without reporting (a signal, ``os._exit``, a crash)."""
        signal_name = None
        message = ""
        if exitcode < 0:
            signal_name = signal_name_of(exitcode)
        elif exitcode == 0:
            message = "exited with code 0 before its function returned (os._exit?)"
        else:
            message = f"exited with code {exitcode} without a Python traceback"
        return cls(
            rank=rank,
            exitcode=exitcode,
            signal_name=signal_name,
            error_type=None,
            message=message,
            traceback=None,
            attempt=attempt,
            output_tail=output_tail,
            signal_cause=signal_cause if signal_name == "SIGKILL" else None,
        )

    @classmethod
    def released_from(cls, rank: int, causes: list[int], attempt: int = 0, stopped: bool = False) -> WorkerFailure:
        """A rank the session released from a collective it waited in with ``causes``, or
        (``stopped``) the master, stopped to send its state after ``causes`` died."""
        ranks = ", ".join(map(str, causes))
        why = (
            f"was stopped to send its state after rank {ranks} died"
            if stopped
            else f"was waiting in a collective with rank {ranks} and was released"
        )
        return cls(
            rank=rank,
            exitcode=None,
            signal_name=None,
            error_type=None,
            message=why,
            traceback=None,
            attempt=attempt,
            released=True,
        )

    def caused_by_a_lost_peer(self) -> bool:
        """An error a rank raises *because* a peer died (or a release from a collective with a
        failed one): never the root cause when another exists."""
        if self.released:
            return True
        text = f"{self.message} {self.traceback or ''}"
        return self.error_type is not None and any(w in text for w in _PEER_LOSS_WORDS)

    def summary(self) -> str:
        """One line: rank, attempt and cause."""
        if self.error_type:
            cause = f"raised {self.error_type}: {self.message}"
        elif self.signal_name:
            hint = self.signal_cause or _SIGNAL_HINTS.get(self.signal_name)
            if hint is None and self.signal_name == "SIGKILL":
                hint = sigkill_cause(None, None)
            cause = f"was killed by {self.signal_name}" + (f" ({hint})" if hint else "")
        else:
            cause = self.message or f"exited with code {self.exitcode}"
        where = f"rank {self.rank}" + (f" (attempt {self.attempt})" if self.attempt else "")
        where += f" on node {self.node}" if self.node else ""
        return f"{where} {cause}"

    def report(self) -> str:
        """Summary, then the worker's traceback or the tail of its stderr."""
        parts = [self.summary()]
        if self.traceback:
            parts.append(self.traceback.rstrip())
        elif self.output_tail.strip():
            parts.append(f"last output of rank {self.rank}:\n{self.output_tail.rstrip()}")
        return "\n".join(parts)


class LaunchInterrupted(KeyboardInterrupt):
    """The launch was interrupted (Jupyter's stop button, Ctrl-C); every worker was stopped.

    Attributes:
        partial_result: what rank 0 sent when it was interrupted (a distributed cell sends the
            state it reached), or None.
    """

    def __init__(self, partial_result: object = None) -> None:
        super().__init__("KeyboardInterrupt: every worker was stopped")
        self.partial_result = partial_result

    def __reduce__(self) -> tuple:
        return (type(self), (self.partial_result,))


class WorkerFailedError(EnotNbError, RuntimeError):
    """A worker process raised or died; raised in the launching process.

    Attributes:
        rank: global rank of the root cause (the first failure observed).
        exitcode: its exit code (``-N`` for death by signal N).
        signal_name: e.g. ``"SIGKILL"`` for deaths by signal, else None.
        traceback: the worker's own traceback text, if it raised.
        failures: every failure of the last attempt, root cause first.
        attempts: the root cause of each attempt, oldest first (with ``max_restarts``).
        partial_result: what rank 0 sent before it failed (a distributed cell with
            ``--on-error keep`` sends the state it reached), or None.
    """

    def __init__(
        self, failures: list[WorkerFailure], attempts: list[WorkerFailure] | None = None, partial_result: object = None
    ):
        self.partial_result = partial_result
        self.failures = failures
        self.attempts = attempts or [failures[0]]
        root = failures[0]
        self.rank = root.rank
        self.exitcode = root.exitcode
        self.signal_name = root.signal_name
        self.traceback = root.traceback
        super().__init__(self._text())

    def __reduce__(self) -> tuple:
        return (type(self), (self.failures, self.attempts, self.partial_result))

    def _text(self) -> str:
        lines = [f"worker {self.failures[0].summary()}", "", "Root Cause (first observed failure):"]
        lines.append(self.failures[0].report())
        others = [f for f in self.failures[1:] if not f.released]
        released = [f for f in self.failures[1:] if f.released]
        if others:
            lines += ["", "Other failures:"] + ["  " + f.summary() for f in others]
        if released:
            lines += ["", "Released (no failure of their own):"] + ["  " + f.summary() for f in released]
        if len(self.attempts) > 1:
            lines += ["", f"Root cause of each of the {len(self.attempts)} attempts:"]
            lines += ["  " + f.summary() for f in self.attempts]
        return "\n".join(lines)

    def _render_traceback_(self) -> list[str]:
        """IPython shows the worker's frames instead of the launcher's."""
        return [f"WorkerFailedError: {line}" if i == 0 else line for i, line in enumerate(self._text().splitlines())]


class StaleError(LaunchError):
    """A plain cell changed a variable whose newest value lives on the master only: the two
    sides conflict, and the user says which wins."""

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        super().__init__(
            f"{name!r} (or an object it holds) was changed or deleted in the notebook, but rank 0 changed it too and "
            f"its value did not come back ({why}). Say which side wins: `%enot_pull {name} --overwrite` "
            f"(session.pull({name!r}, overwrite=True)) takes rank 0's value and drops the notebook's change; "
            f"`%enot_pull {name} --keep-notebook` (session.pull({name!r}, keep_notebook=True)) sends the "
            "notebook's value (or its deletion) to every rank and drops rank 0's"
        )


class NotHeldError(EnotNbError, NameError):
    """A pull named variables the session's master does not hold (``%enot_pull`` shows it as a
    usage error).

    Attributes:
        missing: the names asked for that rank 0 does not hold.
        held: the names it holds.
    """

    FEW = 12
    """Up to this many held names are listed; more, and the closest to each missing one."""

    def __init__(self, missing: list[str], held: list[str]) -> None:
        import difflib

        self.missing, self.held = missing, held
        names = ", ".join(map(repr, missing))
        if not held:
            hint = "it holds no variables yet"
        elif len(held) <= self.FEW:
            hint = f"it holds {', '.join(held)}"
        else:
            close = sorted({c for n in missing for c in difflib.get_close_matches(n, held, n=3)})
            hint = f"it holds {len(held)} variables" + (f", among them {', '.join(close)}" if close else "")
        super().__init__(
            f"rank 0 holds no variable {names} ({hint}); check the name, or make it in a session cell first"
        )

    def __reduce__(self) -> tuple:
        return (type(self), (self.missing, self.held))


class StaleWrapperError(EnotNbError, RuntimeError):
    """A DDP wrapper on a session's ranks was used after a plain cell replaced parameters of the
    module it wraps: it, and its optimizer, must be built again. Raised by the wrapper on every
    rank; the notebook shows the message once, without the ranks' frames."""

    def _render_traceback_(self) -> list[str]:
        return [f"StaleWrapperError: {self}"]
