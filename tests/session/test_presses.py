"""Stop presses at every moment of a session cell: the notebook and the ranks agree afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

import enot_nb
from enot_nb._launch import local_ranks
from enot_nb._state import apply
from enot_nb._state.snapshot import Snapshot
from enot_nb.errors import WorkerFailedError
from tests.session.common import start

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("task", ["cell", "launch"])
def test_a_press_while_the_master_makes_its_outcome_is_late_and_the_outcome_comes_whole(task, tmp_path, monkeypatch):
    """The task's code ran to its end on the master; a press while the master works out what
    it changed is late: its outcome comes whole (a press there had lost it: the master held
    what the task did, the notebook not) and the session runs on."""
    from enot_nb._state import collect

    armed, original = tmp_path / "armed", collect.dump

    def pressed_once(*args, **kwargs):  # in the worker: the session forks this process
        try:
            armed.unlink()
        except FileNotFoundError:
            pass
        else:
            os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(collect, "dump", pressed_once)
    ns = {"t": torch.zeros(4), "log": []}
    with start("fork", namespace=ns) as s:
        armed.touch()
        if task == "cell":
            s.run("log.append(1)\nt.add_(1)")
        else:
            s.launch(lambda: (log.append(1), t.add_(1)))  # noqa: F821 - the rank's globals
        assert not armed.exists()  # the press came
        assert ns["log"] == [1] and float(ns["t"][0]) == 1.0
        assert s.run("float(t[0]), len(log)") == (1.0, 1)


def test_the_stop_button_while_the_master_makes_its_outcome_still_brings_it_whole(tmp_path, monkeypatch):
    """The stop button while the master works out what its finished cell changed: the press is
    late there (ignored), the cell reports the interrupt (the other ranks were stopped), and
    the master's changes come back whole; the groups are kept."""
    from enot_nb._launch import attempt
    from enot_nb._state import collect

    monkeypatch.setattr(attempt, "STACK_DUMP_WAIT", 0.05)  # the press reaches the ranks at once
    here, armed, dumping, original = os.getpid(), tmp_path / "armed", tmp_path / "dumping", collect.dump
    os.mkfifo(dumping)

    def slow_dump(*args, **kwargs):  # in the worker (the session forks this process), once
        try:
            armed.unlink()
        except FileNotFoundError:
            return original(*args, **kwargs)
        with open(dumping, "w") as fifo:
            fifo.write("now\n")  # the press comes now, while this dump takes its time
        time.sleep(1.0)
        return original(*args, **kwargs)

    def press_once_dumping():
        with open(dumping) as fifo:
            fifo.readline()
        os.kill(here, signal.SIGINT)

    monkeypatch.setattr(collect, "dump", slow_dump)
    ns = {"t": torch.zeros(4), "log": []}
    with start("fork", namespace=ns) as s:
        armed.touch()
        presser = threading.Thread(target=press_once_dumping)
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            s.run("log.append(1)\nt.add_(1)")
        presser.join()
        assert s.last is not None and s.last.interrupted and not s.last.failures and not s.last.regrouped
        assert ns["log"] == [1] and float(ns["t"][0]) == 1.0  # all of the master's answer came
        assert s.run("float(t[0]), len(log)") == (1.0, 1)


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.02, 0.08, 0.3])
def test_a_stop_press_at_any_moment_leaves_a_usable_session(delay):
    """A press while the notebook sends the task, while the ranks apply its push, run it or
    send their answers: afterwards the session runs cells and the mirror holds."""
    ns = {"t": torch.zeros(2**18), "log": []}
    with start("fork", namespace=ns) as s:
        s.run("import time\nn = t.numel()")
        ns["t"].add_(1)  # a push to apply
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        try:  # the one press lands anywhere in here
            timer.start()
            s.run("log.append(1)\nt.add_(1)\ntime.sleep(0.2)")
            timer.join()
        except KeyboardInterrupt:
            pass
        timer.join()
        first = s.last
        seen = s.run("float(t[0])")
        assert seen == float(ns["t"][0]), (first, s.last)  # the ranks and the notebook agree
        assert s.run("len(log)") == len(ns["log"])


