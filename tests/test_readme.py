"""Every Python code block of the README runs, in order, in a real kernel."""

from __future__ import annotations

import re

import pytest

from tests.kernel import ROOT, running_kernel

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 4
    with running_kernel() as kernel:
        runs = [kernel.ok(block) for block in blocks]
    magic = next(r for b, r in zip(blocks, runs) if b.startswith("%%enot_distributed"))
    assert magic.stdout.startswith("final loss")
    assert "enot_nb note: 'ddp' was not brought back" in magic.stdout  # a quiet note, not stderr
