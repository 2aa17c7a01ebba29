"""scripts/main.sh ends by printing the result: the line its notebook prints (``--show PREFIX`` of
scripts/run_notebook.py), read from the executed copy. The notebook's stored outputs, which nbval
keeps equal to a fresh run's, must hold such a line, or the job would end without its result."""

from __future__ import annotations

import importlib.util
import re

import nbformat

from tests.kernel import ROOT


def _run_notebook():
    spec = importlib.util.spec_from_file_location("run_notebook", ROOT / "scripts" / "run_notebook.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_main_job_shows_a_line_its_notebook_prints():
    main = (ROOT / "scripts" / "main.sh").read_text()
    notebook = re.search(r"^notebook=(\S+)$", main, re.M).group(1)
    prefix = re.search(r'--show "([^"]+)"', main).group(1)
    shown = _run_notebook().printed_lines(nbformat.read(ROOT / notebook, as_version=4), prefix)
    assert len(shown) == 1 and re.fullmatch(re.escape(prefix) + r" \d+\.\d%", shown[0]), shown
    assert "jupyter lab $executed" in main  # and how to open what it ran


def test_printed_lines_reads_only_what_cells_printed():
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_markdown_cell("accuracy: in prose"),
        nbformat.v4.new_code_cell(
            "print(...)",
            outputs=[
                nbformat.v4.new_output("stream", name="stdout", text="loss 1\naccuracy: 90%\n"),
                nbformat.v4.new_output("execute_result", data={"text/plain": "accuracy: a value"}, execution_count=1),
            ],
        ),
    ]
    assert _run_notebook().printed_lines(notebook, "accuracy:") == ["accuracy: 90%"]
