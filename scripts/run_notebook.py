"""Execute a notebook headless in a real kernel and write the executed copy with its outputs.

Usage: python scripts/run_notebook.py NOTEBOOK OUTPUT [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def execute(source: Path, target: Path, timeout: int) -> None:
    notebook = nbformat.read(source, as_version=4)
    NotebookClient(
        notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(source.parent)}}
    ).execute()
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, target)
    print(f"executed {source} -> {target}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args()
    try:
        execute(args.notebook, args.output, args.timeout)
    except Exception as err:  # noqa: BLE001 - nbclient's CellExecutionError carries the cell's traceback
        print(err, file=sys.stderr)
        sys.exit(1)
