"""Step into a rank: ``breakpoint()``, ``input()`` and ``%enot_debug`` on a session's rank read
the notebook's front end (jupyter_client answering its stdin requests, as a user types), in a real
kernel under fork and spawn; a front end without stdin gets StdinNotImplementedError at once; a
one-off cell says to use a session."""

from __future__ import annotations

import os
import re

import pytest

from tests.kernel import running_kernel

pytestmark = pytest.mark.timeout(240)

TRAINING = (
    "%%enot_distributed\n"
    "import torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(0)\n"
    "ddp = DDP(torch.nn.Linear(4, 1))\n"
    "opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)\n"
    "def step():\n"
    "    ddp(torch.randn(8, 4)).pow(2).mean().backward()\n"
    "    opt.step()\n"
    "    opt.zero_grad()\n"
    "step()\n"
    "ids = (id(ddp), id(opt))\n"
)
BREAK_ON_RANK_1 = (
    "%%enot_distributed\nx = 41 + dist.get_rank()\nif dist.get_rank() == 1:\n    breakpoint()\n    y = x + 1\nstep()\n"
)


def _typed(*lines: str):
    """The front end's answers, in order; the prompts are kept in the run."""
    left = list(lines)
    return lambda prompt, run: left.pop(0)


def _same_training(k) -> None:
    """The session still trains with the same DDP wrapper and optimizer."""
    again = k.ok("%%enot_distributed\nstep()\n(id(ddp), id(opt)) == ids")
    assert again.result["text/plain"] == "True", again.stderr


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_breakpoint_on_rank_1_is_driven_from_the_notebook_and_quitting_keeps_the_session(start_method):
    with running_kernel("%load_ext enot_nb") as k:
        k.ok(f"%enot_session start -n 2 --backend gloo --start-method {start_method}")
        k.ok(TRAINING)
        run = k.run(BREAK_ON_RANK_1, timeout=120, answer=_typed("p x", "n", "p y", "c"))
        assert run.error is None, run.traceback
        assert len(run.prompts) == 4 and all(re.match(r"\[rank 1 · 29:[0-5]\d left\] ", p) for p in run.prompts)
        assert all(p.endswith("] ipdb> ") for p in run.prompts), run.prompts  # IPython's, as in a local cell
        assert "42" in run.stdout and "43" in run.stdout  # rank 1's x and y, shown under --output master
        _same_training(k)
        quit_ = k.run(BREAK_ON_RANK_1, timeout=120, answer=_typed("q"))
        assert quit_.error is None, quit_.error  # as a local cell's q: IPython shows a BdbQuit as nothing
        assert "enot_nb: the debugger was quit on rank 1: the cell stopped there" in quit_.stderr
        _same_training(k)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_post_mortem_opens_on_the_rank_that_raised(start_method):
    with running_kernel("%load_ext enot_nb") as k:
        k.ok(f"%enot_session start -n 2 --backend gloo --start-method {start_method}")
        k.ok(TRAINING)
        failed = k.run(
            "%%enot_distributed\nif dist.get_rank() == 1:\n    w = 5\n    raise ValueError('boom')\nstep()\n"
        )
        assert failed.error is not None and "ValueError" in failed.error["evalue"]
        no_stdin = k.run("%enot_debug", allow_stdin=False)  # fails in the debugger: not the failure to debug
        assert "StdinNotImplementedError" in no_stdin.error["evalue"], no_stdin.error
        debugged = k.run("%enot_debug", timeout=120, answer=_typed("p w * 2", "q"))
        assert debugged.error is None, debugged.traceback
        # No peer waits for a post-mortem: no time left in its prompt.
        assert debugged.prompts == ["[rank 1] ipdb> ", "[rank 1] ipdb> "], debugged.prompts
        shown = re.sub(r"\x1b\[[0-9;]*m", "", debugged.stdout)  # IPython's debugger colours its listing
        assert "\n10\n" in shown and "----> 4     raise ValueError('boom')" in shown, shown
        again = k.run("%enot_debug", timeout=120, answer=_typed("p w + 1", "c"))  # the same traceback, not q's
        assert "\n6\n" in re.sub(r"\x1b\[[0-9;]*m", "", again.stdout), again.stdout
        _same_training(k)
        assert "StdinNotImplementedError" in k.run("%enot_debug 0", allow_stdin=False).error["evalue"]
        released = k.run("%enot_debug 0", timeout=120, answer=_typed("where", "q"))  # released in step()
        assert released.error is None and released.prompts == ["[rank 0] ipdb> "] * 2, released.prompts
        assert "step()" in re.sub(r"\x1b\[[0-9;]*m", "", released.stdout), released.stdout  # not the debugger's own


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_input_on_the_master_reads_the_front_end(start_method):
    with running_kernel("%load_ext enot_nb") as k:
        k.ok(f"%enot_session start -n 2 --backend gloo --start-method {start_method}")
        run = k.run(
            "%%enot_distributed\nimport torch.distributed as dist\n"
            "name = input('name? ') if dist.get_rank() == 0 else None",
            answer=_typed("ada"),
        )
        assert run.error is None, run.traceback
        assert (
            len(run.prompts) == 1
            and run.prompts[0].startswith("[rank 0 · ")
            and run.prompts[0].endswith(" left] name? ")
        )
        assert k.ok("name").result["text/plain"] == "'ada'"
        assert "UsageError: %enot_debug: no cell has failed on this session's ranks" in k.run("%enot_debug").stderr
        assert "rank 1 has no failed cell to debug" in k.run("%enot_debug 1").error["evalue"]
        assert "rank 5 is not one of this session's ranks (0 to 1)" in k.run("%enot_debug 5").stderr


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_front_end_without_stdin_gets_stdin_not_implemented_at_once(start_method):
    with running_kernel("%load_ext enot_nb") as k:
        k.ok(f"%enot_session start -n 2 --backend gloo --start-method {start_method}")
        for asking in ("breakpoint()", "input('x? ')"):
            run = k.run(
                f"%%enot_distributed\nimport torch.distributed as dist\nif dist.get_rank() == 1:\n    {asking}\n",
                allow_stdin=False,
                timeout=60,
            )
            assert run.error is not None and "rank 1 raised StdinNotImplementedError" in run.error["evalue"], run.error
            assert not run.prompts
        assert k.ok("%%enot_distributed\nx = 1\nx").result["text/plain"] == "1"


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_the_stop_button_at_a_prompt_and_a_peers_failure_close_the_debugger_and_keep_the_session(
    start_method, tmp_path
):
    with running_kernel("%load_ext enot_nb") as k:
        k.ok(f"%enot_session start -n 2 --backend gloo --start-method {start_method}")
        k.ok(TRAINING)

        def press(prompt, run):
            k.manager.interrupt_kernel()
            return None  # the stop button, instead of a line

        stopped = k.run(BREAK_ON_RANK_1, timeout=120, answer=press)
        assert stopped.error is not None and stopped.error["ename"] == "KeyboardInterrupt", stopped.error
        assert "session restarted" not in stopped.stderr + stopped.stdout, stopped.stderr
        _same_training(k)
        # Rank 0 fails while rank 1 steps in its debugger: the debugger closes, rank 0's error shows.
        fifo = tmp_path / "rank1-in-debugger"
        os.mkfifo(fifo)

        def step_on(prompt, run):
            if not run.prompts[:-1]:  # the first prompt: rank 1 is in its debugger
                with open(fifo, "w") as said:
                    said.write("x")
            return "n"

        failed = k.run(
            "%%enot_distributed\nif dist.get_rank() == 1:\n    breakpoint()\n    while True:\n        x = 1\n"
            f"else:\n    open({str(fifo)!r}).read()\n    raise ValueError('rank 0 fails')\n",
            timeout=120,
            answer=step_on,
        )
        assert failed.error is not None and "rank 0 raised ValueError: rank 0 fails" in failed.error["evalue"]
        assert "BdbQuit" not in failed.error["evalue"] and "session restarted" not in failed.stderr
        _same_training(k)


def test_a_one_off_cell_says_to_use_a_session_for_input_and_the_debugger():
    with running_kernel("%load_ext enot_nb") as k:
        for code in ("x = input('x? ')", "breakpoint()"):
            run = k.run(f"%%enot_distributed -n 2 --backend gloo\n{code}", timeout=60)
            assert run.error is not None and "StdinNotImplementedError" in run.error["evalue"], run.error
            assert "start a session (%enot_session start -n N) and run the cell there" in run.error["evalue"]
        no_session = k.run("%enot_debug")
        assert "UsageError: %enot_debug needs a session" in no_session.stderr
