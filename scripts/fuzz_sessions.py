"""Run the session fuzzer (tests/session/fuzz.py) for longer than CI does, and shrink what it finds.

Usage: .venv/bin/python scripts/fuzz_sessions.py --minutes N [--seed S] [--start-method fork|spawn]

Programs from seed S (default: a random one) on, each in a real kernel with a two-rank gloo session
and plainly in a reference shell. A program whose namespaces differ is shrunk (cells dropped one
at a time while it still differs), printed, and written as a notebook (results/fuzz/seed-S.ipynb).
Prints the programs, cells and time run; exit status 1 if any differed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kernel import running_kernel  # noqa: E402
from tests.session import fuzz  # noqa: E402


def shrink(runner: fuzz.Runner, program: fuzz.Program, found: str) -> tuple[fuzz.Program, str]:
    """The smallest program found by dropping cells that still differs as ``found`` says (the
    same difference, wherever it shows: a smaller program that differs otherwise, a press that
    lost its loop, is another finding), and how it differs."""
    why, smaller = found, True
    while smaller:
        smaller = False
        for i in range(len(program.cells)):
            candidate = fuzz.Program(
                program.seed, program.cells[:i] + program.cells[i + 1 :], program.replicated, program.ddp_module
            )
            try:
                runner.run(candidate)
            except fuzz.Mismatch as mismatch:
                if _what_differs(str(mismatch)) == _what_differs(found):
                    program, why, smaller = candidate, str(mismatch), True
                    break
            except Exception:  # noqa: BLE001 - the program no longer makes sense (a callback gone): keep the cell
                continue
    return program, why


def _what_differs(mismatch: str) -> str:
    """A mismatch's text without where it showed ("after cell 4 (session): ...")."""
    return mismatch.split(": ", 1)[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--start-method", default="fork", choices=["fork", "spawn"])
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(10**9)
    deadline = time.monotonic() + args.minutes * 60
    started, programs, found = time.monotonic(), 0, 0
    reference = fuzz.Reference()
    cells = 0
    try:
        while time.monotonic() < deadline:  # a kernel per stretch: one that hung is left behind
            with running_kernel("%load_ext enot_nb") as kernel:
                runner = fuzz.Runner(kernel, reference, args.start_method)
                while time.monotonic() < deadline:
                    program = fuzz.generate(seed + programs)
                    programs += 1
                    try:
                        runner.run(program)
                    except (fuzz.Mismatch, fuzz.Invalid) as mismatch:
                        found += 1
                        print(f"seed {program.seed}: {mismatch}\n{program.listing()}", flush=True)
                        small, why = shrink(runner, program, str(mismatch))
                        book = ROOT / "results" / "fuzz" / f"seed-{program.seed}.ipynb"
                        book.parent.mkdir(parents=True, exist_ok=True)
                        book.write_text(small.notebook(args.start_method))
                        print(f"shrunk to {len(small.cells)} cells: {why}\n{small.listing()}", flush=True)
                        print(f"notebook: {book}", flush=True)
                    except Exception as failure:  # noqa: BLE001 - a hang or the harness's own error: a finding, not shrunk
                        found += 1
                        print(f"seed {program.seed}: {type(failure).__name__}: {failure}", flush=True)
                        print(program.listing(), flush=True)
                        break  # a new kernel
                cells += runner.cells
                kernel.run("%enot_session stop", timeout=120)
    finally:
        reference.close()
    print(
        f"session fuzzer, {args.start_method}: {programs} programs from seed {seed}, {cells} cells, "
        f"{time.monotonic() - started:.0f} s, {found} differing"
    )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
