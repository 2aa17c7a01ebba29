"""%%enot_distributed and notebook_launcher in a real Jupyter kernel (jupyter_client)."""

from __future__ import annotations

import re
import time

import pytest

from tests._util import METHODS, descendants, is_fork_server_of, record_figure, wait_gone
from tests.kernel import running_kernel

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
MAGIC = "%%enot_distributed -n 2 --backend gloo"


@pytest.fixture(scope="module")
def kernel():
    with running_kernel("%load_ext enot_nb\nimport torch\nfrom enot_nb import distributed as ed") as k:
        yield k


def test_only_rank_0_prints(kernel):
    run = kernel.ok(
        f"{MAGIC}\nprint('hello from', ed.get_rank())\nimport sys\nprint('err from', ed.get_rank(), file=sys.stderr)"
    )
    assert run.stdout == "hello from 0\n"
    assert run.stderr == "err from 0\n"


def test_output_all_shows_every_rank(kernel):
    run = kernel.ok(f"{MAGIC} --output all\nprint('hello from', ed.get_rank())")
    assert sorted(run.stdout.splitlines()) == ["[rank 0] hello from 0", "[rank 1] hello from 1"]


@pytest.mark.parametrize("method", METHODS)
def test_functions_and_classes_from_earlier_cells(kernel, method):
    kernel.ok(
        "def double(v):\n    return 2 * v\n\nclass Box:\n    def __init__(self, v):\n"
        "        self.v = v\nseed_value = 21"
    )
    run = kernel.ok(
        f"{MAGIC} --start-method {method}\nbox = Box(double(seed_value))\nanswer = box.v + ed.get_rank()\nanswer"
    )
    assert run.result["text/plain"] == "42"
    assert kernel.ok("print(answer, box.v, type(box).__name__)").stdout == "42 42 Box\n"


@pytest.mark.parametrize("method", METHODS)
def test_trained_model_and_optimizer_come_back_in_place(kernel, method):
    kernel.ok(
        "torch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
        "same_model, before = model, model.weight.detach().clone()\nlosses = []\n"
        "data = torch.randn(16, 4)"
    )
    run = kernel.ok(
        f"{MAGIC} --start-method {method}\n"
        "for step in range(5):\n"
        "    loss = model(data).pow(2).mean()\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    losses.append(loss.item())\n"
        "final = loss.item()\n"
    )
    assert run.result is None
    check = kernel.ok(
        "print(model is same_model, not torch.equal(model.weight, before),"
        " opt.param_groups[0]['params'][0] is model.weight,"
        " 'momentum_buffer' in opt.state[model.weight], len(losses), losses[-1] == final)"
    )
    assert check.stdout == "True True True True 5 True\n"


def test_matplotlib_figures_arrive_as_png(kernel):
    run = kernel.ok(
        f"{MAGIC}\nimport matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()\n"
        "plt.figure()\nplt.plot([3, 2, 1])  # left open: shown at the end\nNone"
    )
    pngs = [d for d in run.displays if "image/png" in d["data"]]
    assert len(pngs) == 2


def test_display_html_and_last_expression(kernel):
    run = kernel.ok(
        f"{MAGIC}\nfrom IPython.display import HTML, display\n"
        "display(HTML('<b>bold</b>'))\n{'rank': ed.get_rank(), 'world': ed.get_world_size()}"
    )
    assert any(d["data"].get("text/html") == "<b>bold</b>" for d in run.displays)
    assert run.result["text/plain"] == "{'rank': 0, 'world': 2}"
    assert kernel.ok("_['world']").result["text/plain"] == "2"


def test_semicolon_suppresses_out(kernel):
    assert kernel.ok(f"{MAGIC}\n1 + 1;").result is None


@pytest.mark.parametrize("method", METHODS)
def test_exception_on_one_rank_shows_cell_lines(kernel, method):
    kernel.ok("keep = 'before'")
    run = kernel.run(
        f"{MAGIC} --start-method {method}\nkeep = 'changed'\nif ed.get_rank() == 1:\n    raise ValueError('bad rank')\n"
    )
    assert run.error["ename"] == "WorkerFailedError"
    text = run.traceback
    assert "rank 1 raised ValueError: bad rank" in text
    assert 'File "<enot_distributed cell>", line 4, in <module>' in text  # the notebook's line
    assert "raise ValueError('bad rank')" in text
    assert "enot_nb/_worker/" not in text and "launcher.py" not in text
    assert kernel.ok("print(keep)").stdout == "before\n"  # kernel alive, nothing applied


