"""What every way of starting processes shares: one clear error for a resource the system
refused, and the named points where the reliability tests inject faults."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable

from enot_nb.errors import LaunchError

TEST_HOOKS: dict[str, Callable[..., None]] = {}
"""Fault injection for the reliability tests: named points of a start call these, if set
("before_forks", "between_forks", "after_forks", "fork" (with the rank); "server_starting",
"before_launch", "launch_sent", "started"; "watchdog_starting")."""


def fresh_interpreter_env() -> dict[str, str]:
    """This process's environment for a fresh interpreter it starts (the fork server, a Ray
    rank's worker): it must import enot_nb from wherever this process did."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if isinstance(p, str) and p)
    return env


def hook(name: str, *args: object) -> None:
    if TEST_HOOKS:
        function = TEST_HOOKS.get(name)
        if function is not None:
            function(*args)


def start_error(err: OSError, what: str) -> LaunchError:
    """A resource error at start, as one clear LaunchError naming the limit and the fix."""
    if err.errno == errno.EMFILE or err.errno == errno.ENFILE:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return LaunchError(
            f"{what}: too many open files (the limit is {soft}; each worker needs 3 pipes, the "
            "launcher a few more). Lower nprocs, or raise the limit: `ulimit -n 65536` before "
            "starting Jupyter, or resource.setrlimit(resource.RLIMIT_NOFILE, ...)"
        )
    if err.errno in (errno.EAGAIN, errno.ENOMEM):
        return LaunchError(
            f"{what}: the system refused a new process ({os.strerror(err.errno)}): the limit on "
            "processes per user (`ulimit -u`, RLIMIT_NPROC) or memory is reached. Lower nprocs, "
            "or raise the limit"
        )
    return LaunchError(f"{what}: {type(err).__name__}: {err}")
