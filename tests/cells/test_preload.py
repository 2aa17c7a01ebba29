"""Imports kept across cells (enot_nb._worker.preload): the rule, the CUDA refusal with its
rollback, and forks waiting for the background import. The kernel-level cases (the next fork
and the next spawned worker inherit what a cell imported) are in test_kernel.py."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from enot_nb._worker import preload

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "name, named, kept",
    [
        ("torch._dynamo.eval_frame", set(), True),  # torch's family
        ("sympy.core", set(), True),
        ("xml.dom.minidom", set(), True),  # the standard library
        ("mylib.sub", {"mylib"}, True),  # the cell imported it by name
        ("mylib.sub", set(), False),  # a dependency nobody named: it might read RANK
        ("lightning_fabric.utilities.rank_zero", {"lightning_fabric"}, False),  # caches the rank
        ("pytorch_lightning", {"pytorch_lightning"}, False),
        ("accelerate.state", {"accelerate"}, False),
        ("__main__", {"__main__"}, False),
        ("enot_nb._worker.cell", set(), False),
    ],
)
def test_which_modules_a_kernel_keeps(name, named, kept):
    assert preload.may_keep(name, named) is kept


def _module(tmp_path, name: str, code: str) -> None:
    (tmp_path / f"{name}.py").write_text(code)


@pytest.fixture
def on_path(tmp_path):
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith("enot_test_")]:
        del sys.modules[name]


def test_a_module_that_would_initialize_cuda_is_refused_and_rolled_back(on_path):
    import torch

    _module(on_path, "enot_test_helper", "VALUE = 1\n")
    _module(on_path, "enot_test_cuda", "import enot_test_helper\nimport torch\ntorch.cuda._lazy_init()\n")
    _module(on_path, "enot_test_plain", "import enot_test_helper\nOK = True\n")
    original = torch.cuda._lazy_init
    done = preload.import_all(["enot_test_cuda", "enot_test_plain"])
    assert done.kept == ["enot_test_plain"]
    assert isinstance(done.rolled_back["enot_test_cuda"], preload.CudaRefused)
    assert "enot_test_cuda" not in sys.modules
    assert sys.modules["enot_test_plain"].OK and "enot_test_helper" in sys.modules  # re-imported by plain
    assert torch.cuda._lazy_init is original


def test_the_refusal_is_for_the_preloading_thread_only(on_path):
    """The notebook's own cells run while the background import does: their CUDA calls go
    through (here the CPU build's own error, not the refusal)."""
    import torch

    started, go = threading.Event(), threading.Event()
    seen: list[BaseException] = []
    preload._test_events = (started, go)  # type: ignore[attr-defined]
    _module(
        on_path,
        "enot_test_slow",
        "from enot_nb._worker import preload\ns, g = preload._test_events\ns.set()\ng.wait(30)\n",
    )
    thread = threading.Thread(target=preload.import_all, args=(["enot_test_slow"],))
    thread.start()
    assert started.wait(30)
    try:
        torch.cuda._lazy_init()
    except BaseException as err:  # noqa: BLE001 - which error is the point
        seen.append(err)
    go.set()
    thread.join(30)
    del preload._test_events  # type: ignore[attr-defined]
    assert not (seen and isinstance(seen[0], preload.CudaRefused))


def test_a_fork_waits_for_the_background_import(on_path):
    """A fork halfway through an import would give the child a half-made module. The module
    below finishes only once a fork starts (an at-fork hook registered after the preloader's
    runs first); the child must see it whole."""
    started, go = threading.Event(), threading.Event()
    preload._test_events = (started, go)  # type: ignore[attr-defined]
    _module(
        on_path,
        "enot_test_forked",
        "from enot_nb._worker import preload\ns, g = preload._test_events\ns.set()\ng.wait(30)\nWHOLE = True\n",
    )
    preloader = preload.Preloader()
    os.register_at_fork(before=preloader.wait)
    os.register_at_fork(before=go.set)  # runs before the preloader's wait (last registered, first run)
    preloader.start(["enot_test_forked"])
    assert started.wait(30)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if getattr(sys.modules.get("enot_test_forked"), "WHOLE", False) else 1)
    _, status = os.waitpid(pid, 0)
    go.set()
    del preload._test_events  # type: ignore[attr-defined]
    assert os.waitstatus_to_exitcode(status) == 0


def test_only_a_cell_that_imports_what_is_being_imported_waits_for_it(on_path):
    """A plain cell after a distributed one waits for the background import only where it
    imports one of the packages being imported, or may (dynamic imports, a cell magic)."""
    started, go = threading.Event(), threading.Event()
    preload._test_events = (started, go)  # type: ignore[attr-defined]
    _module(
        on_path,
        "enot_test_waited",
        "from enot_nb._worker import preload\ns, g = preload._test_events\ns.set()\ng.wait(30)\n",
    )
    preloader = preload.Preloader()
    preloader.start(["enot_test_waited"])
    assert started.wait(30)
    try:
        assert not preloader.must_wait_for("x = 1\nprint(x)")
        assert not preloader.must_wait_for("import json\n%time y = 2\n!ls")
        assert preloader.must_wait_for("import enot_test_waited")
        assert preloader.must_wait_for("from enot_test_waited import thing")
        assert preloader.must_wait_for("m = __import__('enot_test_waited')")
        assert preloader.must_wait_for("import importlib\nimportlib.import_module('json')")
        assert preloader.must_wait_for("%%timeit\nx = 1")
    finally:
        go.set()
        preloader.wait()
        del preload._test_events  # type: ignore[attr-defined]
    assert not preloader.must_wait_for("import enot_test_waited")  # done: nothing to wait for
