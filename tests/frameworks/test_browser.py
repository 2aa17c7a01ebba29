"""A real browser: JupyterLab runs a notebook with a distributed cell, headless Chromium shows it.

JupyterLab is started on a free loopback port (no token, no browser) with the repository on the
kernel's PYTHONPATH; Debian's Chromium is driven through Playwright (its own browser download is
not needed). What a user sees is checked in the DOM: the tqdm.auto bar of a ``%%enot_distributed``
cell is a progress *widget* that reached 20/20, not a text bar nor "Error displaying widget", and
the matplotlib figure drawn on rank 0 is a PNG image under the cell.

Needs the ``browser`` extra (jupyterlab, playwright) and ``apt-get install chromium``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest

from tests._util import cmdline, descendants, free_port

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(300)]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright comes with the 'browser' extra")
pytest.importorskip("jupyterlab", reason="jupyterlab comes with the 'browser' extra")

# Where .ci/run installs Debian's Chromium, and its test for it: an executable file there.
CHROMIUM = Path("/usr/bin/chromium")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "enot_browser.ipynb"
# Needed on this machine (root, no GPU, no network but package registries): without them Chromium's
# background connections are refused or hang.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DISTRIBUTED_CELL = """\
%%enot_distributed -n 2 --backend gloo
from tqdm.auto import tqdm
import matplotlib.pyplot as plt
for step in tqdm(range(20)):
    pass
