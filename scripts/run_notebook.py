"""Execute a notebook headless in a real kernel and write the executed copy with its outputs.

Usage: python scripts/run_notebook.py NOTEBOOK OUTPUT [--timeout SECONDS] [--show PREFIX]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(source: Path, target: Path, timeout: int) -> nbformat.NotebookNode:
    notebook = nbformat.read(source, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]

    def started(cell: nbformat.NotebookNode, cell_index: int) -> None:  # a line per code cell, as it starts
        if cell.cell_type != "code":
            return
        first = next((line for line in cell.source.splitlines() if line.strip()), "")
        print(f"cell {code.index(cell) + 1} of {len(code)}: {first[:80]}", flush=True)

    NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(source.parent)}},
        on_cell_start=started,
    ).execute()
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, target)
    print(f"executed {source} -> {target}")
    return notebook


def printed_lines(notebook: nbformat.NotebookNode, prefix: str) -> list[str]:
    """The lines the executed notebook's cells printed that start with ``prefix``, in order."""
    return [
        line
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "stream"
        for line in output.get("text", "").splitlines()
        if line.startswith(prefix)
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument("--show", metavar="PREFIX", help="print the lines the cells printed that start with PREFIX")
    args = parser.parse_args()
    try:
        executed = execute(args.notebook, args.output, args.timeout)
    except Exception as err:  # noqa: BLE001 - nbclient's CellExecutionError carries the cell's traceback
        print(err, file=sys.stderr)
        sys.exit(1)
    if args.show:
        shown = printed_lines(executed, args.show)
        if not shown:
            sys.exit(f"{args.output}: no cell printed a line starting with {args.show!r}")
        print("\n".join(shown))
