"""Fault injection: a victim rank fails in a chosen way while the others work or wait."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from enot_nb import distributed as ed

FAULTS = ("raise", "sys.exit(3)", "os._exit(7)", "SIGSEGV", "SIGKILL")
# What WorkerFailedError must say for each fault: (exitcode, signal_name, error_type)
EXPECTED = {
    "raise": (1, None, "RuntimeError"),
    "sys.exit(3)": (3, None, None),
    "os._exit(7)": (7, None, None),
    "SIGSEGV": (-signal.SIGSEGV, "SIGSEGV", None),
    "SIGKILL": (-signal.SIGKILL, "SIGKILL", None),
}


def _compute_until(deadline: float) -> None:
    a = torch.randn(64, 64)
    while time.monotonic() < deadline:
        a = (a @ a).clamp_(-1, 1)


def fault_job(fault: str, victim: int, delay: float, stamp_path: str, activity: str) -> None:
    """The victim computes for ``delay`` s, stamps the time, then fails; the others compute
    for a minute or wait in a collective: the launcher must stop them."""
    if ed.get_rank() == victim:
        _compute_until(time.monotonic() + delay)
        fd = os.open(stamp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.write(fd, repr(time.monotonic()).encode())
        os.close(fd)
        if fault == "raise":
            raise RuntimeError("injected fault")
        if fault == "sys.exit(3)":
            sys.exit(3)
        if fault == "os._exit(7)":
            os._exit(7)
        os.kill(os.getpid(), getattr(signal, fault))
        time.sleep(60)
    elif activity == "compute":
        _compute_until(time.monotonic() + 60)
    dist.barrier()


def print_megabytes(megabytes: int) -> int:
    line = "x" * 99 + "\n"
    count = megabytes * 2**20 // len(line)
    for _ in range(count):
        sys.stdout.write(line)
    sys.stdout.write("no newline at the end")  # must not be lost
    return count


def big_tensor(megabytes: int) -> torch.Tensor:
    return torch.arange(megabytes * 2**18, dtype=torch.int32)
