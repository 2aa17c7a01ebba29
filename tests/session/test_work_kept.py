"""A session keeps the work through faults: the DDP wrapper and the optimizer built in one cell
train on after an exception on one rank, a stop press or a dead idle rank; the replicas stay equal
to each other and to the notebook."""

from __future__ import annotations

import gc
import os
import signal
import threading

import pytest
import torch

from enot_nb.errors import WorkerFailedError
from tests._util import wait_gone
from tests.session.common import start

pytestmark = pytest.mark.timeout(180)

BN_MODEL = (
    "import torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Sequential(\n"
    "    torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)\n"
    ")\n"
    "ddp = DDP(model)\n"
    "opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)\n"
    "steps = 0\n"
)

# One epoch of steps; ``fail_at`` makes rank 1 raise after its backward, before its optimizer
# step, so that rank 0 steps once more than rank 1 before it waits for it in the next backward.
EPOCH = (
    "def train_epoch(ddp, opt, n, fail_at=None, running=None):\n"
    "    global steps\n"
    "    g = torch.Generator().manual_seed(1000 + dist.get_rank())\n"
    "    for step in range(n):\n"
    "        x = torch.randn(16, 4, generator=g)\n"
    "        loss = ddp(x).pow(2).mean()\n"
    "        opt.zero_grad()\n"
    "        loss.backward()\n"
    "        if fail_at is not None and step == fail_at and dist.get_rank() == 1:\n"
    "            raise RuntimeError('rank 1 fails mid-epoch')\n"
    "        opt.step()\n"
    "        steps += 1\n"
    "        if running is not None and step == running:\n"
    "            print('running', flush=True)\n"
)

# The parameters and the optimizer's state: DDP keeps them equal on every rank. (BatchNorm's
# running statistics are each rank's own after its last forward: DDP sends rank 0's at the start
# of the next one.)
REPLICAS_EQUAL = (
    "flat = torch.cat([p.detach().flatten() for p in model.parameters()]\n"
    "                 + [s['momentum_buffer'].flatten() for s in opt.state.values() if 'momentum_buffer' in s])\n"
    "both = [torch.empty_like(flat) for _ in range(dist.get_world_size())]\n"
    "dist.all_gather(both, flat)\n"
    "bool(torch.equal(both[0], both[1]))"
)


def _notebook_matches_master(s, ns) -> bool:
    """The notebook's parameters, BatchNorm statistics and optimizer state are the master's (the
    statistics reached only through the rank-only ``ddp``)."""
    probe = (
        "[t.detach().clone() for t in [*model.parameters(), *model.buffers(), *opt.state_dict()['state'][0].values()]]"
    )
    master = s.run(probe)
    model, opt = ns["model"], ns["opt"]
    mine = [t.detach() for t in [*model.parameters(), *model.buffers(), *opt.state_dict()["state"][0].values()]]
    return len(master) == len(mine) and all(torch.equal(a, b) for a, b in zip(master, mine))


def test_an_exception_on_one_rank_mid_epoch_leaves_ddp_and_opt_training(start_method, capsys):
    ns: dict = {}
    with start(start_method, namespace=ns) as s:
        s.run(BN_MODEL + EPOCH)
        s.run("train_epoch(ddp, opt, 3)")
        with pytest.raises(WorkerFailedError) as failed:
            s.run("train_epoch(ddp, opt, 10, fail_at=4)")
        assert failed.value.rank == 1 and "rank 1 fails mid-epoch" in str(failed.value)
        out = capsys.readouterr().out
        assert "rebound to the ranks' group" in out and "ddp" in out
        assert "made equal to it" in out  # rank 0 had stepped once more than rank 1
        assert s.run(REPLICAS_EQUAL) is True
        s.run("train_epoch(ddp, opt, 3)")  # the same wrapper and optimizer train on
        assert s.run(REPLICAS_EQUAL) is True
        assert s.run("steps") == ns["steps"] == 3 + 5 + 3
        assert _notebook_matches_master(s, ns)


def _press_when_said(fifo) -> None:
    """The stop button, pressed once the master writes to ``fifo`` (from where the ranks are).
    Run as a daemon thread: where the cell fails before it writes, the thread waits on, and
    must not keep the test process from exiting."""
    with open(fifo) as said:
        if not said.read(1):
            return
    os.kill(os.getpid(), signal.SIGINT)


