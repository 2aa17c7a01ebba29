"""Shared pieces of the benchmarks: timing, a real kernel, result rows."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.kernel import Kernel  # noqa: E402 - the same real-kernel driver as the tests


@dataclass
class Row:
    """One measured variant, with its ratio to the reference measured in the same run."""

    benchmark: str
    variant: str
    median: float
    unit: str
    reference: str
    ratio: float | None = None
    target: str = ""
    runs: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def timed(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def paired_cost(without: Callable[[], object], with_: Callable[[], object], repeats: int) -> list[float]:
    """Seconds ``with_`` takes over ``without``, run alternately: one difference per pair, so
    that drift over the run (page cache, CPU clock) cancels; report their median."""
    without()
    with_()
    costs = []
    for _ in range(repeats):
        start = time.perf_counter()
        without()
        middle = time.perf_counter()
        with_()
        costs.append((time.perf_counter() - middle) - (middle - start))
    return costs


def median(values: list[float]) -> float:
    return statistics.median(values)


def kernel_json(kernel: Kernel, code: str, timeout: float = 600) -> object:
    """Run ``code`` in the kernel; it must print one line ``RESULT <json>``."""
    run = kernel.run(code, timeout=timeout)
    if run.error:
        raise RuntimeError("\n".join(run.error["traceback"]))
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def torchrun_command(script: str, *args: str) -> list[str]:
    """``benchmarks/<script>`` under torchrun on 2 processes (run with TORCHRUN_ENV)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "benchmarks" / script),
        *args,
    ]


TORCHRUN_ENV = {"PYTHONPATH": str(ROOT)}
"""Added to the environment of a torchrun_command: the scripts import benchmarks and enot_nb."""


def torchrun_json(script: str, *args: str) -> object:
    """Run ``benchmarks/<script>`` under torchrun on 2 processes; the script writes its result as
    JSON to the path given as its first argument (rank 0 does), which is read back here."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run(
            torchrun_command(script, str(out), *args),
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **TORCHRUN_ENV},
        )
        return json.loads(out.read_text())


def start_kernel() -> Kernel:
    kernel = Kernel()
    kernel.ok(f"import sys; sys.path.insert(0, {str(ROOT)!r})")
    return kernel
