"""The options of a launch, defined once: ``notebook_launcher``'s keywords, the magic's flags and
``export_cell``'s keywords are these fields (tests/unit/test_options.py checks that they agree).

``LaunchOptions`` checks everything that does not depend on the machine, once, when it is
built; ``plan.plan_launch`` then decides what does (GPUs, backends available, addresses).
"""

from __future__ import annotations

import datetime
import math
import re
import shlex
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from enot_nb._defaults import DEFAULT_TIMEOUT
from enot_nb.errors import LaunchConfigError

OUTPUT_MODES = ("master", "all", "none")
START_METHODS = (None, "fork", "spawn")
MAX_TIMEOUT_S = 365 * 24 * 3600


class ConflictingFlagsError(LaunchConfigError, RuntimeError):
    """Both CUDA flags were given (a RuntimeError too, as init_torch raises)."""


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How to start the workers; every field is checked when the options are built.

    Raises:
        LaunchConfigError: a bad value (``err.parameter`` names the field).
    """

    nprocs: int | None = None
    """Processes on this node; None: one per visible GPU."""
    backend: str | None = None
    """"nccl" or "gloo" (or a plugin); None: nccl when every rank has its own GPU, else gloo."""
    seed: int | None = None
    cuda_optimize_for_speed: bool = False
    cuda_reproducible: bool = False
    start_method: str | None = None
    """"fork", "spawn", or None: fork unless CUDA is initialized in this process."""
    output: str = "master"
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    max_restarts: int = 0
    timeout: datetime.timedelta | float = DEFAULT_TIMEOUT
    """The process group's timeout (seconds, or a timedelta)."""
    hang_after: float | None = None
    """Seconds without progress (no rank's CPU time moves) after which the notebook shows where
    each rank is and its last collective; None or 0: never (see _launch/hang_watch)."""

    # The magic's flag for each field (UsageError messages name the flag the user typed).
    FLAGS: ClassVar[dict[str, str]] = {
        "nprocs": "-n",
        "backend": "--backend",
        "seed": "--seed",
        "cuda_optimize_for_speed": "--speed",
        "cuda_reproducible": "--reproducible",
        "start_method": "--start-method",
        "output": "--output",
        "master_addr": "--master-addr",
        "master_port": "--master-port",
        "nnodes": "--nnodes",
        "node_rank": "--node-rank",
        "max_restarts": "--max-restarts",
        "timeout": "--timeout",
        "hang_after": "--hang-after",
    }

    def __post_init__(self) -> None:
        if self.cuda_optimize_for_speed and self.cuda_reproducible:
            raise ConflictingFlagsError(
                "cuda_optimize_for_speed and cuda_reproducible are mutually exclusive; set at most one",
                parameter="cuda_reproducible",
            )
        if self.nprocs is not None:
            check_int("nprocs", self.nprocs, low=1)
        check_int("nnodes", self.nnodes, low=1)
        check_int("node_rank", self.node_rank, low=0)
        if self.node_rank >= self.nnodes:
            raise LaunchConfigError(
                f"node_rank={self.node_rank} is out of range for "
                f"nnodes={self.nnodes}; use 0 <= node_rank < {self.nnodes}",
                parameter="node_rank",
            )
        check_int("max_restarts", self.max_restarts, low=0)
        if self.seed is not None:
            check_int("seed", self.seed, low=0)
            if self.seed >= 2**32:
                raise LaunchConfigError(
                    f"seed={self.seed} must be below 2**32 (NumPy's limit); pick a smaller seed", parameter="seed"
                )
        if self.output not in OUTPUT_MODES:
            raise LaunchConfigError(
                f"output={self.output!r} is not one of {', '.join(OUTPUT_MODES)}", parameter="output"
            )
        if self.start_method not in START_METHODS:
            raise LaunchConfigError(
                f"start_method={self.start_method!r} is not one of 'fork', 'spawn' or None", parameter="start_method"
            )
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise LaunchConfigError(
                f"backend={self.backend!r} must be a name such as 'nccl' or 'gloo'", parameter="backend"
            )
        object.__setattr__(self, "timeout", as_timedelta(self.timeout))
        object.__setattr__(self, "hang_after", as_hang_after(self.hang_after))
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise LaunchConfigError(
                f"master_addr={self.master_addr!r} must be a host name or an IP "
                "address (node 0's, as every node reaches it)",
                parameter="master_addr",
            )
        self._check_port()

    def _check_port(self) -> None:
        if self.master_port is None:
            if self.nnodes > 1:
                raise LaunchConfigError(
                    "nnodes > 1 needs master_port: every node must be given the "
                    "same master_addr and master_port of node 0",
                    parameter="master_port",
                )
            return
        check_int("master_port", self.master_port, low=1)
        if self.master_port > 65535:
            raise LaunchConfigError(f"master_port={self.master_port} must be at most 65535", parameter="master_port")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise LaunchConfigError(f"{name}={value!r} must be an integer >= {low}", parameter=name)


