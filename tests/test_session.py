"""enot_nb.Session from code: real workers over gloo, kept across calls; failures, deaths and
interrupts leave a usable (or restarted) session and no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time
import types

import pytest
import torch

import enot_nb
from enot_nb._session.kernel import workers as session_workers
from enot_nb._state import apply
from enot_nb._state.snapshot import Snapshot
from enot_nb.errors import LaunchError, WorkerFailedError
from enot_nb.sessions import Session, session

pytestmark = pytest.mark.timeout(120)

DDP_SETUP = (
    "import torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "ddp = DDP(model)\n"
)


def start(start_method: str, **kwargs) -> Session:
    return Session(nprocs=2, backend="gloo", start_method=start_method, quiet=True, **kwargs)


def test_state_lives_on_the_ranks_and_the_namespace_mirrors_the_master(start_method):
    torch.manual_seed(0)
    ns = {"model": torch.nn.Linear(2, 2), "lr": 0.1}
    weight = ns["model"].weight
    with start(start_method, namespace=ns) as s:
        assert session() is s and enot_nb.session() is s
        s.run(DDP_SETUP + "opt = torch.optim.SGD(ddp.parameters(), lr=lr)\nsteps = 0")
        assert "ddp" not in ns  # a DDP wrapper cannot cross; it lives on the ranks
        train = (
            "for _ in range(3):\n    opt.zero_grad(); ddp(torch.ones(4, 2)).sum().backward(); opt.step()\nsteps += 3"
        )
        s.run(train)  # the wrapper and the optimizer built in the cell before
        assert ns["steps"] == 3 and ns["model"].weight is weight  # in place, identity kept
        after_three = weight.detach().clone()
        ns["lr"] = 0.0  # a plain change reaches every rank before the next run
        s.run("opt.param_groups[0]['lr'] = lr\n" + train)
        assert torch.equal(weight, after_three) and ns["steps"] == 6
        ranks = s.launch(lambda: [float(p.detach().sum()) for p in model.parameters()])  # noqa: F821 - rank's globals
        assert ranks == [float(p.detach().sum()) for p in ns["model"].parameters()]
    assert session() is None


def test_a_plain_change_in_place_reaches_every_rank():
    ns = {"t": torch.zeros(4)}
    with start("fork", namespace=ns) as s:
        s.run("u = t")  # the ranks hold t (and u, the same tensor)
        ns["t"][1] = 5.0  # a plain cell writes one element
        seen = s.launch(lambda: [t.tolist(), u is t])  # noqa: F821
        assert seen == [[0.0, 5.0, 0.0, 0.0], True]
        assert s.run("float(t.sum())") == 5.0


def test_an_object_taken_out_of_a_synced_one_into_a_new_variable_keeps_its_changes():
    """``c = d.pop('k'); c.scale = 2.0`` in a plain cell: no synced variable reaches the object
    any more, but the new one does, and the cell that uses it sees the change (the rank binds
    its own object, found at the old path, and changes it as the notebook's changed)."""
    import types

    ns = {"d": {"k": types.SimpleNamespace(scale=1.0)}}
    with start("fork", namespace=ns) as s:
        s.run("d")
        c = ns["d"].pop("k")
        c.scale = 2.0
        ns["c"] = c
        assert s.run("c.scale, len(d)") == (2.0, 0)
        assert s.launch(lambda: (c.scale, len(d))) == (2.0, 0)  # noqa: F821 - the rank's


@pytest.fixture(params=["tracked", "shadow"])
def pages(request, monkeypatch):
    """How a long-lived process tells the pages it wrote: the kernel's write tracking (see
    _memory/writes), or, where that is refused, a paused shadow fork."""
    from enot_nb._memory.writes import WRITES

    if request.param == "shadow":
        monkeypatch.setenv("ENOT_NB_TRACK_WRITES", "0")  # the workers inherit it
    elif not WRITES.available():
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    return request.param


def test_new_grads_every_step_leave_records_that_match_what_they_record(pages):
    """A training step replaces each parameter's ``.grad`` with a new tensor: the notebook's
    record is updated in place (the new grads in the old ones' places), or walked again where
    the cell also rebound a name it walked, carrying over the states and digests of what did
    not move; the master finds its registry again. Each must match the state it records (the
    notebook's record finds nothing changed right after the cell), and a change after it to what
    was carried over (a 128 KiB buffer that training leaves alone: write-tracked, its reset
    kept) still crosses: from a plain cell to the ranks, from a session cell back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.BatchNorm1d(300), torch.nn.Linear(300, 2))
    model[2].register_buffer("table", torch.zeros(2**15))
    ns = {"model": model, "x": torch.randn(8, 64)}
    step = "opt.zero_grad()\nmodel(x).sum().backward()\nopt.step()"
    with start("fork", namespace=ns) as s:
        s.run("import torch\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
        # The record is updated in place after a plain step; walked again (what did not move
        # carried over) after one that also rebinds a name it walked (update cannot keep paths)
        for cell in (step, step, step, step + "\nx = x.clone()", step + "\nx = x.clone()", step):
            grads = [p.grad for p in model.parameters()]
            s.run(cell)
            assert all(p.grad is not g for p, g in zip(model.parameters(), grads))  # new tensors, as locally
            record = s.flow.mirror.record
            assert record.snapshot is not None
            assert record.snapshot.changed_objects(record.baseline) == [], cell
            assert record.snapshot.changed_storages(record.baseline) == [], cell
        model[2].table[5] = 3.0  # a plain change to what both records carried over
        model[0].weight.data[0, 0] = 7.0
        sums = s.run("float(model[2].table.sum()), float(model[0].weight[0, 0]), float(model[2].weight.grad.sum())")
        assert sums == (3.0, 7.0, float(model[2].weight.grad.sum()))
        for _ in range(2):  # (the first takes a fresh snapshot on the master: a push came before it)
            s.run(step)
        s.run("model[2].table[7] = 2.0")  # the master's snapshot, carried over, sees its write
        assert float(model[2].table.sum()) == 5.0 and float(model[2].table[7]) == 2.0
        assert s.run("float(model[0].weight[0, 0])") == float(model[0].weight.detach()[0, 0])


def test_one_element_written_into_a_large_tensor_sends_a_page(pages):
    """Both ways, a long-lived process sends only the pages written since the last sync."""
    ns = {"big": torch.zeros(2**24)}  # 64 MiB, all of whose pages the notebook wrote
    with start("fork", namespace=ns) as s:
        s.run("n = big.numel()")  # the ranks hold it (it travelled whole, once)
        s.run("big[5] = 1.0")  # the master writes one element
        assert float(ns["big"][5]) == 1.0 and s.last.result_bytes < 1 << 20
        ns["big"][2**23] = 2.0  # a plain cell writes one element
        assert s.run("float(big[2**23] + big[5])") == 3.0 and s.last.task_bytes < 1 << 20


def test_deleting_and_rebinding_reach_the_ranks():
    ns = {"a": 1, "b": [1]}
    with start("fork", namespace=ns) as s:
        s.run("c = a + len(b)")
        del ns["a"]
        ns["b"] = [1, 2, 3]
        assert s.run("('a' in globals(), len(b))") == (False, 3)


def test_launch_ships_the_function_by_value_with_the_session_namespace():
    ns = {}
    with start("spawn", namespace=ns) as s:
        s.run("import torch.distributed as dist\nbase = 10 * (dist.get_rank() + 1)")

        def fn(k, scale=1):
            return (base + k) * scale  # noqa: F821 - the rank's session variable

        assert s.launch(fn, 1, scale=2) == 22  # rank 0's result


def test_mirror_none_moves_nothing_unless_asked():
    ns = {"t": torch.zeros(3)}
    held = ns["t"]
    with start("fork", namespace=ns, mirror="none") as s:
        s.push(t=torch.ones(3), k=7)
        s.run("t.mul_(k)\nnew = [1, 2]")
        assert torch.equal(ns["t"], torch.zeros(3)) and "new" not in ns  # nothing came back
        pulled = s.pull("t", "new")
        assert ns["t"] is held and torch.equal(held, torch.full((3,), 7.0))  # in place
        assert pulled == {"t": held, "new": [1, 2]} and ns["new"] == [1, 2]


def test_a_failure_on_one_rank_names_it_and_the_session_goes_on():
    ns = {"log": []}
    with start("fork", namespace=ns) as s:
        cell = "import torch.distributed as dist\nlog.append(1)\nif dist.get_rank() == 1:\n    raise ValueError('x')"
        with pytest.raises(WorkerFailedError) as failed:
            s.run(cell)
        assert failed.value.rank == 1 and "ValueError: x" in str(failed.value)
        assert ns["log"] == [1]  # the master's state at the failure, as a local cell keeps it
        assert s.run("log.append(2)\nlen(log)") == 2


def test_a_rank_blocked_in_a_collective_is_released_and_the_group_made_again(capfd):
    torch.manual_seed(0)
    ns = {"model": torch.nn.Linear(2, 2)}
    with start("fork", namespace=ns) as s:
        s.run(DDP_SETUP)  # the wrapper keeps gloo's group alive: its abort alone releases nobody
        pids = [row.pid for row in s.status().rows]
        with pytest.raises(WorkerFailedError) as failed:
            s.run("if dist.get_rank() == 1:\n    raise ValueError('boom')\ndist.barrier()")
        assert failed.value.rank == 1
        err = capfd.readouterr().err
        assert "process group was made again" in err and "restarted" not in err  # released, not replaced
        assert [row.pid for row in s.status().rows] == pids
        assert s.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)") == 2.0  # the new group works


def test_a_rank_killed_mid_cell_restarts_the_session_from_the_mirror(capfd, start_method):
    ns = {"x": 41}
    with start(start_method, namespace=ns) as s:
        s.run("import os, signal, torch.distributed as dist\ny = x + 1")
        pids = [row.pid for row in s.status().rows]
        with pytest.raises(WorkerFailedError) as failed:
            s.run("if dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\ndist.barrier()")
        assert failed.value.rank == 1 and failed.value.signal_name == "SIGKILL"
        err = capfd.readouterr().err
        assert "session restarted (rank 1 died (SIGKILL))" in err
        assert "restored from the notebook (on the CPU): " in err and "x" in err.split("restored")[1]
        rows = s.status().rows
        assert [r.state for r in rows] == ["idle", "idle"] and not {r.pid for r in rows} & set(pids)
        assert s.run("x + y") == 83  # the notebook's state reached the new workers
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] == "Z"


def test_the_stop_button_interrupts_every_rank_and_they_keep_their_state(capfd):
    ns = {}
    with start("fork", namespace=ns) as s:
        s.run("import time, torch.distributed as dist\nmarks = []")
        pids = [row.pid for row in s.status().rows]
        timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                s.run("marks.append(dist.get_rank())\ntime.sleep(60)")
        finally:
            timer.cancel()
        err = capfd.readouterr().err
        assert "[rank 1] where it was" in err and '"<enot_distributed cell>", line 2' in err
        assert ns["marks"] == [0]  # the master's state at the interrupt
        assert [row.pid for row in s.status().rows] == pids  # the same workers survived
        assert s.run("marks + [len(marks)]") == [0, 1]


def test_status_shows_a_row_per_rank():
    with start("fork", namespace={}) as s:
        s.run("x = 1")
        status = s.status()
        assert [r.rank for r in status.rows] == [0, 1]
        assert all(r.state == "idle" and r.rss_mib and r.cells == 1 and r.device == "cpu" for r in status.rows)
        assert "rank" in str(status) and "<table>" in status._repr_html_()


def test_a_second_session_is_refused_and_a_closed_one_says_so():
    with start("fork", namespace={}) as s:
        with pytest.raises(LaunchError, match="already running"):
            start("fork", namespace={})
    with pytest.raises(LaunchError, match="closed"):
        s.run("pass")


def test_a_session_with_every_worker_dead_restarts_before_the_cell(capfd):
    with start("fork", namespace={"v": 3}) as s:
        for row in s.status().rows:
            os.kill(row.pid, signal.SIGKILL)
        while any(r.running for r in s.workers.attempt.ranks):  # their deaths seen (events: pidfds)
            s.workers.attempt.handle(s.workers.attempt.select(0.1))
        assert s.run("v * 2") == 6
        assert "session restarted (all its workers were dead)" in capfd.readouterr().err


def _counts(pid: int) -> tuple[int, int, float]:
    """Descriptors, threads and resident memory (MiB) of a process, from /proc."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = len(os.listdir(f"/proc/{pid}/task"))
    with open(f"/proc/{pid}/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
    return fds, threads, rss


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_five_hundred_cells_grow_no_descriptors_threads_or_memory():
    ns = {"t": torch.zeros(1000), "log": []}
    with start("fork", namespace=ns) as s:
        cell = "t.add_(1)\nlog.append(len(log))\nif len(log) > 10:\n    del log[0]\nx = float(t[0])"
        for _ in range(50):  # warm up: caches, the allocator, lazily made helpers
            s.run(cell)
        pids = [os.getpid(), *(row.pid for row in s.status().rows)]
        before = [_counts(pid) for pid in pids]
        for _ in range(500):
            s.run(cell)
        after = [_counts(pid) for pid in pids]
        assert ns["x"] == 550.0
    for pid, (fds0, threads0, rss0), (fds1, threads1, rss1) in zip(pids, before, after):
        assert (fds1, threads1) == (fds0, threads0), f"pid {pid}: descriptors or threads grew"
        assert rss1 - rss0 < 16, f"pid {pid}: resident memory grew by {rss1 - rss0:.1f} MiB over 500 cells"


def test_a_blocked_peer_is_released_while_the_master_holds_a_shadow_fork(capfd, monkeypatch):
    """The master's shadow fork (it tracks a large tensor) holds none of its gloo sockets, so
    the master's abort still releases the peer waiting in a collective with it."""
    monkeypatch.setenv("ENOT_NB_TRACK_WRITES", "0")  # the shadow fork, not the kernel's tracking
    ns = {"big": torch.zeros(2**19)}  # 2 MiB: the master makes a shadow fork before the cell
    with start("fork", namespace=ns) as s:
        s.run("import torch, torch.distributed as dist")
        pids = [row.pid for row in s.status().rows]
        with pytest.raises(WorkerFailedError) as failed:
            s.run(
                "big[0] = 1.0\nif dist.get_rank() == 0:\n    raise ValueError('x')\ndist.all_reduce(torch.ones(300000))"
            )
        assert failed.value.rank == 0 and "restarted" not in capfd.readouterr().err
        assert [row.pid for row in s.status().rows] == pids and float(ns["big"][0]) == 1.0


def test_a_restart_keeps_the_masters_state_at_the_failure(capfd, monkeypatch):
    """A rank that cannot be released makes the session restart; the master's state at the
    failure (a large tensor written) is in the notebook, and the notebook lives on."""
    from enot_nb._session.kernel import workers as session_workers

    monkeypatch.setattr(session_workers, "RELEASE_WAIT", 1.0)
    ns = {"big": torch.zeros(2**19)}
    with start("fork", namespace=ns) as s:
        s.run("import signal, threading, torch.distributed as dist\nn = big.numel()")
        cell = (
            "big.fill_(3.0)\nif dist.get_rank() == 0:\n    raise ValueError('x')\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])\nthreading.Event().wait()"
        )
        with pytest.raises(WorkerFailedError):
            s.run(cell)
        assert "session restarted" in capfd.readouterr().err
        assert float(ns["big"].sum()) == 3.0 * 2**19
        assert s.run("float(big.sum())") == 3.0 * 2**19  # the new workers got the notebook's


def test_a_half_done_collective_on_a_subgroup_makes_the_groups_again(capfd):
    with start("fork", namespace={}) as s:
        s.run("import torch, torch.distributed as dist\nsub = dist.new_group([0, 1])")
        with pytest.raises(WorkerFailedError):
            s.run(
                "t = torch.ones(1)\nif dist.get_rank() == 1:\n    raise ValueError('x')\n"
                "work = dist.all_reduce(t, group=sub, async_op=True)"
            )
        assert "process group was made again" in capfd.readouterr().err
        assert s.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)") == 2.0


def test_a_push_one_rank_cannot_apply_runs_the_cell_nowhere_and_keeps_the_record():
    ns = {"d": {"k": [1]}, "m": torch.nn.Linear(1, 1)}
    with start("fork", namespace=ns) as s:
        s.run("import torch.distributed as dist\nheld = [m]\nif dist.get_rank() == 1:\n    d['k'] = (1,)")
        ns["d"]["k"].append(2)  # a change rank 1 cannot apply: it holds a tuple there
        with pytest.raises(WorkerFailedError) as failed:
            s.run("ran = True")
        assert failed.value.rank == 1 and "d['k']" in str(failed.value) and "PathError" in str(failed.value)
        assert "ran" not in ns  # the master did not run the cell either
        ns["d"]["k"] = [1, 2]  # rebound: every rank takes it by value
        assert s.run("(d['k'], held[0] is m)") == ([1, 2], True)  # the ranks' own objects kept


def test_a_tensor_of_another_size_on_a_rank_refuses_the_push():
    ns = {"w": torch.zeros(2)}
    with start("fork", namespace=ns) as s:
        s.run("import torch, torch.distributed as dist\nif dist.get_rank() == 1:\n    w.resize_(5).zero_()")
        ns["w"].add_(1)
        with pytest.raises(WorkerFailedError) as failed:
            s.run("pass")
        assert failed.value.rank == 1 and "w: its storage holds (8,) bytes in the notebook, (20,)" in str(failed.value)


def test_a_stale_variable_can_be_pulled_after_a_change_here():
    ns = {"x": [1]}
    with start("fork", namespace=ns) as s:
        s.run("x.append(2)", no_return=True)
        ns["x"].append(3)
        with pytest.raises(LaunchError, match="'x'"):
            s.run("pass")
        assert s.pull("x") == {"x": [1, 2]} and ns["x"] == [1, 2]
        assert s.run("len(x)") == 2


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
        (session_workers, "load_payload"),  # every rank answered; the master's answer not read yet
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

    from enot_nb import sessions
    from enot_nb._launch import bring_back
    from enot_nb._session.kernel import flow as session_flow
    from enot_nb._session.mirror import mirror
    from enot_nb._state import snapshot
    from tests._util import press_before_line

    files = {m.__file__ for m in (sessions, session_flow, bring_back, mirror, snapshot)}
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


def test_a_one_off_spawn_launch_runs_beside_a_spawn_session():
    """A spawn session has its own fork server and holds no launch lock between cells."""
    with start("spawn", namespace={}) as s:
        s.run("x = 1")
        assert enot_nb.notebook_launcher(_rank_plus, args=(10,), nprocs=2, backend="gloo", start_method="spawn") == 10
        assert s.run("x + 1") == 2


def _rank_plus(k: int) -> int:
    return enot_nb.distributed.get_rank() + k


def test_the_device_checksum_sees_every_byte_and_its_place(monkeypatch):
    """GPU storages are checksummed where they are (digests.device_checksum); run here on the
    CPU, with chunks small enough that words, tails and chunk edges are all met."""
    from enot_nb._memory import digests

    monkeypatch.setattr(digests, "_CHECKSUM_CHUNK", 64)
    data = torch.arange(203, dtype=torch.uint8)
    before = digests.device_checksum(data.untyped_storage())
    for at in (0, 7, 63, 64, 200, 202):
        data[at] += 1
        assert digests.device_checksum(data.untyped_storage()) != before, at
        data[at] -= 1
    assert digests.device_checksum(data.untyped_storage()) == before
    swapped = data.clone()
    swapped[0:8], swapped[8:16] = data[8:16].clone(), data[0:8].clone()  # the same words, moved
    assert digests.device_checksum(swapped.untyped_storage()) != before


def _record_is_a_fresh_walk(mirror, namespace, where) -> None:
    """The mirror's record, however it was made (walked again or updated in place), is what a
    fresh walk of the synced names gives: the same objects and storages, each at a path that
    finds it, and a snapshot that sees no change now."""
    from enot_nb._session.mirror import paths
    from enot_nb._state.registry import Registry

    record, fresh = mirror.record.baseline, Registry.of_namespace(namespace, sorted(mirror.record.synced))
    assert {id(o) for o in record.objects} == {id(o) for o in fresh.objects}
    assert {id(s) for s in record.storages} == {id(s) for s in fresh.storages}
    found = paths.registry_at(namespace, paths.specs_of(record), len(record.objects), len(record.storages), strict=True)
    assert all(a is b for a, b in zip(found.objects, record.objects))
    snapshot = mirror.record.snapshot
    assert snapshot.changed_objects(record) == [], where
    assert snapshot.changed_storages(record) == [], where


def test_the_objects_a_cell_changed_found_again_are_what_a_fresh_find_gives():
    """A session master keeps its registry across a training cell by finding again only what the
    cell changed (paths.found_again): it must be exactly what finding every spec anew gives, or
    refuse (None) and leave the registry as it was; else the next cell's changes land on other
    objects, or a change is missed."""
    from enot_nb._session.mirror import paths
    from enot_nb._state.registry import Registry
    from enot_nb._state.snapshot import Snapshot

    def setup():
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
        model(torch.ones(2, 3)).sum().backward()
        base = torch.ones(4)
        ns = {"model": model, "log": [1.0, 2.0], "held": [torch.ones(1)], "x": torch.zeros(3, 3)}
        ns["views"] = [base[:2], base[2:]]  # two specs, one storage
        specs = paths.specs_of(Registry.of_namespace(ns, sorted(ns)))
        sizes = len(specs) + 1, len({j for spec in specs for j in spec.storages})
        registry = paths.registry_at(ns, specs, *sizes, strict=False)
        return ns, model, specs, sizes, registry, Snapshot.take(registry)

    def ids(registry):
        return [id(o) for o in registry.objects], [id(s) for s in registry.storages], list(registry.kinds)

    def changed_and_found(change):
        ns, model, specs, sizes, registry, snapshot = setup()
        before = ids(registry)
        change(ns, model)
        found = paths.found_again(registry, specs, snapshot.changed_objects(registry))
        if found is None:
            assert ids(registry) == before  # left as it was
            return None
        fresh = paths.registry_at(ns, specs, *sizes, strict=False)
        assert ids(registry) == ids(fresh)
        assert not paths.has_placeholders(registry)
        return found

    def step(ns, model):
        model.zero_grad()
        model(torch.ones(2, 3)).sum().backward()

    found = changed_and_found(step)  # four new .grad tensors, each where the old one was
    assert found is not None and len(found.objects) == 4 and len(found.storages) == 4
    found = changed_and_found(lambda ns, model: model[0].weight.data.mul_(2))  # bytes: nothing moves
    assert found is not None and found.objects == []

    found = changed_and_found(lambda ns, model: ns["log"].append(torch.ones(1)))  # atoms no more: another kind
    assert found is not None and found.objects == []

    def shared(ns, model):
        grad = torch.ones(3, 3)
        model[0].weight.grad, model[1].weight.grad = grad, grad  # one new tensor at two paths

    refused = {
        "a grad gone": lambda ns, model: model.zero_grad(set_to_none=True),
        "a list's tensor gone": lambda ns, model: ns["held"].__setitem__(0, 1.0),
        "another storage": lambda ns, model: setattr(model[0].weight, "data", torch.ones(3, 3)),
        "another storage size": lambda ns, model: setattr(model[0].bias, "grad", torch.ones(3).repeat(2)[:3]),
        "a new tensor at two paths": shared,
        "a new tensor where one of two views of a storage was": lambda ns, model: ns["views"].__setitem__(
            0, torch.zeros(4)[:2]
        ),
        "a registered tensor at another path": lambda ns, model: setattr(model[0].weight, "grad", ns["x"]),
    }
    for why, change in refused.items():
        assert changed_and_found(change) is None, why

    # The rank shares what the notebook does not (registry_at registered it once): finding only
    # what changed cannot give what a fresh find gives, so nothing is found again
    notebook = {"a": [torch.ones(4)], "b": [torch.ones(4)]}
    specs = paths.specs_of(Registry.of_namespace(notebook, sorted(notebook)))
    for why, second in {"a view of a[0]'s storage": lambda t: t.view(4), "a[0] itself": lambda t: t}.items():
        first = torch.ones(4)
        rank = {"a": [first], "b": [second(first)]}
        registry = paths.registry_at(rank, specs, len(specs) + 1, 2, strict=False)
        snapshot = Snapshot.take(registry)
        rank["a"][0] = torch.zeros(4)
        before = ids(registry)
        assert paths.found_again(registry, specs, snapshot.changed_objects(registry)) is None, why
        assert ids(registry) == before, why
    # A storage resized in place (its tensor unchanged) while a training step's grads move
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    rank = {"model": model, "x": torch.ones(4)}
    specs = paths.specs_of(Registry.of_namespace(rank, sorted(rank)))
    registry = paths.registry_at(rank, specs, len(specs) + 1, 5, strict=False)
    snapshot = Snapshot.take(registry)
    model.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    rank["x"].untyped_storage().resize_(64)
    before = ids(registry)
    assert paths.found_again(registry, specs, snapshot.changed_objects(registry)) is None
    assert ids(registry) == before


def test_a_kept_registry_is_found_by_its_specs_only_where_the_cell_changes_were_found_again():
    """The master's side of a kept registry (KeptSnapshot): after a training step (new .grad
    tensors) its registry is what finding the specs anew gives, and the next cell with the same
    specs gets it; after a cell whose change finding again refused (a tensor on another storage)
    the same specs must find the objects anew, whatever the notebook decided."""
    import pickle

    from enot_nb._memory.writes import WRITES
    from enot_nb._session.mirror import paths
    from enot_nb._session.mirror.kept import KeptSnapshot
    from enot_nb._state.registry import Registry

    if not WRITES.available():  # nothing is kept where writes are not tracked
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    model = torch.nn.Linear(3, 3)
    model(torch.ones(2, 3)).sum().backward()
    ns = {"model": model}
    specs = paths.specs_of(Registry.of_namespace(ns, ["model"]))
    sizes = len(specs) + 1, len({j for spec in specs for j in spec.storages})
    packed = pickle.dumps((specs, *sizes), protocol=5)
    kept = KeptSnapshot()
    registry = paths.registry_at(ns, specs, *sizes, strict=False)
    snapshot = Snapshot.take(registry)

    def cell(change) -> Registry | None:
        """``change`` run as a kept cell would be; the registry the next cell gets."""
        taken = kept.take(registry, scan_large=False)
        change()
        changed = taken.changed_objects(registry)
        kept.keep(registry, taken, changed, taken.changed_storages(registry))
        kept.found_by(packed, specs)
        kept.settle()
        return kept.registry_for(ns, packed)

    kept.keep(registry, snapshot, [], [])
    kept.found_by(packed, specs)
    assert kept.registry_for(ns, packed) is registry

    def step() -> None:
        model.zero_grad()
        model(torch.ones(2, 3)).sum().backward()

    assert cell(step) is registry
    fresh = paths.registry_at(ns, specs, *sizes, strict=False)
    assert [id(o) for o in registry.objects] == [id(o) for o in fresh.objects]
    assert [id(s) for s in registry.storages] == [id(s) for s in fresh.storages]
    assert cell(lambda: setattr(model.weight, "data", torch.ones(3, 3))) is None


def test_a_reach_kept_after_a_cell_that_reorders_or_aliases_is_what_a_fresh_walk_gives(monkeypatch):
    """A session cell that puts a dict's key back at its end, or makes a registered object
    reachable by a new step that a walk meets first, moves no object: the paths the record holds
    still lead to them, but a walk registers them at other indices or by other steps. The next
    cell must use a reach that is what a walk gives (here: walked anew), and its changes must
    land on the objects they were made on."""
    from enot_nb._session.kernel.flow import NamespaceFlow
    from enot_nb._session.mirror import paths
    from enot_nb._state import reach

    prepare, uses = NamespaceFlow.cell, []

    def checked_cell(self, code, run):
        kept = self.kept
        prepared = prepare(self, code, run)
        uses.append(kept is not None and prepared.task.mirror is kept.mirror)
        fresh = reach.reach(self.namespace, code, self._hidden())
        assert [id(o) for o in prepared.registry.objects] == [id(o) for o in fresh.registry.objects], code
        assert prepared.registry.parents == fresh.registry.parents, code
        assert prepared.task.mirror.specs == paths.specs_of(fresh.registry), code
        return prepared

    monkeypatch.setattr(NamespaceFlow, "cell", checked_cell)
    ns = {"__name__": "__main__", "torch": torch}
    with start("fork", namespace=ns) as s:
        s.run("d = {'k': torch.ones(2), 'j': [torch.ones(1)], 'z': {'deep': torch.ones(3)}}")
        s.run("torch\nd")
        s.run("torch\nd")
        assert uses[-1] is True  # nothing moved: kept
        s.run("torch\nd['k'] = d.pop('k')")  # the same objects, in another order
        s.run("torch\nd['k'].add_(1)\nd['j'][0].add_(2)")
        assert uses[-1] is False
        s.run("torch\nd['j'].append(d['z']['deep'])")  # a walk now meets it under 'j' first
        s.run("torch\nd['z']['deep'].add_(3)")
        assert uses[-1] is False
        s.run("torch\nd")
        assert uses[-1] is True
        here = {k: ns["d"][k].tolist() for k in ("k",)} | {"j0": ns["d"]["j"][0].tolist()}
        assert here == {"k": [2.0, 2.0], "j0": [3.0]}
        assert ns["d"]["j"][1] is ns["d"]["z"]["deep"] and ns["d"]["z"]["deep"].tolist() == [4.0] * 3
        assert list(ns["d"]) == ["j", "z", "k"]
        assert s.run("list(d), d['k'].tolist(), d['j'][0].tolist(), d['z']['deep'].tolist()") == (
            ["j", "z", "k"],
            [2.0, 2.0],
            [3.0],
            [4.0] * 3,
        )


def test_a_module_sharded_by_fsdp2_stays_sharded_on_the_ranks_and_plain_in_the_notebook():
    """FSDP2 (fully_shard, gloo on the CPU) in a session: the ranks keep the module sharded from
    cell to cell, also after a failed cell (the master made it plain again there, and its peers'
    next collective met a plain module: "mixed torch.Tensor and DTensor"); the notebook keeps
    its own plain module as it was, stale, named once, instead of FSDP's class and hooks over
    DTensors with no memory (which broke the notebook's record walk)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    weight, before = model[0].weight, model[0].weight.detach().clone()
    ns = {"model": model, "torch": torch}
    train = "for _ in range(2):\n    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n    opt.zero_grad()\n"
    with start("fork", namespace=ns) as s:
        s.run(
            "from torch.distributed.fsdp import fully_shard\nfully_shard(model[0])\nfully_shard(model)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n" + train
        )
        assert type(ns["model"]) is torch.nn.Sequential and ns["model"][0].weight is weight
        assert torch.equal(weight.detach(), before) and "model" in s.flow.mirror.stale
        assert ns["model"](torch.ones(1, 4)).shape == (1, 2)  # a plain module that works
        with pytest.raises(WorkerFailedError):
            s.run(train + "raise ValueError('after training')")
        assert s.run("type(model).__name__") == "FSDPSequential"
        check = (
            "import torch.distributed as dist\n" + train + "w = model[0].weight.full_tensor()\n"
            "ws = [torch.zeros_like(w) for _ in range(2)]\ndist.all_gather(ws, w)\nsame = bool(torch.equal(*ws))"
        )
        s.run(check)
        assert s.run("same") is True
        assert type(ns["model"]) is torch.nn.Sequential and torch.equal(weight.detach(), before)


def test_a_launched_function_that_returns_a_live_sharded_module_leaves_it_sharded():
    """Session.launch(fn) where fn returns the ranks' live FSDP2 module: it is not made whole in
    place, as a one-off launch's result is (that made the master's plain, its peers' sharded):
    the call fails naming DTensor, and the ranks keep training the sharded module together."""
    ns = {"model": torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), "torch": torch}
    with start("fork", namespace=ns) as s:
        s.run("from torch.distributed.fsdp import fully_shard\nfully_shard(model[0])\nfully_shard(model)\n")

        def live():
            return model  # noqa: F821 - the rank's session variable

        with pytest.raises(WorkerFailedError, match="DTensor"):
            s.launch(live)
        s.run(
            "import torch.distributed as dist\nmodel(torch.ones(3, 4)).sum().backward()\n"
            "w = model[0].weight.full_tensor()\nws = [torch.zeros_like(w) for _ in range(2)]\n"
            "dist.all_gather(ws, w)\nsame = bool(torch.equal(*ws))\nkind = type(model).__name__",
            no_return=True,
        )
        assert s.pull("same", "kind") == {"same": True, "kind": "FSDPSequential"}


def test_a_pull_of_what_the_master_holds_as_another_type_leaves_the_notebooks_storages_whole():
    """The master's object at a pulled path has no counterpart in the notebook (another type):
    the notebook's storages there had their empty placeholders sent as the master's bytes, and
    were emptied (an FSDP module's parameters then crashed the kernel when read)."""
    kept = torch.ones(4)
    ns = {"other": kept}
    with start("fork", namespace=ns, mirror="none") as s:
        s.run("other = [1]")
        assert s.pull("other") == {"other": [1]}
        whole = kept.untyped_storage().nbytes() == 16
        assert whole  # (checked apart: a failed assert shows the tensor, and reading an emptied one crashes)
        assert kept.tolist() == [1.0] * 4


@pytest.mark.parametrize("mirror", ["none", "all"])
def test_a_pull_brings_a_module_sharded_by_fsdp2_back_whole_into_the_notebooks_own(mirror):
    """pull of a module FSDP2 shards on the ranks: every rank gathers its full values, the
    notebook loads them into its own plain module in place (the same parameter objects), the
    ranks' module stays sharded (see the test below for what the pull had done to it)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    weight = model[0].weight
    ns = {"model": model, "torch": torch}
    with start("fork", namespace=ns, mirror=mirror) as s:
        if mirror == "none":
            s.push(model=model)
        s.run(
            "import torch\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model[0])\n"
            "fully_shard(model)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\nfor _ in range(2):\n"
            "    model(torch.ones(3, 4)).sum().backward()\n    opt.step()\n    opt.zero_grad()\n"
            "full = [p.full_tensor().tolist() for p in model.parameters()]",
            no_return=True,
        )
        got = s.pull("model", "full")
        assert got["model"] is model and model[0].weight is weight and type(model) is torch.nn.Sequential
        assert [p.tolist() for p in model.parameters()] == ns["full"]
        assert model(torch.ones(1, 4)).shape == (1, 2)
        s.run("kind = type(model).__name__", no_return=True)
        assert s.pull("kind") == {"kind": "FSDPSequential"}  # the ranks' module is still sharded


def test_the_record_updated_after_a_task_is_the_record_walked_again(monkeypatch):
    """After each task the mirror updates its record where the task moved something (new names,
    written storages, objects that hold more) or walks it again (a name rebound, an object that
    holds less): either way it must be what a fresh walk gives, or the next push misses a change
    or refers to an object at a path that holds another."""
    from enot_nb._session.mirror.record import Record

    ns = {
        "model": torch.nn.Linear(3, 2),
        "log": [],
        "cfg": {"lr": 0.1},
        "big": torch.zeros(2**18),
        "box": types.SimpleNamespace(d={}),
    }
    updates: list[bool] = []
    update = Record.update

    def checked(self, namespace, synced, moved):
        updated = update(self, namespace, synced, moved)
        updates.append(updated)
        return updated

    monkeypatch.setattr(Record, "update", checked)
    steps = [
        ("cell", "n = sum(p.numel() for p in model.parameters())"),  # a new name
        ("cell", "n = n * 1000 + 1"),  # an atom rebound: nothing to walk again
        ("cell", "m = [n]\nn = 7"),
        ("cell", "m = {'k': m}"),  # a name rebound that held a list: walked again
        ("cell", "log.append(n)\nbig[5] = 1.0"),  # a list that holds more, a storage written
        ("plain", lambda: ns["big"].add_(1)),  # pushed: a storage
        ("cell", "opt = torch.optim.SGD(model.parameters(), lr=cfg['lr'], momentum=0.9)"),
        ("cell", "model(torch.ones(4, 3)).sum().backward()\nopt.step()"),  # grads, optimizer state
        ("cell", "opt.step()\nlog.append(float(model.weight.sum()))"),  # contents only
        ("plain", lambda: ns["cfg"].update(lr=0.2)),  # pushed: a dict's item
        ("cell", "cfg['extra'] = [1, 2]"),
        ("cell", "log.pop(0)"),  # a list that holds less: walked again
        ("cell", "model.bias = torch.nn.Parameter(torch.ones(2))"),  # another parameter
        ("plain", lambda: ns.__setitem__("cfg", {"lr": 0.3})),  # a synced name rebound
        ("cell", "cfg['lr'] += 1"),
        ("cell", "del cfg['lr']\nopt.zero_grad(set_to_none=True)"),
        # New objects where the old ones were (a training step's new .grad tensors): updated, the
        # new ones at the old ones' places, unless something else may still hold an old one.
        ("cell", TRAIN, True),
        ("cell", TRAIN, True),
        ("cell", "saved = [model.weight.grad]"),
        ("cell", TRAIN),  # the old grad stays in the record: the list holds it
        ("cell", "del saved"),
        ("cell", TRAIN),
        ("cell", "box.deep = {'a': {'b': [model.weight.grad]}}"),  # held deeper than its path
        ("cell", TRAIN, False),  # the old grad is still held, by a list the step did not move
        ("cell", "del box.deep"),
        ("cell", TRAIN),
        ("cell", TRAIN, True),
        ("cell", f"{TRAIN}\nbox.kept = model.weight.grad", False),  # a new grad held twice
        ("cell", TRAIN),
        ("cell", f"{TRAIN}\nbox.old = model.weight.grad\nmodel.weight.grad = model.weight.grad.clone()"),
        ("cell", "model.weight.grad = torch.zeros(2, 3)\nbox.new = model.weight.grad"),
        ("cell", "flat = torch.zeros(8)\nmodel.weight.grad = flat[:6].view(2, 3)\nmodel.bias.grad = flat[6:]"),
        ("cell", "model.weight.grad, model.bias.grad = torch.ones(2, 3), torch.ones(2)"),
        ("cell", "box.d = {}", True),  # an object that holds nothing, replaced
        ("cell", "box.d = {'a': [1]}", True),  # (what the new one holds is walked in)
        ("cell", "box.d = {}", False),  # the old one held a list
        ("cell", "box.d = {}\nbox.e = box.d", False),  # the new one is held twice
        ("cell", "box.d = {}", False),  # the old one is held by box.e still
        ("plain", lambda: ns["box"].__setattr__("d", {1: 2})),  # pushed: replaced in the record too
        ("cell", "box.d[3] = 4"),
    ]
    with start("fork", namespace=ns) as s:
        s.run("import torch")
        for kind, step, *expected in steps:
            if kind == "plain":
                step()
            else:
                s.run(step)
                _record_is_a_fresh_walk(s.flow.mirror, ns, (step, updates[-1:]))
                assert updates[-1:] == expected or not expected, (step, updates[-1:])
        seen = s.run(
            "float(big.sum()), len(log), sorted(cfg), opt.state_dict()['state'][0]['momentum_buffer'].tolist()"
        )
        assert seen == (
            float(ns["big"].sum()),
            len(ns["log"]),
            sorted(ns["cfg"]),
            ns["opt"].state[ns["model"].weight]["momentum_buffer"].tolist(),
        )
        assert ns["cfg"] == {} and len(ns["log"]) == 1
        box = ns["box"]
        assert s.run("box.d, sorted(box.e), box.new is model.weight.grad") == ({1: 2, 3: 4}, [], False)
        assert box.d == {1: 2, 3: 4} and box.e == {} and box.new is not ns["model"].weight.grad
        grads = s.run("[p.grad.tolist() for p in model.parameters()]")
        assert grads == [p.grad.tolist() for p in ns["model"].parameters()] == [[[1.0] * 3] * 2, [1.0] * 2]
    assert True in updates and False in updates  # both ways were taken


TRAIN = "opt.zero_grad()\nmodel(torch.ones(4, 3)).sum().backward()\nopt.step()"


FOUND_AGAIN: list[int] = []
"""The cells whose master used its kept registry (see the test below; the master's copy)."""


def test_a_reach_kept_from_the_last_cell_is_what_a_fresh_walk_gives(monkeypatch):
    """A cell that changed nothing leaves its reach (and the master its registry) for the next
    cell with the same names: each must be what walking (finding) anew would give, whatever a
    plain cell changed in between, or a change is missed or lands on another object."""
    import pickle

    from enot_nb._memory.writes import WRITES
    from enot_nb._session.kernel.flow import NamespaceFlow
    from enot_nb._session.mirror import paths
    from enot_nb._session.mirror.kept import KeptSnapshot
    from enot_nb._state import reach

    if not WRITES.available():  # the master keeps a registry only where writes are tracked
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")

    uses: list[bool] = []
    prepare, find = NamespaceFlow.cell, KeptSnapshot.registry_for

    def checked_cell(self, code, run):
        kept = self.kept
        prepared = prepare(self, code, run)
        uses.append(kept is not None and prepared.task.mirror is kept.mirror)
        fresh = reach.reach(self.namespace, code, self._hidden())
        assert prepared.reached == fresh.names, code
        assert [id(o) for o in prepared.registry.objects] == [id(o) for o in fresh.registry.objects], code
        assert prepared.registry.parents == fresh.registry.parents, code
        assert [id(s) for s in prepared.registry.storages] == [id(s) for s in fresh.registry.storages], code
        assert prepared.task.mirror.specs == paths.specs_of(fresh.registry), code
        return prepared

    def checked_find(self, namespace, specs):  # in the master (forked from here)
        found = find(self, namespace, specs)
        if found is not None:
            FOUND_AGAIN.append(1)
            again = paths.registry_at(namespace, *pickle.loads(specs), strict=False)
            assert [id(o) for o in found.objects] == [id(o) for o in again.objects]
            assert [id(s) for s in found.storages] == [id(s) for s in again.storages]
        return found

    monkeypatch.setattr(NamespaceFlow, "cell", checked_cell)
    monkeypatch.setattr(KeptSnapshot, "registry_for", checked_find)
    cell = (
        "try:\n    extra = len(helper)\nexcept NameError:\n    extra = -1\n"
        "out = repr((f(net), extra, float(net.weight.detach().sum())))"  # an atom: a tuple is rebound
    )
    ns = {"__name__": "__main__", "net": torch.nn.Linear(3, 2), "scale": 2, "table": {"k": 1}, "torch": torch}
    exec("def f(m):\n    return float(m.bias.detach().sum()) * scale + table['k']", ns)
    found_again = f"len(__import__('sys').modules[{__name__!r}].FOUND_AGAIN)"

    def local() -> str:
        extra = len(ns["helper"]) if "helper" in ns else -1
        return repr((ns["f"](ns["net"]), extra, float(ns["net"].weight.detach().sum())))

    plain_cells = [
        (None, True),  # nothing changed: kept
        (lambda: ns.update(scale=3), True),  # an atom rebound: it reaches nothing either way
        (lambda: ns.update(scale=torch.ones(1)), False),  # now an object: walked anew
        (lambda: ns.update(scale=2), False),  # the tensor is no longer reached
        (lambda: ns["table"].update(k=torch.ones(2)), False),  # a dict the function reads
        (lambda: setattr(ns["net"], "extra", torch.nn.Linear(1, 1)), False),  # a module holds more
        (lambda: ns.update(helper=[1, 2]), False),  # a name the cell names, absent until now
        (lambda: ns["net"].weight.data.add_(1), False),  # a storage written
        (lambda: exec("def f(m):\n    return float(m.weight.detach().sum())", ns), False),  # f rebound
        (lambda: ns.pop("helper"), False),  # absent again
        (lambda: ns.update(net=torch.nn.Linear(3, 2)), False),  # the same shapes, another model
        (None, True),
    ]
    with start("fork", namespace=ns) as s:
        s.run(cell)
        s.run(cell)
        for plain, kept in plain_cells:
            if plain is not None:
                plain()
            s.run(cell)
            assert uses[-1] is kept, (len(uses), uses)
            assert ns["out"] == local(), len(uses)
        s.run("net.weight.data.mul_(0)\n" + cell)  # a cell that wrote bytes: they move no path
        assert uses[-1] is True and ns["out"] == local() and float(ns["net"].weight.detach().sum()) == 0.0
        s.run(cell)
        assert uses[-1] is True and ns["out"] == local()
        s.run("net.weight.data = torch.ones(2, 3)\n" + cell)  # on another storage: walked (found) anew
        s.run(cell)
        assert uses[-1] is False and ns["out"] == local()
        # Training steps: each leaves new .grad tensors where the old ones were (kept, found again)
        ns["opt"] = torch.optim.SGD(ns["net"].parameters(), lr=0.1)
        step = "opt.zero_grad()\nnet(torch.ones(4, 3)).sum().backward()\nopt.step()\n" + cell
        before = s.run(found_again)
        for n in range(4):  # (no other session cell in between: it would leave its own reach)
            s.run(step)
            assert uses[-1] is (n > 1), (n, uses)  # the first walks the new name; the second the new grads
            assert ns["out"] == local()
        assert s.run("out") == ns["out"]
        grads = s.run("[p.grad.tolist() for p in net.parameters()]")
        assert grads == [p.grad.tolist() for p in ns["net"].parameters()]
        assert s.run(found_again) >= before + 2  # the master found its registry again after steps
        s.run(step.replace("opt.step()", "opt.step()\nopt.zero_grad()"))  # the grads gone again
        s.run(step)
        assert uses[-1] is False and ns["net"].weight.grad is not None and ns["out"] == local()
        # The master's side: its kept registry must not serve specs that name other objects now
        s.run("net.bias = type(net.bias)(net.bias.detach() + 1)\n" + cell)  # moved: found anew
        s.run(cell)
        twin = torch.nn.Linear(3, 2)  # the same specs, another model: bound by a push of names
        for mine, its in zip(twin.parameters(), ns["net"].parameters()):
            mine.grad = None if its.grad is None else its.grad.clone()  # (grads are in the specs)
        ns["net"] = twin
        s.run(cell)
        s.run("net.weight.data.add_(1)\n" + cell)
        assert ns["net"] is twin and ns["out"] == local() == s.run("out")
        assert s.run(found_again) >= 2  # the master found its kept registry too


TAKES: list[int] = []
"""The snapshots a session's master took anew (see the test below; the master's copy)."""


def test_the_master_keeps_its_snapshot_from_cell_to_cell_and_still_sees_every_write(monkeypatch, pages):
    """A cell over the same objects as the last one starts from the master's kept snapshot
    (taken again only where the last cell changed something), where the kernel tracks writes;
    writes in place, through ``.data`` and through a NumPy view all come back; a push, a launch
    or a failed cell make the next one take it anew."""
    from enot_nb._state.snapshot import Snapshot

    original = Snapshot.take.__func__

    def counted(cls, registry, scan_large=False):
        TAKES.append(len(registry.objects))  # in the master: it is forked from here
        return original(cls, registry, scan_large)

    monkeypatch.setattr(Snapshot, "take", classmethod(counted))
    same = "torch, model, big, cfg, flag, losses\n"  # every cell reaches the same objects
    taken = same + f"len(__import__('sys').modules[{__name__!r}].TAKES)"
    ns = {"model": torch.nn.Linear(4, 4), "big": torch.zeros(2**19), "torch": torch, "cfg": {}, "flag": []}
    ns["losses"] = [0.5] * 1000  # an atoms container (one object), until it is cleared
    probe = same + "model.weight.tolist(), float(big[12345]), float(big[2**18])"
    with start("fork", namespace=ns) as s:
        s.run(same + "n = float(model.weight.sum()) + float(big.sum())")
        before = s.run(taken)
        for cell in [
            "with torch.no_grad():\n    model.weight[0, 0] = 5.0",
            "model.weight.data[1, 1] = 6.0",  # no version counter moves
            "big[12345] = 7.0",
            "big.numpy()[2**18] = 8.0",
        ]:
            s.run(same + cell)
            assert s.run(probe) == (ns["model"].weight.tolist(), float(ns["big"][12345]), float(ns["big"][2**18]))
        assert ns["model"].weight[1, 1] == 6.0 and float(ns["big"][2**18]) == 8.0
        fresh = s.run(taken) - before  # snapshots taken anew over the 9 cells since
        assert fresh <= 1 if pages == "tracked" else fresh >= 9, fresh
        before = s.run(taken)
        ns["n"] = 3  # a push that only binds a name changes no object: the snapshot is kept
        assert s.run(same + "n") == 3
        assert s.run(taken) - before == (0 if pages == "tracked" else 2)
        # What changes the master between two cells makes the next take its snapshot anew: else
        # a cell that writes back the kept value would look unchanged, and the notebook keep
        # the value from in between.
        # (Storages are safe either way: the kernel tells each write; an object's state is not.)
        s.run(same + "cfg['a'] = cfg['b'] = cfg['c'] = 3")
        ns["cfg"]["a"] = 0  # a plain change, pushed
        ns["n"] = 2  # a name rebound: alone, it would not make the master take its snapshot anew
        s.run(same + "cfg['a'] = 3")
        assert ns["cfg"]["a"] == 3
        s.launch(lambda: cfg.__setitem__("b", 0))  # noqa: F821 - the rank's variable
        s.run(same + "cfg['b'] = 3")
        assert ns["cfg"]["b"] == 3
        with pytest.raises(WorkerFailedError):
            s.run(same + "cfg['c'] = 0\nraise ValueError('x')")
        s.run(same + "cfg['c'] = 3")
        assert ns["cfg"] == {"a": 3, "b": 3, "c": 3} == s.run(same + "cfg")
        s.run(same + "flag.append(1)")  # kept: taken again where this cell changed it,
        s.run(same + "flag.clear()")  # or this one would match the state from before the last
        assert ns["flag"] == []
        s.run(same + "losses.clear()")  # its kind changes: the kept state is of the other kind
        s.run(same + "losses.append(1.0)")
        assert ns["losses"] == [1.0]
