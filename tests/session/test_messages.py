"""Messages a user can act on, in a real kernel with a two-rank gloo session: a pull of a name the
ranks do not hold is a usage error naming it (not a rank's failure), and a layer replaced under a
live DDP wrapper is reported once, in our words, saying what to build again."""

from __future__ import annotations

import pytest

from enot_nb.errors import NotHeldError
from tests.kernel import running_kernel

pytestmark = pytest.mark.timeout(180)

MODEL = "import torch, torch.nn as nn\nmodel = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))"
DDP_AND_OPT = (
    "%%enot_distributed\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
    "ddp = DDP(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)"
)
TRAIN = "%%enot_distributed\nfor _ in range(2):\n    ddp(torch.randn(16, 4)).sum().backward()\n    opt.step()"


@pytest.fixture(scope="module")
def kernel():
    with running_kernel("%load_ext enot_nb") as k:
        yield k


@pytest.fixture
def live(kernel):
    kernel.ok("%reset -f\n" + MODEL)
    kernel.ok("%enot_session start -n 2 --backend gloo")
    yield kernel
    kernel.ok("%enot_session stop")


def usage_error(run) -> str:
    """The one line IPython prints for a UsageError (no traceback), or fail."""
    assert run.status == "error" and run.stderr.startswith("UsageError: "), (run.stderr, run.error)
    return run.stderr


def test_a_pull_of_a_name_the_ranks_do_not_hold_is_a_usage_error_naming_it_and_what_they_hold(live):
    live.ok("%%enot_distributed\nlosses = [1.0]")
    text = usage_error(live.run("%enot_pull nonexistent"))
    # model reaches the ranks only when a session cell uses it: they hold losses alone
    assert "'nonexistent'" in text and "it holds losses)" in text, text
    assert "WorkerFailedError" not in text and "rank 0 raised" not in text
    assert "get_ipython" not in text  # what the rank's front end put there is not the user's
    live.ok("%enot_pull losses")  # the session goes on: the refusal was no failure
    assert live.ok("print(losses)").stdout.strip() == "[1.0]"


def test_many_held_names_are_not_listed_but_the_close_ones_are():
    many = [f"name{i}" for i in range(40)] + ["model"]
    err = NotHeldError(["modle"], many)
    assert "41 variables" in str(err) and "model" in str(err) and "name7" not in str(err)
    assert isinstance(err, NameError)
    few = NotHeldError(["x"], ["a", "b"])
    assert "it holds a, b" in str(few)


def test_a_layer_replaced_under_a_live_ddp_wrapper_is_reported_once_saying_what_to_build_again(live):
    live.ok(DDP_AND_OPT)
    live.ok(TRAIN)
    live.ok("model[2] = nn.Linear(8, 2)")  # a plain cell: pushed to the ranks before the next
    run = live.run(TRAIN)
    assert run.error is not None and run.error["ename"] == "StaleWrapperError", (run.error, run.stderr)
    shown = "\n".join(run.error["traceback"])
    assert shown.count("ddp wraps model") == 1, shown  # once: not per rank, not a worker traceback
    assert "2.weight" in shown and "ddp = DDP(model)" in shown and "opt = torch.optim" in shown
    assert "Expected to have finished reduction" not in shown + run.stdout + run.stderr
    live.ok(DDP_AND_OPT)  # built again: it trains, the new layer too
    before = live.ok("w = model[2].weight.detach().clone()")
    live.ok(TRAIN)
    assert before.status == "ok" and live.ok("print(bool((model[2].weight != w).any()))").stdout.strip() == "True"


def test_a_value_written_in_place_under_a_ddp_wrapper_leaves_it_usable(live):
    """Only parameters replaced make a wrapper stale: values written into them are a push like any."""
    live.ok(DDP_AND_OPT)
    live.ok("model[0].weight.data.mul_(2)")
    live.ok(TRAIN)


DEPRECATED = "import torch.distributed as dist\nops = dist.reduce_op  # torch warns on any read of its attributes"


def test_our_reads_of_a_users_object_show_no_warning_a_local_cell_would_not(kernel):
    """torch.distributed.reduce_op warns on any attribute read, an isinstance check included: the
    walks, snapshots and pickles of a one-off cell and of a session read it, a local cell never."""
    kernel.ok("%reset -f\n" + MODEL + "\n" + DEPRECATED)
    local = kernel.ok("flag = ops is not None")
    assert local.stderr == "" and local.stdout == ""
    cells = [
        "%%enot_distributed -n 2 --backend gloo\nflag = ops is not None",
        "%%enot_distributed -n 2 --backend gloo --start-method spawn\nflag = ops is not None",
    ]
    for cell in cells:
        run = kernel.ok(cell)
        assert "Warning" not in run.stdout + run.stderr, (cell, run.stdout + run.stderr)
    kernel.ok("%enot_session start -n 2 --backend gloo")
    try:
        for cell in ["%%enot_distributed\nflag = ops is not None", "flag = 2", "%%enot_distributed\nf = flag"]:
            run = kernel.ok(cell)
            assert "Warning" not in run.stdout + run.stderr, (cell, run.stdout + run.stderr)
        assert "Warning" not in kernel.run("%enot_pull ops").stderr
    finally:
        kernel.ok("%enot_session stop")


def test_the_users_own_warnings_still_show_in_a_distributed_cell(live):
    """Only our reads are quiet: the cell's own code warns as it would locally, on the master."""
    run = live.ok("%%enot_distributed\nimport warnings\nwarnings.warn('from the cell', UserWarning)")
    assert "UserWarning: from the cell" in run.stderr, run.stderr