def as_hang_after(seconds: Any) -> float | None:
    """``hang_after`` checked: positive seconds, or None for never (0 too)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_TIMEOUT_S:
        raise LaunchConfigError(
            f"hang_after={seconds!r} must be seconds (at most a year), or 0 or None for never", parameter="hang_after"
        )
    return float(seconds) or None


def as_timedelta(timeout: Any) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise LaunchConfigError(f"timeout={timeout!r} must be a datetime.timedelta or seconds", parameter="timeout")
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise LaunchConfigError(
            f"timeout={timeout!r} must be positive and finite: seconds above 0 and at most {MAX_TIMEOUT_S} (a year)",
            parameter="timeout",
        )
    return datetime.timedelta(seconds=seconds)


# An option as the launcher's messages write it: name=value (a Python literal), or the bare name
# where it is no English word (nprocs, master_port; not backend, seed, output or timeout). Never
# inside a path or a longer name.
_ENGLISH = {"backend", "seed", "output", "timeout"}


_OPTION_WORDS = re.compile(
    r"(?<![\w/.-])("
    + "|".join(sorted(LaunchOptions.FLAGS, key=len, reverse=True))
    + r")(?:=('[^']*'|\"[^\"]*\"|[\w.+-]+)|(?![\w/.=-]))"
)


def in_magic_words(message: str) -> str:
    """A launcher message in the magic's words: ``nprocs=2, backend='gloo'`` -> ``-n 2,
    --backend gloo``, ``master_port=None`` -> ``no --master-port`` (the flags of
    LaunchOptions.FLAGS, the one definition of each option)."""

    def one(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        flag = LaunchOptions.FLAGS[name]
        if value is None:
            return match.group(0) if name in _ENGLISH else flag
        if value in ("None", "False"):
            return f"no {flag}"
        if value == "True":
            return flag
        text = value[1:-1] if value[:1] in "'\"" else value
        return f"{flag} {shlex.quote(text)}"

    return _OPTION_WORDS.sub(one, message)


ENGINES = ("local", "ray")
PLACEMENTS = ("pack", "spread")


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """Where a session's ranks run (``%enot_session start --engine ray``, ``Session(engine=...)``):
    this machine, or a Ray cluster (docs/guide/ray.md). Checked when built.

    Raises:
        LaunchConfigError: a bad value (``err.parameter`` names the field).
    """

    engine: str = "local"
    """"local" (processes of this machine) or "ray" (one Ray actor per rank)."""
    address: str | None = None
    """The Ray cluster: "auto", "HOST:PORT" of its head; None: Ray's default (RAY_ADDRESS, else a
    cluster on this machine, else a new local one). Ray Client's "ray://" is refused."""
    gpus_per_rank: int = 0
    """GPUs in each rank's bundle; its device is the first GPU Ray assigned it."""
    placement: str = "pack"
    """"pack" (Ray's PACK: fill nodes in order) or "spread" (SPREAD: one rank per node where it can)."""

    FLAGS: ClassVar[dict[str, str]] = {
        "engine": "--engine",
        "address": "--address",
        "gpus_per_rank": "--gpus-per-rank",
        "placement": "--placement",
    }

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise LaunchConfigError(f"engine={self.engine!r} is not one of 'local' or 'ray'", parameter="engine")
        check_int("gpus_per_rank", self.gpus_per_rank, low=0)
        if self.placement not in PLACEMENTS:
            raise LaunchConfigError(
                f"placement={self.placement!r} is not one of 'pack' or 'spread'", parameter="placement"
            )
        if self.address is not None and (not isinstance(self.address, str) or not self.address):
            raise LaunchConfigError(
                f"address={self.address!r} must be 'auto' or the Ray head's HOST:PORT", parameter="address"
            )
        if isinstance(self.address, str) and self.address.startswith("ray://"):
            raise LaunchConfigError(
                f"address={self.address!r}: Ray Client (ray://) is not supported by the Ray engine: it has "
                "no object store on this side, and every piece of the ranks' output and state would cross "
                "its proxy. Run the notebook on a node of the cluster and pass address='auto' (or the "
                "head's HOST:PORT)",
                parameter="address",
            )
        if self.engine == "local" and (self.address is not None or self.gpus_per_rank or self.placement != "pack"):
            raise LaunchConfigError(
                "address, gpus_per_rank and placement place ranks on a Ray cluster; add engine='ray'",
                parameter="engine",
            )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
