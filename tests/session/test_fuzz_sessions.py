"""Sessions stay true under any sequence of cells: the session fuzzer (tests/session/fuzz.py) in CI.

Seeded programs of plain and session cells run in a real kernel with a two-rank gloo session and
plainly in a reference shell, compared after every cell: for about four minutes (and at least
150 programs) under fork, and 20 programs under spawn. A failure names its seed and writes the
program as a notebook that reproduces it; ``scripts/fuzz_sessions.py`` runs longer and shrinks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.kernel import running_kernel
from tests.session import fuzz

pytestmark = [pytest.mark.slow]

FORK_SECONDS = float(os.environ.get("ENOT_NB_FUZZ_SECONDS", "240"))
FORK_PROGRAMS = 150
FORK_AT_MOST = 220
"""The seeds CI runs stop here however fast the machine: seeds past it are scripts/fuzz_sessions.py's."""
SPAWN_PROGRAMS = 20


def _run(method: str, seconds: float, at_least: int, at_most: int, first_seed: int, reports: Path) -> tuple[int, int]:
    """Programs from ``first_seed`` on, until ``seconds`` passed (or ``at_most`` ran) and
    ``at_least`` ran; the programs and cells run."""
    reference = fuzz.Reference()
    started, programs = time.monotonic(), 0
    try:
        with running_kernel("%load_ext enot_nb") as kernel:
            runner = fuzz.Runner(kernel, reference, method)
            try:
                while programs < at_least or (time.monotonic() - started < seconds and programs < at_most):
                    program = fuzz.generate(first_seed + programs)
                    try:
                        runner.run(program)
                    except (fuzz.Mismatch, fuzz.Invalid) as mismatch:
                        book = reports / f"fuzz-{method}-seed-{program.seed}.ipynb"
                        book.write_text(program.notebook(method))
                        pytest.fail(
                            f"seed {program.seed} ({method}): {mismatch}\n{program.listing()}\nreproduce: {book}"
                        )
                    programs += 1
            finally:
                kernel.run("%enot_session stop", timeout=120)
    finally:
        reference.close()
    return programs, runner.cells


def _report(request, method: str, programs: int, cells: int, started: float) -> None:
    """A line in CI's log, whatever pytest captures (its terminal reporter writes it)."""
    seconds = time.monotonic() - started
    line = f"session fuzzer, {method}: {programs} programs, {cells} cells in {seconds:.0f} s"
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)


@pytest.mark.timeout(int(FORK_SECONDS) + 900)
def test_sessions_stay_true_under_generated_programs_fork(tmp_path, request):
    started = time.monotonic()
    programs, cells = _run("fork", FORK_SECONDS, FORK_PROGRAMS, FORK_AT_MOST, 0, tmp_path)
    _report(request, "fork", programs, cells, started)
    assert programs >= FORK_PROGRAMS


@pytest.mark.timeout(900)
def test_sessions_stay_true_under_generated_programs_spawn(tmp_path, request):
    started = time.monotonic()
    programs, cells = _run("spawn", 0, SPAWN_PROGRAMS, SPAWN_PROGRAMS, 100_000, tmp_path)
    _report(request, "spawn", programs, cells, started)
    assert programs == SPAWN_PROGRAMS
