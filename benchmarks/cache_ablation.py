"""Each cache of a session's state machinery, measured with and without it (issue 34, item 10).

For each cache, a copy of the tree with that cache turned off (a text patch, as
scripts/mutations.py makes its mutants) runs the same session rows in a kernel of its own,
one variant after another in one run: a trivial cell, a cell that reads a ResNet-50-sized model
and one that updates it, and the costs after large state. A cache earns its place where some
row moves by 2 ms or more without it, and that row misses its target without it.

Usage: .venv/bin/python benchmarks/cache_ablation.py [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.mutations import scratch_copy  # noqa: E402 - after the sys.path line

CACHES = {
    "none off (all caches on)": [],
    "the last cell's reach and specs (CellReach)": [
        ("enot_nb/_session/kernel/flow.py", "                self.kept,\n", "                None,\n")
    ],
    "the master's snapshot and registry (KeptSnapshot)": [
        (
            "enot_nb/_session/worker/loop.py",
            "    keep = isinstance(task, CellTask) and not pushed and task.mirror is not None\n",
            "    keep = False\n",
        )
    ],
    "the record updated in place (Record.update, walked_again)": [
        ("enot_nb/_session/mirror/mirror.py", "        if moved is None:\n", "        if True:\n")
    ],
}

MEASURE = """
import json, sys
from benchmarks.bench_session import SETUP, costs, resnet, trivial
import benchmarks.bench_session as bench
from benchmarks.harness import start_kernel
bench._apart = lambda *args: []  # the alternatives are not what is measured here
kernel = start_kernel()
try:
    kernel.ok(SETUP)
    rows = trivial(kernel, {n}) + resnet(kernel, {n}) + costs(kernel, {n})
finally:
    kernel.shutdown()
print("ROWS", json.dumps([(r.variant, r.median, r.target) for r in rows]))
"""


def measure(patches: list[tuple[str, str, str]], repeats: int) -> list[tuple[str, float, str]]:
    tree = scratch_copy()
    try:
        for path, old, new in patches:
            text = (tree / path).read_text()
            if text.count(old) != 1:
                raise SystemExit(f"{path}: the text to patch is not found once")
            (tree / path).write_text(text.replace(old, new))
        out = subprocess.run(
            [sys.executable, "-c", MEASURE.format(n=repeats)],
            cwd=tree,
            env=os.environ | {"PYTHONPATH": str(tree)},
            capture_output=True,
            text=True,
            timeout=3600,
            check=True,
        ).stdout
        return json.loads(next(line for line in out.splitlines() if line.startswith("ROWS "))[5:])
    finally:
        subprocess.run(["rm", "-rf", str(tree)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = {name: measure(patches, args.repeats) for name, patches in CACHES.items()}
    base = {variant: median for variant, median, _ in results["none off (all caches on)"]}
    print("| cache off | row | with it | without it | moved |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        if not name.startswith("none"):
            for variant, median, _target in rows:
                before, moved = base[variant] * 1e3, (median - base[variant]) * 1e3
                print(f"| {name} | {variant} | {before:.1f} ms | {median * 1e3:.1f} ms | {moved:+.1f} ms |")


if __name__ == "__main__":
    main()
