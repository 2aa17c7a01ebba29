"""A session through faults: a rank's exception, a rank blocked in a collective, a rank killed,
the stop button, dead workers; the same workers, or a restart, with the notebook's values."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from enot_nb._session.kernel import workers as session_workers
from enot_nb.errors import WorkerFailedError
from tests.session.common import DDP_SETUP, start

pytestmark = pytest.mark.timeout(120)


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
        text = str(failed.value)
        assert "rank 0 was waiting in a collective with rank 1 and was released" in text
        assert "Other failures" not in text and "Connection closed" not in text  # not a failure of its own
        out = capfd.readouterr().out
        assert "process group was made again" in out and "restarted" not in out  # released, not replaced
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
        out = capfd.readouterr().out
        assert "session restarted (rank 1 died (SIGKILL); the notebook holds the master's state at the failure)" in out
        assert "restored from the notebook (on the CPU): " in out and "x" in out.split("restored")[1]
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


def test_a_session_with_every_worker_dead_restarts_before_the_cell(capfd):
    with start("fork", namespace={"v": 3}) as s:
        for row in s.status().rows:
            os.kill(row.pid, signal.SIGKILL)
        while any(r.running for r in s.workers.host.ranks):  # their deaths seen (events: pidfds)
            s.workers.host.poll(None)
        assert s.run("v * 2") == 6
        assert "session restarted (all its workers were dead)" in capfd.readouterr().out


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
        assert "session restarted" in capfd.readouterr().out
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
        out = capfd.readouterr().out
        assert "process group was made again" in out and "subgroup(s) sub made again" in out
        assert s.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)") == 2.0
        # the user's subgroup, made again from its ranks and bound where the old one was
        assert s.run("t = torch.ones(1)\ndist.all_reduce(t, group=sub)\nfloat(t)") == 2.0


def test_a_subgroup_held_in_a_dict_and_a_nested_list_is_made_again_where_it_was(capfd, start_method):
    """``groups['dp'] = dist.new_group(...)``, also held in a list in a list: after a collective
    left half done on it, the groups are made again and the new subgroup is bound in each
    place (a DDP wrapper on it too: its own attribute, unnamed), the user's places named by
    their paths; the group and the wrapper work."""
    with start(start_method, namespace={}) as s:
        s.run(
            "import torch, torch.distributed as dist\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "groups = {'dp': dist.new_group([0, 1])}\nnested = [[groups['dp']]]\n"
            "ddp = DDP(torch.nn.Linear(2, 2), process_group=groups['dp'])"
        )
        with pytest.raises(WorkerFailedError):
            s.run(
                "t = torch.ones(1)\nif dist.get_rank() == 1:\n    raise ValueError('x')\n"
                "work = dist.all_reduce(t, group=groups['dp'], async_op=True)"
            )
        out = capfd.readouterr().out
        assert "process group was made again" in out, out
        assert "subgroup(s) groups['dp'], nested[0][0] made again" in out, out
        assert "DDP wrapper(s) ddp rebound" in out, out  # onto the new subgroup (its own attribute: unnamed)
        assert s.run("groups['dp'] is nested[0][0] is ddp.process_group") is True
        assert s.run("t = torch.ones(1)\ndist.all_reduce(t, group=groups['dp'])\nfloat(t)") == 2.0
        assert s.run("ddp(torch.ones(1, 2)).sum().backward()\nfloat(ddp.module.weight.grad.sum())") == 4.0