plt.plot([1, 2, 3], [3, 1, 2])
plt.title("enot_nb figure")"""
# Generous (a run takes ~15 s on 2 cores), yet together under the 300 s test timeout, so that a hang
# ends in an explained failure, with a screenshot.
SERVER_START_S = 60
KERNEL_READY_MS = 60_000
CELLS_DONE_MS = 120_000
WIDGET_MS = 15_000


# ----------------------------------------------------------------------------- processes


def kill_all(pids: list[int], grace_s: float) -> list[int]:
    """Wait up to ``grace_s`` for ``pids`` to end by themselves, then SIGKILL the rest; returns those killed."""
    deadline = time.monotonic() + grace_s
    left = list(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if Path(f"/proc/{p}").exists() and cmdline(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


# ----------------------------------------------------------------------------- JupyterLab


def lab_command(port: int, root_dir: Path) -> list[str]:
    """``jupyter lab`` of this interpreter on 127.0.0.1:``port``: no browser, no token, no password,
    no calls home, and ``window.jupyterapp`` exposed so the test can run JupyterLab's commands."""
    return [
        sys.executable,
        "-m",
        "jupyterlab",
        "--allow-root",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--IdentityProvider.token=",
        "--PasswordIdentityProvider.hashed_password=",
        "--ServerApp.open_browser=False",
        f"--ServerApp.root_dir={root_dir}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]


def lab_env(home: Path) -> dict[str, str]:
    """The server's (and so its kernels') environment: the repository importable, Jupyter's and
    IPython's per-user files in ``home`` rather than the user's."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MPLBACKEND")}
    pythonpath = [str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        env[name] = str(home / name.lower())
    env["OMP_NUM_THREADS"] = "1"
    return env


def wait_until_serving(server: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Poll ``url``/api until the server answers; fail early if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            pytest.fail(f"jupyter lab exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api", timeout=5) as reply:
                if "version" in json.load(reply):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"jupyter lab did not answer on {url} within {timeout_s} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)  # a poll interval, not a synchronization


def stop_server(server: subprocess.Popen) -> list[int]:
    """SIGTERM the server: it shuts its kernels down (and they their workers) before it exits.

    Whatever the server started and left (its kernels run in sessions of their own, and would be
    orphaned, out of sight of conftest's check) is killed; returns those pids."""
    started = descendants(server.pid)
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    return kill_all(started, grace_s=10)


@dataclass
class Lab:
    url: str
    root: Path  # the directory it serves
    server: subprocess.Popen


@pytest.fixture
def chromium() -> Path:
    """Debian's Chromium, looked for when the test runs: not at collection, which may come before
    it is installed (a skip then would say it is absent while it is there)."""
    if not os.access(CHROMIUM, os.X_OK):
        state = "is not executable" if CHROMIUM.exists() else "is absent"
        pytest.skip(f"{CHROMIUM} {state} (apt-get install chromium; .ci/run installs it when run as root)")
    return CHROMIUM


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    """A running JupyterLab serving ``tmp_path/root``. Always stopped, kernels and all."""
    root, home = tmp_path / "root", tmp_path / "home"
    root.mkdir()
    home.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "jupyter-lab.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            lab_command(port, root),
            env=lab_env(home),
            cwd=root,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    left: list[int] = []
    try:
        wait_until_serving(server, url, log, SERVER_START_S)
        yield Lab(url, root, server)
    finally:
        left = stop_server(server)
    assert not left, f"jupyter lab left processes running: {[(p, cmdline(p)) for p in left]}"


def write_notebook(path: Path) -> None:
    """The notebook under test: load the extension, then one distributed cell with tqdm and a figure."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("%load_ext enot_nb"), nbformat.v4.new_code_cell(DISTRIBUTED_CELL)]
    nbformat.write(nb, path)


def kernel_executables(server_pid: int) -> list[str]:
    """The interpreters of the server's ipykernel processes."""
    return [args[0] for args in map(cmdline, descendants(server_pid)) if "ipykernel_launcher" in args]


# ----------------------------------------------------------------------------- the browser

# JavaScript run in the page, on JupyterLab's application object (``--LabApp.expose_app_in_browser``).
NOTEBOOK_JS = "window.jupyterapp && window.jupyterapp.shell.currentWidget"
KERNEL_IDLE_JS = f"""() => {{
    const panel = {NOTEBOOK_JS};
    const kernel = panel && panel.sessionContext && panel.sessionContext.session
        && panel.sessionContext.session.kernel;
    return !!kernel && kernel.connectionStatus === "connected" && kernel.status === "idle";
}}"""
# Every code cell has run, or one of them failed (run-all stops there).
CELLS_DONE_JS = f"""() => {{
    const cells = {NOTEBOOK_JS}.content.widgets.filter(cell => cell.model.type === "code");
    const failed = cells.some(cell => cell.model.outputs.toJSON().some(out => out.output_type === "error"));
    return failed || cells.every(cell => cell.model.executionCount !== null);
}}"""


@contextmanager
def explained(page, tmp_path: Path, what: str) -> Iterator[None]:
    """Turn a failure (an assertion, or a Playwright timeout) in the block into an assertion error that
    names a screenshot of the page and quotes the notebook's visible text."""
    try:
        yield
    except (AssertionError, sync_api.Error) as failure:
        shot = tmp_path / "browser-failure.png"
        try:
            page.screenshot(path=str(shot), full_page=True)
        except sync_api.Error as error:
            shot = f"none ({error})"
        try:
            text = page.locator(".jp-Notebook").first.inner_text(timeout=5_000)
        except sync_api.Error:
            text = page.locator("body").inner_text(timeout=5_000)
        raise AssertionError(f"{what}: {failure}\nscreenshot: {shot}\nvisible notebook text:\n{text}") from failure


def open_notebook(page, url: str) -> None:
    """Open the notebook in JupyterLab and wait until its kernel is connected and idle."""
    page.goto(f"{url}/lab/tree/{NOTEBOOK}")
    page.wait_for_function(KERNEL_IDLE_JS, timeout=KERNEL_READY_MS)


def run_all_cells(page) -> None:
    """Run every cell with JupyterLab's own command (Run > Run All Cells) and wait until all have run."""
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    page.wait_for_function(CELLS_DONE_JS, timeout=CELLS_DONE_MS)


def check_no_errors(page) -> None:
    """No cell raised, and no widget failed to display."""
    text = page.locator(".jp-Notebook").first.inner_text()
    for bad in ("Error displaying widget", "model not found", "Traceback (most recent call last)"):
        assert bad not in text, f"{bad!r} is shown"


def check_progress_widget(cell) -> None:
    """tqdm.auto drew a progress widget (not a text bar) under the cell, and it reached 20/20, full."""
    bar = cell.locator(".jp-OutputArea-output .widget-hprogress")
    sync_api.expect(bar).to_have_count(1, timeout=WIDGET_MS)
    row = cell.locator(".jp-OutputArea-output .widget-hbox:has(.widget-hprogress)")
    sync_api.expect(row).to_contain_text("100%", timeout=WIDGET_MS)
    sync_api.expect(row).to_contain_text("20/20", timeout=WIDGET_MS)
    sync_api.expect(bar.locator(".progress-bar")).to_have_attribute(
        "style", re.compile(r"\bwidth: 100%;"), timeout=WIDGET_MS
    )
    text_outputs = cell.locator(".jp-OutputArea-output.jp-RenderedText").all_inner_texts()
    assert not any("20/20" in text for text in text_outputs), f"a text progress bar is shown: {text_outputs}"


def check_figure(cell) -> None:
    """The matplotlib figure is a PNG image under the cell."""
    image = cell.locator(".jp-OutputArea-output img[src^='data:image/png']")
    sync_api.expect(image).to_have_count(1, timeout=WIDGET_MS)
    assert image.evaluate("img => img.naturalWidth > 0"), "the figure's image does not decode"


# ----------------------------------------------------------------------------- the test


def test_distributed_cell_shows_widget_and_figure_in_jupyterlab(chromium: Path, lab: Lab, tmp_path: Path):
    write_notebook(lab.root / NOTEBOOK)
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            with explained(page, tmp_path, "the notebook's kernel did not start"):
                open_notebook(page, lab.url)
            kernels = kernel_executables(lab.server.pid)
            assert kernels == [sys.executable], f"the kernel does not run this interpreter: {kernels}"
            with explained(page, tmp_path, "the cells did not all run"):
                run_all_cells(page)
            cell = page.locator(".jp-Notebook .jp-CodeCell").nth(1)
            with explained(page, tmp_path, "the distributed cell's output is wrong"):
                check_no_errors(page)
                check_progress_widget(cell)
                check_figure(cell)
        finally:
            browser.close()
