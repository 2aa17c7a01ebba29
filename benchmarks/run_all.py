"""Run every benchmark in one go; print a table, write JSON, a Markdown table and a chart.

Usage: .venv/bin/python benchmarks/run_all.py [--repeats N] [--chart-only]
       [--only launch|state|state-cost|ddp|widgets|session|ray]
Accelerate is measured when installed (pip install -e ".[bench]"); it is never a runtime need.
ipyparallel and nbdistributed (the session rows) when installed: bash scripts/bench_extras.sh.
The Ray engine's rows when Ray is installed (pip install -e ".[ray]"; a row says so otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_cells, bench_launch, bench_ray, bench_session, bench_sync  # noqa: E402 - after sys.path
from benchmarks.harness import ROOT, Row  # noqa: E402 - after the sys.path line above

OUT = ROOT / "benchmarks" / "results"


def fmt(row: Row) -> str:
    if row.unit == "s":
        value = f"{row.median * 1000:.1f} ms"
    elif row.unit == "x":
        value = f"{row.median:.2f}x"
    elif row.unit == "GiB":
        value = f"{row.median:.2f} GiB"
    else:
        value = f"{row.median:,.0f} {row.unit}"
    ratio = f"{row.ratio:.2f}" if row.ratio is not None else ""
    return f"| {row.benchmark} | {row.variant} | {value} | {ratio} | {row.target} |"


def table(rows: list[Row]) -> str:
    lines = ["| benchmark | variant | median | ratio to reference | target |", "|---|---|---|---|---|"]
    return "\n".join(lines + [fmt(r) for r in rows])


def chart(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [
        r for r in rows if r.ratio is not None and r.unit != "x" and "reference" not in r.variant and r.ratio < 100
    ]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(shown) + 1))
    labels = [f"{r.benchmark.replace(', 2 processes', '').split(' (')[0]}: {r.variant}" for r in shown]
    others = ("Accelerate", "torch.multiprocessing", "torchrun", "per-tensor", "DistributedDataParallel")
    colors = ["tab:gray" if any(o in r.variant for o in others) else "tab:green" for r in shown]
    ax.barh(range(len(shown)), [r.ratio for r in shown], color=colors)
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(
        "ratio to the reference of the same run (log scale)\n"
        "lower is better, except output and training (higher is better)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chart-only", action="store_true", help="redraw the chart from results.json")
    parser.add_argument(
        "--only",
        choices=["launch", "state", "state-cost", "ddp", "widgets", "session", "ray"],
        help="run one group and print it (no files)",
    )
    args = parser.parse_args()
    if args.chart_only:
        saved = json.loads((OUT / "results.json").read_text())["rows"]
        chart([Row(**row) for row in saved], OUT / "chart.png")
        return
    if args.only:
        groups = {
            "launch": bench_launch.run,
            "state": bench_cells.run_state,
            "state-cost": bench_cells.run_state_cost,
            "ddp": bench_cells.run_ddp_cell,
            "widgets": bench_cells.run_widgets,
            "session": bench_session.run,
            "ray": bench_ray.run,
        }
        print(table(groups[args.only](args.repeats)))
        return
    rows = bench_launch.run(args.repeats) + bench_sync.run(args.repeats) + bench_cells.run(args.repeats)
    rows += bench_session.run(args.repeats) + bench_ray.run(args.repeats)
    OUT.mkdir(parents=True, exist_ok=True)
    machine = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": len(os.sched_getaffinity(0)),
        "torch": __import__("torch").__version__,
        "gpus": __import__("torch").cuda.device_count(),
    }
    (OUT / "results.json").write_text(json.dumps({"machine": machine, "rows": [r.as_dict() for r in rows]}, indent=1))
    text = table(rows)
    (OUT / "table.md").write_text(text + "\n")
    chart(rows, OUT / "chart.png")
    print(text)
    print(f"\nwrote {OUT / 'results.json'}, {OUT / 'table.md'}, {OUT / 'chart.png'}")


if __name__ == "__main__":
    main()
