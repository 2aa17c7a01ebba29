"""The browser test asks whether Chromium is there when it runs, never while tests are collected:
a skip at collection said "/usr/bin/chromium is absent" of a Chromium that CI installed before the
test ran. Apart from test_browser.py, so that a skip there cannot hide this test's failure."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.kernel import ROOT

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]


def test_collecting_the_browser_test_leaves_chromium_to_the_test():
    pytest.importorskip("playwright.sync_api", reason="playwright comes with the 'browser' extra")
    pytest.importorskip("jupyterlab", reason="jupyterlab comes with the 'browser' extra")
    module = ROOT / "tests" / "frameworks" / "test_browser.py"
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(module)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert "::test_distributed_cell_shows_widget_and_figure_in_jupyterlab" in collected.stdout, collected.stdout
    assert "skipped" not in collected.stdout, collected.stdout