def _press_during(s, fifo, cell: str) -> None:
    """``cell`` run on the session ``s``, the stop button pressed once its master writes to
    ``fifo``: the cell ends in KeyboardInterrupt."""
    press = threading.Thread(target=_press_when_said, args=(fifo,), daemon=True)
    press.start()
    with pytest.raises(KeyboardInterrupt):
        s.run(cell)
    press.join()


def test_a_stop_press_during_training_leaves_ddp_and_opt_training(tmp_path, start_method, capfd):
    """The stop button pressed while the ranks train (the master says so through a FIFO): the
    next cell trains on with the same ``ddp`` and ``opt``, the replicas equal."""
    ns: dict = {}
    fifo = tmp_path / "training"
    os.mkfifo(fifo)

    with start(start_method, namespace=ns) as s:
        s.run(BN_MODEL + EPOCH)
        _press_during(
            s,
            fifo,
            "for epoch in range(100000):\n    train_epoch(ddp, opt, 5)\n"
            f"    if epoch == 2 and dist.get_rank() == 0:\n        open({str(fifo)!r}, 'w').write('x')\n",
        )
        report = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[rank ")]
        assert 0 < len(report) < 40, report  # each rank's own frames, a few of torch's
        for r in (0, 1):  # each rank's cell frame is there
            assert any(line.startswith(f"[rank {r}]") and "<enot_distributed cell>" in line for line in report), report
        assert all(
            sum("/site-packages/" in line for line in report if line.startswith(f"[rank {r}]")) <= 3 for r in (0, 1)
        )
        assert s.run(REPLICAS_EQUAL) is True
        s.run("train_epoch(ddp, opt, 3)")  # the same wrapper and optimizer train on
        assert s.run(REPLICAS_EQUAL) is True
        assert _notebook_matches_master(s, ns)


def test_a_press_inside_a_no_grad_entry_leaves_autograd_as_it_was(tmp_path, capfd):
    """A press that lands inside a context manager's entry after it turned autograd off (as it
    can inside ``torch.no_grad()``'s own ``__enter__``) leaves no ``with`` block to turn it on
    again: every later backward would fail. After the press, autograd is as before the cell,
    one line says so, and the same ``ddp`` and ``opt`` train on."""
    ns: dict = {}
    fifo = tmp_path / "entered"
    os.mkfifo(fifo)

    with start("fork", namespace=ns) as s:
        s.run(BN_MODEL + EPOCH)
        _press_during(
            s,
            fifo,
            "import signal\n"
            "class Entering:\n"
            "    def __enter__(self):\n"
            "        torch.set_grad_enabled(False)\n"
            "        if dist.get_rank() == 0:\n"
            f"            open({str(fifo)!r}, 'w').write('x')\n"
            "        while True:\n"
            "            signal.pause()  # the press lands here: the with block has not begun\n"
            "    def __exit__(self, *exc):\n"
            "        torch.set_grad_enabled(True)\n"
            "with Entering():\n"
            "    pass\n",
        )
        assert "autograd" in capfd.readouterr().err
        assert s.run("torch.is_grad_enabled()") is True
        s.run("train_epoch(ddp, opt, 3)")
        assert s.run(REPLICAS_EQUAL) is True


def _on_every_rank(s, condition: str) -> bool:
    """Whether ``condition`` (an expression) holds on every rank, as the master learns it."""
    return s.run(
        f"_holds = torch.tensor([int(bool({condition}))])\ndist.all_reduce(_holds, op=dist.ReduceOp.MIN)\nbool(_holds)"
    )


BUFFERS_EQUAL = (
    "flat = torch.cat([b.detach().double().flatten() for b in model.buffers()])\n"
    "both = [torch.empty_like(flat) for _ in range(dist.get_world_size())]\n"
    "dist.all_gather(both, flat)\n"
    "bool(torch.equal(both[0], both[1]))"
)


def test_a_ddp_wrapper_in_a_dict_is_compared_and_made_equal_after_a_failed_cell(start_method, capsys):
    """``nets = {'G': DDP(model)}``: rank 0 steps once more than rank 1 before the failure; the
    wrapper is rebound, named by its path, and its parameters, buffers and optimizer state
    are made the master's, as a wrapper held in a variable's are."""
    ns: dict = {}
    setup = BN_MODEL.replace("ddp = DDP(model)\n", "nets = {'G': DDP(model)}\n").replace(
        "ddp.parameters()", "model.parameters()"
    )
    with start(start_method, namespace=ns) as s:
        s.run(setup + EPOCH)
        s.run("train_epoch(nets['G'], opt, 3)")
        pids = [row.pid for row in s.status().rows]
        with pytest.raises(WorkerFailedError):
            s.run("train_epoch(nets['G'], opt, 10, fail_at=4)")
        out = capsys.readouterr().out
        assert "DDP wrapper(s) nets['G'] rebound to the ranks' group" in out
        assert "made equal to it (nets['G'].module.0.weight" in out, out
        assert "restarted" not in out and [row.pid for row in s.status().rows] == pids
        assert s.run(REPLICAS_EQUAL) is True
        assert s.run(BUFFERS_EQUAL) is True  # before any forward could broadcast rank 0's
        s.run("train_epoch(nets['G'], opt, 3)")
        assert s.run(REPLICAS_EQUAL) is True
        assert s.run("steps") == ns["steps"] == 3 + 5 + 3
        assert _notebook_matches_master(s, ns)


ZERO = (
    "import torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
    "def build():\n"
    "    torch.manual_seed(0)\n"
    "    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))\n"
    "    return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)\n"
    "def train(ddp, opt, n, seed, fail_before_backward=False):\n"
    "    g = torch.Generator().manual_seed(seed + dist.get_rank())\n"
    "    for _ in range(n):\n"
    "        loss = ddp(torch.randn(16, 4, generator=g)).pow(2).mean()\n"
    "        opt.zero_grad()\n"
    "        if fail_before_backward and dist.get_rank() == 1:\n"
    "            raise RuntimeError('rank 1 fails before its backward')\n"
    "        loss.backward()\n"
    "        opt.step()\n"
    "def shard(opt):\n"
    "    return [t.clone() for s in opt.optim.state.values() for t in s.values()]\n"
    "ddp, zero = build()\n"
    "ref, ref_zero = build()  # the same training, never failed\n"
)
SAME_AS_THE_REFERENCE = (
    "all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ref.parameters()))"
    " and len(shard(zero)) == len(shard(ref_zero)) > 0"
    " and all(torch.equal(a, b) for a, b in zip(shard(zero), shard(ref_zero)))"
)


def test_zeros_shards_are_left_as_each_rank_holds_them(start_method, capsys):
    """ZeroRedundancyOptimizer's inner optimizer holds each rank's own shard of the state (here
    of different sizes): after a failed cell the group is kept and training goes on exactly as
    the same training that never failed; after one that leaves a collective half done (the
    groups made again) each rank's shard is still its own, the line names it as possibly out
    of step, and the optimizer, moved onto the new group, steps on. The session never restarts."""
    with start(start_method, namespace={}) as s:
        s.run(ZERO)
        s.run("train(ddp, zero, 3, 0)\ntrain(ref, ref_zero, 3, 0)")
        pids = [row.pid for row in s.status().rows]
        with pytest.raises(WorkerFailedError):
            s.run("train(ddp, zero, 2, 100)\nif dist.get_rank() == 1:\n    raise RuntimeError('after two steps')")
        out = capsys.readouterr().out
        assert "restarted" not in out and "made again" not in out and "left as each rank" not in out, out
        s.run("train(ref, ref_zero, 2, 100)\ntrain(ddp, zero, 3, 200)\ntrain(ref, ref_zero, 3, 200)")
        assert _on_every_rank(s, SAME_AS_THE_REFERENCE) is True
        s.run("before = shard(zero)")
        with pytest.raises(WorkerFailedError):
            s.run("train(ddp, zero, 1, 300, fail_before_backward=True)")  # rank 0 waits in backward
        out = capsys.readouterr().out
        assert "process group was made again" in out and "restarted" not in out, out
        assert "sharded state " in out and "zero (ZeroRedundancyOptimizer" in out, out
        assert [row.pid for row in s.status().rows] == pids
        assert _on_every_rank(s, "all(torch.equal(a, b) for a, b in zip(before, shard(zero)))") is True
        assert "ZeroRedundancyOptimizer(s) ref_zero, zero moved onto the ranks' group" in out, out
        s.run("train(ddp, zero, 2, 400)")  # on the group made again, not the old one's
        assert _on_every_rank(s, "len(before) == len(shard(zero)) and not any(map(torch.equal, before, shard(zero)))")


def test_an_optimizer_over_other_ddp_parameters_on_each_rank_is_named_not_overwritten(start_method, capsys):
    """A hand-made sharded optimizer (each rank's Adam over its own half of the DDP parameters:
    as many state tensors on each rank, of different sizes) is not replicated by construction:
    the ranks' keys differ, so it is named and each rank's state kept; the DDP parameters are
    still compared."""
    setup = (
        "import torch, torch.distributed as dist\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\n"
        "ddp = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)))\n"
        "params = list(ddp.parameters())\n"
        "opt = torch.optim.Adam(params[dist.get_rank()::2], lr=0.01)\n"
        "def step(n):\n"
        "    for _ in range(n):\n"
        "        ddp(torch.randn(16, 4)).pow(2).mean().backward()\n"
        "        opt.step()\n"
        "        opt.zero_grad()\n"
        "        for i, p in enumerate(params):\n"
        "            dist.broadcast(p.data, src=i % 2)  # each rank's half, to the other\n"
    )
    with start(start_method, namespace={}) as s:
        s.run(setup)
        pids = [row.pid for row in s.status().rows]
        with pytest.raises(WorkerFailedError):
            s.run(
                "step(2)\nmine = [t.clone() for st in opt.state.values() for t in st.values()]\n"
                "if dist.get_rank() == 1:\n    raise RuntimeError('after two steps')"
            )
        out = capsys.readouterr().out
        assert "restarted" not in out and [row.pid for row in s.status().rows] == pids, out
        assert "replicated state held differently on the ranks" in out and "opt.state[" in out, out
        kept = "all(torch.equal(a, b) for a, b in zip(mine, [t for st in opt.state.values() for t in st.values()]))"
        assert _on_every_rank(s, kept) is True
        s.run("step(2)")


def test_a_zero_optimizer_the_notebook_holds_is_not_taken_for_a_ranks(capsys):
    """The notebook's copy of a ZeroRedundancyOptimizer (pickled without its process group)
    lives on in a rank forked later, in a new session, where the collector finds it (the user's
    own gc.freeze() keeps the kernel from freezing its objects for the fork): the repair after a
    failed cell moves only what the rank made, and the session does not restart (it did:
    "'ZeroRedundancyOptimizer' object has no attribute 'process_group'")."""
    gc.freeze()  # before the copy is made: it stays one the collector tracks
    try:
        notebook: dict = {}
        with start("fork", namespace=notebook) as s:
            s.run(ZERO)
        assert "process_group" not in vars(notebook["zero"])  # the copy the next ranks inherit
        with start("fork", namespace={}) as s:
            s.run(ZERO)
            pids = [row.pid for row in s.status().rows]
            with pytest.raises(WorkerFailedError):
                s.run("train(ddp, zero, 1, 0)\nif dist.get_rank() == 1:\n    raise RuntimeError('after a step')")
            out = capsys.readouterr().out
            assert "restarted" not in out and "reducer reset" in out, out
            assert [row.pid for row in s.status().rows] == pids
            s.run("train(ddp, zero, 1, 1)")
    finally:
        gc.unfreeze()


def test_an_error_mid_backward_on_every_rank_keeps_the_group_and_resets_the_reducer(capsys):
    """Every rank raises in the same backward hook, before any bucket is reduced: the ranks
    agree on their collectives, so the group is kept, but each DDP reducer was left expecting
    the rest of that backward; the repair resets it on the kept group, and the same ``ddp``
    trains on (without the reset: "Expected to have finished reduction in the prior iteration")."""
    ns: dict = {}
    with start("fork", namespace=ns) as s:
        s.run(BN_MODEL + EPOCH)
        s.run("train_epoch(ddp, opt, 2)")
        with pytest.raises(WorkerFailedError) as failed:
            s.run(
                "hook = model[0].weight.register_hook(lambda grad: 1 / 0)\n"
                "try:\n    train_epoch(ddp, opt, 1)\nfinally:\n    hook.remove()"
            )
        assert "ZeroDivisionError" in str(failed.value)
        out = capsys.readouterr().out
        assert "reducer reset" in out and "made again" not in out and "restarted" not in out, out
        s.run("train_epoch(ddp, opt, 3)")
        assert s.run(REPLICAS_EQUAL) is True
        assert _notebook_matches_master(s, ns)


def test_a_rank_that_dies_while_idle_shows_as_dead_in_the_table():
    with start("fork", namespace={}) as s:
        s.run("x = 1")
        rows = s.status().rows
        os.kill(rows[1].pid, signal.SIGKILL)
        wait_gone([rows[1].pid])
        assert [r.state for r in s.status().rows] == ["idle", "dead"]  # seen without a task


def test_a_rank_that_died_while_idle_makes_the_next_cell_restart_the_session_first(capfd, tmp_path):
    """The cell is not sent to the ranks left (the master would run it, and its result be thrown
    away with the restart): the session restarts first, says so, and the cell runs once."""
    marks = tmp_path / "ran"
    with start("fork", namespace={"v": 3}) as s:
        s.run("x = 1")
        pid = s.status().rows[1].pid
        os.kill(pid, signal.SIGKILL)
        wait_gone([pid])
        cell = (
            f"import torch.distributed as dist\nif dist.get_rank() == 0:\n    open({str(marks)!r}, 'a').write('x')\n"
            "v * 2"
        )
        assert s.run(cell) == 6
        assert "session restarted (rank(s) 1 had died)" in capfd.readouterr().out
        assert marks.read_text() == "x"  # the cell ran once, on the new workers only


PIN = """
import tempfile, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
ddp = DDP(torch.nn.Linear(2, 2))
ddp(torch.ones(1, 2)).sum().backward()
ddp._has_rebuilt_buckets = True
new = dist.new_group([0])
ddp._update_process_group(new)
assert ddp.process_group is new, "the wrapper is not on the new group"
assert ddp._has_rebuilt_buckets is False, "the buckets are not rebuilt on the new group"
ddp(torch.ones(1, 2)).sum().backward()
print("trains on", dist.get_world_size(new))
"""


def test_ddps_private_update_process_group_still_moves_a_wrapper_and_resets_it():
    """The repair leans on DistributedDataParallel._update_process_group (private): a torch whose
    wrapper no longer moves onto the group it is given, or no longer rebuilds its buckets there,
    fails here, loudly, before a session's repair silently keeps a broken wrapper."""
    import subprocess
    import sys

    # (the timeout guards a hang: a CUDA build of torch imports slowly on a loaded machine)
    done = subprocess.run([sys.executable, "-c", PIN], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trains on 1"


def test_a_peer_killed_mid_cell_keeps_the_masters_progress(start_method, capsys, tmp_path):
    """Rank 1 is killed while the master sleeps in the cell: the master is stopped to send its
    state, the notebook takes it, and the new workers start from it (the cell's writes kept)."""
    fifo = tmp_path / "sleeping"
    os.mkfifo(fifo)
    ns = {"counter": 0, "w": torch.zeros(4)}
    with start(start_method, namespace=ns) as s:
        s.run("import os, time, torch.distributed as dist\nx = 1")
        victim = s.status().rows[1].pid

        def kill_once_sleeping() -> None:
            with open(fifo) as said:
                said.read(1)
            os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_sleeping)
        killer.start()
        cell = (
            "counter = 5\nw.fill_(3.0)\n"
            f"if dist.get_rank() == 0:\n    open({str(fifo)!r}, 'w').write('x')\ntime.sleep(60)"
        )
        with pytest.raises(WorkerFailedError) as failed:
            s.run(cell)
        killer.join()
        assert failed.value.rank == 1 and failed.value.signal_name == "SIGKILL"
        assert "rank 0 was stopped to send its state after rank 1 died" in str(failed.value)
        out = capsys.readouterr().out
        assert "session restarted (rank 1 died (SIGKILL); the notebook holds the master's state" in out
        assert ns["counter"] == 5 and ns["w"].tolist() == [3.0] * 4  # the master's progress, kept
        assert s.run("counter, w.tolist()") == (5, [3.0] * 4)  # and the new workers hold it


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_twenty_stop_presses_at_random_moments_of_training_leave_the_same_ddp_training(tmp_path):
    """Twenty presses, each after a random number of steps (the master says when through a
    FIFO, the press lands wherever the ranks then are): after each, the replicas equal each other
    and the notebook the master; then the same ``ddp`` and ``opt`` train on."""
    import random

    rng = random.Random(20261205)
    ns: dict = {}

    with start("fork", namespace=ns) as s:
        s.run(BN_MODEL + EPOCH)
        for press in range(20):
            fifo = tmp_path / f"training-{press}"
            os.mkfifo(fifo)
            after = rng.randint(0, 12)
            _press_during(
                s,
                fifo,
                "for n in range(100000):\n    train_epoch(ddp, opt, 1)\n"
                f"    if n == {after} and dist.get_rank() == 0:\n        open({str(fifo)!r}, 'w').write('x')\n",
            )
            assert s.run(REPLICAS_EQUAL) is True, f"press {press}"
            assert _notebook_matches_master(s, ns), f"press {press}"
        s.run("train_epoch(ddp, opt, 3)")
        assert s.run(REPLICAS_EQUAL) is True


def _pids(s) -> list[int]:
    return [row.pid for row in s.status().rows]


def test_a_stop_press_and_an_exception_keep_ddp_in_the_same_ranks_idle_or_loaded(tmp_path, cpu_load, capfd):
    """The two faults a session recovers from in place, on an idle machine and beside busy
    processes: a press during DDP training, then one rank's exception mid-epoch. Nothing
    restarts (the same processes), the same ``ddp`` and ``opt`` train on, the replicas equal."""
    ns: dict = {}
    fifo = tmp_path / "training"
    os.mkfifo(fifo)
    with start("fork", namespace=ns) as s:
        s.run(BN_MODEL + EPOCH)
        pids = _pids(s)
        _press_during(
            s,
            fifo,
            "for epoch in range(100000):\n    train_epoch(ddp, opt, 3)\n"
            f"    if epoch == 1 and dist.get_rank() == 0:\n        open({str(fifo)!r}, 'w').write('x')\n",
        )
        with pytest.raises(WorkerFailedError) as failed:
            s.run("train_epoch(ddp, opt, 10, fail_at=4)")
        assert failed.value.rank == 1 and "rank 1 fails mid-epoch" in str(failed.value)
        assert "session restarted" not in capfd.readouterr().out
        assert _pids(s) == pids  # the same ranks: nothing restarted
        assert s.run(REPLICAS_EQUAL) is True
        s.run("train_epoch(ddp, opt, 3)")  # the same wrapper and optimizer train on
        assert s.run(REPLICAS_EQUAL) is True
        assert _notebook_matches_master(s, ns)


def test_a_peer_killed_mid_training_is_named_before_the_restart_idle_or_loaded(tmp_path, cpu_load, capfd, monkeypatch):
    """Rank 1 SIGKILLed while the ranks train: its death is shown (rank, how it ended) before the
    session restarts; the master's progress (the model, the optimizer, its step count) is kept
    and the new ranks train on from it, the replicas equal."""
    from enot_nb._session.kernel.session import Session

    shown_before: list[str] = []
    restart = Session.restart

    def restart_seen(self, why=None):
        shown_before.append(capfd.readouterr().err)
        return restart(self, why)

    monkeypatch.setattr(Session, "restart", restart_seen)
    fifo = tmp_path / "training"
    os.mkfifo(fifo)
    ns: dict = {}
    with start("fork", namespace=ns) as s:
        s.run(BN_MODEL + EPOCH)
        victim = _pids(s)[1]

        def kill_once_training() -> None:
            with open(fifo) as said:
                if said.read(1):
                    os.kill(victim, signal.SIGKILL)

        killer = threading.Thread(target=kill_once_training, daemon=True)
        killer.start()
        with pytest.raises(WorkerFailedError) as failed:
            s.run(
                "for epoch in range(100000):\n    train_epoch(ddp, opt, 3)\n"
                f"    if epoch == 1 and dist.get_rank() == 0:\n        open({str(fifo)!r}, 'w').write('x')\n"
            )
        killer.join()
        assert failed.value.rank == 1 and failed.value.signal_name == "SIGKILL"
        assert len(shown_before) == 1 and "enot_nb: rank 1 died (SIGKILL)" in shown_before[0], shown_before
        assert ns["steps"] >= 6 and s.run("steps") == ns["steps"]  # the master's progress, kept
        s.run("ddp = DDP(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)")
        s.run("train_epoch(ddp, opt, 3)")
        assert s.run(REPLICAS_EQUAL) is True


def test_released_ranks_that_work_their_way_back_slowly_are_waited_for(tmp_path, monkeypatch, capfd):
    """A press lands; the ranks spend CPU seconds on their way back (a ``finally`` that works,
    as a loaded machine's slow unwinding does), more than the release wait: they are waited for
    as long as their CPU time grows, not taken for stuck and restarted."""
    from enot_nb._session.kernel import workers

    monkeypatch.setattr(workers, "RELEASE_WAIT", 0.5)
    fifo = tmp_path / "working"
    os.mkfifo(fifo)
    with start("fork") as s:
        s.run("import time, torch.distributed as dist\nx = 1")
        pids = _pids(s)
        _press_during(
            s,
            fifo,
            "try:\n"
            f"    if dist.get_rank() == 0:\n        open({str(fifo)!r}, 'w').write('x')\n"
            "    time.sleep(600)\n"
            "finally:\n"
            "    began = time.process_time()\n"
            "    while time.process_time() - began < 4.0:\n"
            "        pass\n",
        )
        assert "session restarted" not in capfd.readouterr().out
        assert _pids(s) == pids
        assert s.run("x + 1") == 2