@pytest.mark.parametrize(
    "where",
    [
        (local_ranks, "load_payload"),  # every rank answered; the master's answer not read yet
        (apply, "apply_changes"),  # the master's changes about to be applied in the notebook
        (Snapshot, "retake"),  # the mirror's record of the ranks half updated
    ],
    ids=["answers-read", "changes-applied", "record-taken"],
)
def test_a_press_after_the_ranks_answered_comes_once_the_notebook_holds_the_answer(where, monkeypatch):
    """The cell is over on every rank: the notebook takes all of its answer, and its record of
    the ranks stays whole (a press there had left the record of one state beside the registry
    of another: the next push failed), then the press is raised."""
    ns = {"t": torch.zeros(2**18), "log": []}
    with start("fork", namespace=ns) as s:
        s.run("n = t.numel()")
        owner, name = where
        original, presses = getattr(owner, name), []

        def pressed_first(*args, **kwargs):
            if not presses:
                presses.append(name)
                os.kill(os.getpid(), signal.SIGINT)  # handled in this thread, at once
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, pressed_first)
        with pytest.raises(KeyboardInterrupt):
            s.run("log.append(1)\nt.add_(1)")
        monkeypatch.undo()
        assert presses == [name]
        assert ns["log"] == [1] and float(ns["t"][0]) == 1.0  # all of the answer came
        ns["t"].add_(1)  # a plain change: pushed against a whole record
        assert s.run("float(t[0]), len(log)") == (2.0, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_press_before_any_line_of_the_notebook_side_leaves_the_ranks_and_the_notebook_agreeing():
    """A press before each line the notebook runs for a session cell (the push, the send, the
    outcome applied, the record taken), one line per cell: the cell ran nowhere, or it ran and
    the notebook holds its answer; the next cell and push see the same state on both sides."""
    import sys

    from enot_nb._launch import bring_back
    from enot_nb._session.kernel import flow as session_flow
    from enot_nb._session.kernel import session as session_kernel
    from enot_nb._session.mirror import mirror
    from enot_nb._state import snapshot
    from tests._util import press_before_line

    modules = (session_kernel, session_flow, bring_back, mirror, snapshot)
    files = {m.__file__ for m in modules}
    ns = {"t": torch.zeros(2**18), "log": []}

    def cell(press_at: int | None) -> int:
        where: list[str] = []
        seen, tracer = press_before_line(press_at, lambda code: code.co_filename in files, where)
        sys.settrace(tracer)
        try:
            s.run("log.append(1)\nt.add_(1)")
        except KeyboardInterrupt:
            assert where, "a press nobody made"
        finally:
            sys.settrace(None)
        ns["t"].add_(1)  # a plain change, pushed against the record the cell left
        assert s.run("float(t[0]), len(log)") == (float(ns["t"][0]), len(ns["log"])), where
        return seen[0]

    with start("fork", namespace=ns) as s:
        s.run("n = t.numel()")
        lines = cell(None)
        assert lines > 100
        for k in range(1, lines + 1):
            cell(k)


@pytest.mark.parametrize("kind", ["session", "one-off"])
def test_a_press_taken_on_another_thread_stops_a_quiet_cell(kind, tmp_path):
    """Jupyter's stop button is a SIGINT to the kernel's process, which may take it on any of
    its threads (ipykernel's, a widget's). Python runs the handler in the main thread once that
    thread's wait for the ranks returns: a cell whose ranks say nothing more waited on for good
    (the session fuzzer's press cells hung, about once in 500 programs). Should the press be
    lost, a second one, to the main thread itself, ends the test (and says so) after 60 s."""
    fifo, main, answered, rescued = tmp_path / "running", threading.get_ident(), threading.Event(), []
    os.mkfifo(fifo)

    def press_from_this_thread() -> None:
        with open(fifo) as running:  # the ranks run the loop
            running.read()
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        if not answered.wait(60):
            rescued.append(True)
            signal.pthread_kill(main, signal.SIGINT)

    presser = threading.Thread(target=press_from_this_thread, daemon=True)
    presser.start()
    try:
        if kind == "session":
            with start("fork", namespace={}) as s:
                with pytest.raises((KeyboardInterrupt, WorkerFailedError)):
                    s.run("import torch.distributed as dist\n" + _SPIN.format(fifo=str(fifo)))
                answered.set()
                assert s.run("1 + 1") == 2
        else:
            with pytest.raises((KeyboardInterrupt, WorkerFailedError)):
                enot_nb.notebook_launcher(_spin, args=(str(fifo),), nprocs=2, backend="gloo", start_method="fork")
    finally:
        answered.set()
        presser.join()
    assert not rescued, "the press taken on another thread was lost: a second press to the main thread ended the cell"


_SPIN = "if dist.get_rank() == 0:\n    open({fifo!r}, 'w').close()\nwhile True:\n    pass"
"""A quiet cell: once it runs (the FIFO opened), it says nothing more."""


def _spin(fifo: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        open(fifo, "w").close()
    while True:
        pass
