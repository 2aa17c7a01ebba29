"""The session rows of two checkouts, alternately in one run, and their differences.

Usage: .venv/bin/python benchmarks/compare.py BASE HEAD [--rounds N] [--repeats N] [--groups ...]

BASE and HEAD are git revisions of this repository (or folders holding a checkout). Each group
of bench_session's rows (this tree's measuring code, the same for both) runs in a kernel of its
own that imports the checkout's ``enot_nb``: for each group, BASE and HEAD take turns, in the
order ABBA over the rounds, so that a drift of the machine over the run moves both. Prints each
row's median over the rounds for both, HEAD minus BASE, and HEAD over BASE.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_session  # noqa: E402 - after sys.path
from benchmarks.harness import ROOT, Row  # noqa: E402
from tests.kernel import Kernel  # noqa: E402

GROUPS: dict[str, Callable[..., list[Row]]] = {
    "trivial": lambda kernel, repeats: bench_session.trivial(kernel, repeats, alternatives=False),
    "ddp": bench_session.ddp_steps,
    "resnet": bench_session.resnet,
    "push": bench_session.push,
    "costs": bench_session.costs,
}


def checkout(revision: str, into: Path) -> Path:
    """A folder holding ``revision``: the folder itself where it is one, else the revision's
    tree exported into ``into``."""
    if Path(revision).is_dir():
        return Path(revision).resolve()
    folder = into / revision.replace("/", "_")
    folder.mkdir()
    tree = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=tree, check=True)
    return folder


def measure(tree: Path, group: str, repeats: int) -> list[Row]:
    """One group's rows, in a kernel whose ``enot_nb`` (and the ranks') is ``tree``'s."""
    kernel = Kernel(extra_env={"PYTHONPATH": str(tree)})
    try:
        kernel.ok(f"import sys; sys.path[:0] = [{str(tree)!r}]")
        kernel.ok(bench_session.SETUP)
        where = kernel.ok("import enot_nb as _e; print(_e.__file__)").stdout.strip()
        if not where.startswith(str(tree)):
            raise RuntimeError(f"the kernel imported enot_nb from {where}, not from {tree}")
        return GROUPS[group](kernel, repeats)
    finally:
        kernel.shutdown()


def fmt(value: float, unit: str) -> str:
    return f"{value * 1000:.2f} ms" if unit == "s" else f"{value:.2f}{unit}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("head")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", nargs="+", choices=list(GROUPS), default=list(GROUPS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="enot-compare-") as scratch:
        trees = [checkout(args.base, Path(scratch)), checkout(args.head, Path(scratch))]
        found: dict[tuple[str, str], tuple[list[float], list[float], str]] = {}
        for group in args.groups:
            for round_ in range(args.rounds):
                for side in (0, 1) if round_ % 2 == 0 else (1, 0):
                    print(f"{group}, round {round_ + 1}: {[args.base, args.head][side]}", file=sys.stderr, flush=True)
                    for row in measure(trees[side], group, args.repeats):
                        if row.median == 0.0 and "not measured" in row.variant:
                            continue
                        entry = found.setdefault((row.benchmark, row.variant), ([], [], row.unit))
                        entry[side].append(row.median)
    print(f"| benchmark | variant | {args.base} | {args.head} | head - base | head / base |")
    print("|---|---|---|---|---|---|")
    for (benchmark, variant), (base, head, unit) in found.items():
        if not base or not head:
            continue
        b, h = statistics.median(base), statistics.median(head)
        ratio = f"{h / b:.2f}" if b > 0 else ""
        print(f"| {benchmark} | {variant} | {fmt(b, unit)} | {fmt(h, unit)} | {fmt(h - b, unit)} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