def test_unpicklable_variable_under_spawn(kernel):
    kernel.ok("import threading\nlock = threading.Lock()")
    run = kernel.run(f"{MAGIC} --start-method spawn\nwith lock:\n    pass\n")
    assert "variable 'lock' could not be sent to the workers" in run.traceback
    assert "cannot be pickled" in run.traceback


def test_unpicklable_result_is_named(kernel):
    kernel.ok(f"{MAGIC}\nimport threading\nmade = threading.Lock()\nfine = 3")
    notes = kernel.ok("import enot_nb\nprint(enot_nb.last_notes())").stdout
    assert "'made' was not brought back: lock cannot be pickled" in notes
    assert kernel.ok("fine").result["text/plain"] == "3"


def test_return_options(kernel):
    kernel.ok(f"{MAGIC} --return a\na = 1\nb = 2")
    assert kernel.ok("print('a' in dir(), 'b' in dir())").stdout == "True False\n"
    kernel.ok(f"{MAGIC} --no-return\nc = 1")
    assert kernel.ok("print('c' in dir())").stdout == "False\n"


@pytest.mark.parametrize(
    "line, words",
    [
        ("--nprocs 0", "-n 0 must be an integer >= 1"),  # the magic's words, not the launcher's
        ("-n 2 --bogus", "unrecognized arguments"),
        ("-n 2 --output loud", "invalid choice"),
        ("-n 2 --speed --reproducible", "mutually exclusive"),
        ("-n 2 --sync a --no-sync", "contradict"),
        ("-n 2 --sync 1x", "NAME[,NAME...]"),
    ],
)
def test_bad_options_are_usage_errors(kernel, line, words):
    run = kernel.run(f"%%enot_distributed {line}\npass")
    # IPython prints a UsageError as one line, without a traceback
    assert run.status == "error" and run.stderr.startswith("UsageError: ")
    assert words in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("method", METHODS)
def test_line_magics_and_shell_lines(kernel, method):
    run = kernel.ok(
        f"{MAGIC} --start-method {method}\n%time t = 1 + 1\n!echo shell-ok\n"
        "print('t =', t)\nnames = %who_ls\nprint('who:', 't' in names)"
    )
    assert "shell-ok" in run.stdout and "t = 2" in run.stdout and "who: True" in run.stdout


def test_notebook_function_through_launcher_under_spawn(kernel):
    kernel.ok(
        "import enot_nb\ndef work(k):\n    import torch.distributed as dist\n"
        "    t = torch.ones(1) * (ed.get_rank() + 1)\n    dist.all_reduce(t)\n    return t.item() * k"
    )
    run = kernel.ok("enot_nb.notebook_launcher(work, args=(2,), nprocs=2, backend='gloo', start_method='spawn')")
    assert run.result["text/plain"] == "6.0"


def test_launcher_failure_renders_worker_traceback(kernel):
    kernel.ok("def fails():\n    if ed.get_rank() == 1:\n        raise KeyError('missing')\n")
    run = kernel.run("enot_nb.notebook_launcher(fails, nprocs=2, backend='gloo')")
    assert run.error["ename"] == "WorkerFailedError"
    assert "rank 1 raised KeyError" in run.traceback and "in fails" in run.traceback


def worker_pids(run) -> list[int]:
    return [int(p) for p in re.findall(r"worker-pid (\d+)", run.stdout)]


LONG_CELL = f"{MAGIC} --output all\nimport os, time\nprint('worker-pid', os.getpid(), flush=True)\ntime.sleep(600)"


@pytest.mark.parametrize("method", METHODS)
def test_interrupt_button_stops_a_long_cell(method):
    with running_kernel("%load_ext enot_nb") as k:
        seen = {}

        def interrupt_when_started(run):
            if len(worker_pids(run)) == 2 and "t" not in seen:
                seen["t"] = time.monotonic()
                seen["pids"] = worker_pids(run)
                k.manager.interrupt_kernel()

        run = k.run(
            LONG_CELL.replace("--output all", f"--output all --start-method {method}"), on_output=interrupt_when_started
        )
        assert "t" in seen, f"the two workers never printed their pids: {run.stdout!r}"
        record_figure("interrupt_to_error_kernel_s", time.monotonic() - seen["t"])
        assert run.error["ename"] == "KeyboardInterrupt"
        assert "where each of the 2 running rank(s) is" in run.stderr
        wait_gone(seen["pids"])  # the workers end (the test's timeout says if never)
        assert k.ok("print('alive')").stdout == "alive\n"  # the kernel goes on
        owners = {k.pid}
        assert [p for p in descendants(k.pid) if not is_fork_server_of(p, owners)] == []


