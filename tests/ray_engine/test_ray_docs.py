"""docs/guide/ray.md's steps for one machine, run as written: its terminal block by bash (the
variables it exports then are the kernel's, as for a Jupyter started from that terminal), its
notebook cells in a real kernel, then its ``ray stop``; nothing of Ray is left running."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests._util import LEAK_GRACE, ended_within
from tests.kernel import ROOT, Kernel
from tests.ray_engine.conftest import NEEDS_RAY, _working_in

pytest.importorskip("ray", reason=NEEDS_RAY)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PAGE = (ROOT / "docs" / "guide" / "ray.md").read_text()


def terminal_block(step: str) -> str:
    """The bash block the page marks ``<!-- test: ray-one-machine STEP -->``."""
    found = re.search(rf"<!-- test: ray-one-machine {step} -->\n```bash\n(.*?)```", PAGE, re.S)
    assert found is not None, f"docs/guide/ray.md has no ray-one-machine {step} block"
    return found.group(1)


def notebook_cells() -> list[str]:
    """The page's Python blocks marked ``<!-- needs: ray-one-machine -->``, in order."""
    return re.findall(r"<!-- needs: ray-one-machine -->\n```python\n(.*?)```", PAGE, re.S)


def test_the_one_machine_steps_run_as_written(tmp_path):
    # The terminal's tools: this environment's python and ray, as after `pip install 'enot_nb[ray]'`.
    terminal = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    for name in [n for n in terminal if n.startswith("RAY_")]:
        del terminal[name]
    exported = tmp_path / "exported"
    script = terminal_block("start") + f'\nenv -0 > "{exported}"\n'
    started = subprocess.run(
        ["bash", "-e", "-c", script], env=terminal, cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    variables = dict(item.split("=", 1) for item in exported.read_text().split("\0") if "=" in item)
    ray_tmp = variables.get("RAY_TMPDIR")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        ours = {name: value for name, value in variables.items() if name.startswith("RAY_")}
        kernel = Kernel(extra_env=ours, cwd=tmp_path)
        try:
            runs = [kernel.ok(code, timeout=240) for code in notebook_cells()]
        finally:
            kernel.shutdown()
        assert "session started: 2 rank(s)" in runs[0].stdout, runs[0].stdout
        assert runs[1].stdout.strip() == "0 127.0.0.1", runs[1].stdout  # the master's line
    finally:
        stopped = subprocess.run(
            ["bash", "-e", "-c", terminal_block("stop")],
            env={**terminal, **variables},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
        left = ended_within(lambda: _working_in(str(tmp_path)), LEAK_GRACE)
        if ray_tmp:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert not left, f"Ray processes left behind: {left}"