def test_kernel_restart_ends_the_workers():
    with running_kernel("%load_ext enot_nb") as k:
        pids = []
        msg_id = k.client.execute(LONG_CELL)
        while len(pids) < 2:
            msg = k.client.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                pids += [int(p) for p in re.findall(r"worker-pid (\d+)", msg["content"]["text"])]
        k.manager.restart_kernel(now=True)
        record_figure("kernel_restart_cleanup_s", wait_gone(pids))


def test_large_notebook_tensor_reaches_spawned_workers_through_shared_memory(kernel):
    kernel.ok("big = torch.arange(2 * 2**20)")
    kernel.ok(
        f"{MAGIC} --start-method spawn\nwith open('/proc/self/maps') as maps:\n"
        "    shared = 'enot_nb-tensor' in maps.read()\ntotal = int(big.sum())\ndel maps"
    )
    assert kernel.ok("print(shared, total == int(big.sum()))").stdout == "True True\n"


def test_magic_help_lists_the_options(kernel):
    run = kernel.ok("from enot_nb.magic import EnotMagics\nprint(EnotMagics.enot_distributed.__doc__)")
    for option in (
        "--nprocs",
        "--backend",
        "--seed",
        "--speed",
        "--reproducible",
        "--start-method",
        "--output",
        "--sync",
        "--no-sync",
        "--return",
        "--no-return",
        "--timeout",
        "--nnodes",
        "--node-rank",
        "--master-addr",
        "--master-port",
    ):
        assert option in run.stdout


def test_progress_bars_keep_their_carriage_returns(kernel):
    run = kernel.ok(
        f"{MAGIC}\nimport sys\nfor i in range(3):\n"
        "    sys.stderr.write(f'\\rstep {i}/3')\n    sys.stderr.flush()\nprint()"
    )
    assert "\rstep 0/3\rstep 1/3\rstep 2/3" in run.stderr


def test_a_note_is_shown_once_per_kernel_unless_its_reason_changes(kernel):
    """What did not come back is a quiet note (stdout, not the red stderr box), shown the first
    time only; enot_nb.last_notes() lists the last cell's again."""
    cell = f"{MAGIC}\nimport threading\nheld = threading.Lock()"
    first, second = kernel.ok(cell), kernel.ok(cell)
    note = "enot_nb note: 'held' was not brought back: lock cannot be pickled"
    assert note in first.stdout and "held" not in first.stderr
    assert "held" not in second.stdout + second.stderr
    assert "'held' was not brought back" in kernel.ok("import enot_nb\nprint(enot_nb.last_notes())").stdout
    changed = kernel.ok(f"{MAGIC}\nimport threading\nheld = threading.RLock()")  # another reason
    assert "enot_nb note: 'held' was not brought back: RLock cannot be pickled" in changed.stdout
    kernel.run(f"{MAGIC}\nraise ValueError('no notes from a failed cell')")
    assert kernel.ok("print(enot_nb.last_notes())").stdout == "[]\n"


@pytest.mark.parametrize("method, module", [("fork", "wave"), ("spawn", "tabnanny")])
def test_what_a_cell_imported_stays_imported_as_after_a_local_cell(kernel, method, module):
    """The README's DDP cell re-imported torch._dynamo (822 modules, 2 s) in every fresh worker
    on every run. What the master imported, failed cell or not, is imported in the kernel too
    (as a local cell leaves it) and in the fork server: the next workers start with it."""
    check = f"import sys\nprint({module!r} in sys.modules)"
    assert kernel.ok(check).stdout == "False\n"
    # The master fails (a rank that fails first may stop the master before it can report).
    failed = kernel.run(
        f"{MAGIC} --start-method {method}\nimport {module}\nif ed.get_rank() == 0:\n    raise ValueError('after')"
    )
    assert failed.error["ename"] == "WorkerFailedError"
    waited = kernel.ok("from enot_nb._worker import preload\npreload.PRELOADER.wait()\n" + check)
    assert waited.stdout == "True\n"
    assert kernel.ok(f"{MAGIC} --start-method {method}\n{check}").stdout == "True\n"


def test_a_spawn_cells_traceback_names_the_notebook_cell_and_line(kernel):
    """A notebook function shipped to spawned workers keeps its cell's file and lines: its frame
    reads ``Cell In[N], line L`` with the line's source, as a local cell's does."""
    kernel.ok("def boom_spawned():\n    x = 1\n    raise KeyError('spawned')")
    run = kernel.run("%%enot_distributed -n 2 --backend gloo --start-method spawn\nboom_spawned()")
    assert run.error is not None and run.error["ename"] == "WorkerFailedError"
    assert re.search(r"Cell In\[\d+\], line 3, in boom_spawned\n", run.traceback), run.traceback
    assert "raise KeyError('spawned')" in run.traceback and "<dynamic-code>" not in run.traceback
