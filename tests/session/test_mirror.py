"""A session's mirror: what a cell changes on the master comes back, what a plain cell changes reaches
the ranks; pushes a rank refuses; pulls."""

from __future__ import annotations

import types

import pytest
import torch

import enot_nb
from enot_nb.errors import LaunchError, WorkerFailedError
from enot_nb.sessions import session
from tests.session.common import DDP_SETUP, start

pytestmark = pytest.mark.timeout(120)


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

    ns = {"d": {"k": types.SimpleNamespace(scale=1.0)}}
    with start("fork", namespace=ns) as s:
        s.run("d")
        c = ns["d"].pop("k")
        c.scale = 2.0
        ns["c"] = c
        assert s.run("c.scale, len(d)") == (2.0, 0)
        assert s.launch(lambda: (c.scale, len(d))) == (2.0, 0)  # noqa: F821 - the rank's


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


def test_a_push_one_rank_cannot_apply_runs_the_cell_nowhere_and_keeps_the_record():
    ns = {"d": {"k": [1]}, "m": torch.nn.Linear(1, 1)}
    with start("fork", namespace=ns) as s:
        s.run("import torch.distributed as dist\nheld = [m]\nif dist.get_rank() == 1:\n    d['k'] = (1,)")
        ns["d"]["k"].append(2)  # a change rank 1 cannot apply: it holds a tuple there
        with pytest.raises(WorkerFailedError) as failed:
            s.run("ran = True")
        assert failed.value.rank == 1 and "d['k']" in str(failed.value) and "PathError" in str(failed.value)
        assert "ran" not in ns  # the master did not run the cell either
        ns["d"]["k"] = [1, 2]  # rebound: now stale (the push was refused), so which side wins is asked
        with pytest.raises(LaunchError, match="'d'"):
            s.run("ran = True")
        s.pull("d", keep_notebook=True)  # d sent whole: every rank takes the new list by value
        assert s.run("(d['k'], held[0] is m)") == ([1, 2], True)  # the ranks' own objects kept


def test_a_push_a_rank_refuses_marks_the_variable_stale_once_and_the_next_cell_runs(capsys):
    """A change that truly cannot be applied on a rank refuses that task, by name; the variable
    is then stale (named once), never pushed again, and the session takes the next cell."""
    ns = {"w": torch.zeros(2), "k": 1}
    with start("fork", namespace=ns) as s:
        s.run("import torch, torch.distributed as dist\nif dist.get_rank() == 1:\n    w.resize_(5).zero_()")
        ns["w"].add_(1)
        with pytest.raises(WorkerFailedError) as failed:
            s.run("pass")
        assert failed.value.rank == 1 and "w: its storage holds (8,) bytes in the notebook, (20,)" in str(failed.value)
        assert "w: the ranks keep their own value" in capsys.readouterr().err
        assert "w" in s.flow.mirror.stale
        ns["k"] = 2
        assert s.run("k * 10") == 20  # the next cell runs, the refused change is not sent again
        assert "the ranks keep their own value" not in capsys.readouterr().err  # named once
        ns["w"].add_(1)  # a change to a stale variable: which side wins is asked
        with pytest.raises(LaunchError, match="--keep-notebook"):
            s.run("pass")
        assert s.pull("w", overwrite=True)["w"].tolist() == [1.0, 1.0]  # rank 0 had applied the push
        assert s.run("len(w)") == 2


def test_a_stale_variable_changed_here_asks_which_side_wins():
    ns = {"x": [1], "y": 0}
    with start("fork", namespace=ns) as s:
        s.run("x.append(2)", no_return=True)
        ns["x"].append(3)
        with pytest.raises(LaunchError, match="'x'.*--overwrite.*--keep-notebook"):
            s.run("pass")
        with pytest.raises(enot_nb.StaleError, match="'x'"):
            s.pull("x")  # neither option: the notebook's change is never dropped silently
        with pytest.raises(enot_nb.errors.LaunchConfigError):
            s.pull("x", overwrite=True, keep_notebook=True)
        assert ns["x"] == [1, 3]
        assert s.pull("x", overwrite=True) == {"x": [1, 2]} and ns["x"] == [1, 2]
        assert s.run("len(x)") == 2


def test_keep_notebook_sends_the_notebooks_value_in_place_to_every_rank():
    ns = {"x": [1]}
    with start("fork", namespace=ns) as s:
        s.run("held = x")
        s.run("x.append(2)", no_return=True)
        ns["x"].append(3)
        assert s.pull("x", keep_notebook=True) == {"x": [1, 3]}
        assert s.launch(lambda: (x, held is x)) == ([1, 3], True)  # noqa: F821 - the rank's globals
        assert s.run("import torch.distributed as dist\nout = [None, None]\ndist.all_gather_object(out, x)\nout") == [
            [1, 3],
            [1, 3],
        ]
        assert "x" not in s.flow.mirror.stale


def test_a_pull_of_another_name_is_never_refused_by_a_stale_one_and_the_conflict_stays():
    ns = {"x": [1], "y": 0}
    with start("fork", namespace=ns) as s:
        s.run("x.append(2)\ny = 5", no_return=True)
        ns["x"].append(3)
        assert s.pull("y") == {"y": 5}  # x's conflict refuses nothing of y
        assert ns["x"] == [1, 3]  # the notebook's change kept, not pushed
        with pytest.raises(LaunchError, match="'x'"):
            s.run("pass")  # still asked, though the pull walked the record again
        assert s.pull("x", keep_notebook=True) == {"x": [1, 3]}
        assert s.run("list(x)") == [1, 3]  # (a bare name would show the notebook's own object)


def test_reads_never_make_a_name_stale():
    """A --no-return cell that only reads ``log`` and a --return cell that only reads ``a`` (or
    changed it in place: that comes back) leave them current: a plain change then reaches the ranks."""
    ns = {"log": [1], "a": [0], "d": {"k": 1}}
    with start("fork", namespace=ns) as s:
        s.run("n = len(log) + d['k']", no_return=True)
        s.run("a.append(1)\nb = len(a) + d['k']", returns=["b"])
        assert ns["a"] == [0, 1] and ns["b"] == 3
        assert not s.flow.mirror.stale
        ns["log"].append(2)
        ns["a"].append(2)
        ns["d"]["k"] = 7
        assert s.run("(len(log), len(a), d['k'])") == (2, 3, 7)
        s.run("log.append(3)\nnew = 1", no_return=True)  # a change: only that name is stale
        assert set(s.flow.mirror.stale) == {"log"} and "new" in s.flow.mirror.on_workers


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


def test_a_session_in_the_namespace_is_never_pushed_and_tasks_that_read_every_name_run(capsys):
    """``with Session(...) as s`` in a notebook cell binds ``s`` beside the variables: a task that
    reads names dynamically (``eval``) pushes every name, and the Session (epoll, pipes) is named
    once and left in the notebook, never pickled."""
    ns: dict = {}
    with start("fork", namespace=ns) as s:
        ns["s"] = s
        s.push(k=21)
        assert s.run("k2 = k * 2\nk2") == 42
        assert s.run("eval('k2 + 1')") == 43
        assert s.run("eval('k2 + 2')") == 44
        assert s.launch(lambda: __import__("os").environ["RANK"]) == "0"
        out = capsys.readouterr().out
        assert out.count("'s' stays in the notebook, not on the ranks: Session is enot_nb's own") == 1


def test_a_variable_that_cannot_be_pickled_stays_in_the_notebook_and_the_cell_runs(capsys):
    import threading

    ns: dict = {"lock": threading.Lock(), "n": 1}
    with start("fork", namespace=ns) as s:
        assert s.run("eval('n + 1')") == 2  # reads every name: lock too
        assert s.run("eval('n + 2')") == 3
        out = capsys.readouterr().out
        assert out.count("'lock' stays in the notebook, not on the ranks: lock cannot be pickled") == 1
        ns["lock"] = [1, 2]  # a value that travels: pushed again
        assert s.run("eval('lock')") == [1, 2]


def test_a_tensor_with_a_graph_going_out_is_named_as_one_coming_back_is(capsys):
    """``out = model(x)`` in a plain cell, then ``out.sum().backward()`` in a session cell: the
    ranks get ``out`` without its graph, so the backward reaches no parameter; a note says so,
    once, instead of leaving the no-op silent."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    ns = {"model": model, "out": model(torch.ones(1, 2))}
    with start("fork", namespace=ns) as s:
        s.run("loss = out.sum() * 2")
        s.run("loss = out.sum() * 3")
        out = capsys.readouterr().out
        assert out.count("out: reached the ranks without its autograd graph") == 1, out


def test_an_array_and_a_tensor_sharing_memory_share_it_on_the_ranks_whichever_reaches_them_first():
    import numpy as np

    arr = np.zeros(4)
    ns = {"arr": arr, "u": torch.from_numpy(arr)}
    with start("fork", namespace=ns) as s:
        s.run("u.add_(1)")  # u's storage reaches the ranks first
        assert s.run("arr[1] = 5\nfloat(u[1])") == 5.0  # arr, later, is rebuilt over the ranks' own
        arr[2] = 8
        assert s.run("float(u[2])") == 8.0 and arr.tolist() == [1.0, 5.0, 8.0, 1.0]


class Box:
    """A set's item: hashed by identity, as a user's class is."""

    def __init__(self, v):
        self.v = v


def test_a_set_of_parameters_does_not_stop_their_changes():
    """Two parameters alike (shape, dtype): the set's items are found by their paths in the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False))
    ns = {"model": model}
    with start("fork", namespace=ns) as s:
        s.run("import torch\nparams = set(model.parameters())")
        s.run(
            "opt = torch.optim.SGD(params, lr=0.1)\n"
            "model(torch.ones(3, 2)).sum().backward()\nopt.step()\nw = [p.tolist() for p in model.parameters()]"
        )
        assert [p.tolist() for p in model.parameters()] == ns["w"] and all(
            p in ns["params"] for p in model.parameters()
        )
        with torch.no_grad():
            model[0].weight.fill_(1.0)  # a plain cell's change to the first one only
        assert s.run("[p.sum().item() for p in model.parameters()]")[0] == 4.0


def test_items_of_sets_and_frozensets_correspond_through_what_they_hold():
    """A change inside a set's item comes back; a plain cell's change to an item reaches the
    ranks, into the rank's own item (never one matched by iteration order or an ambiguous step)."""
    ns = {"boxes": {Box(1), Box(2), Box(3)}, "fz": frozenset({Box(10), Box(20)})}
    with start("fork", namespace=ns) as s:
        s.run("for b in boxes:\n    b.v += 100")
        assert sorted(b.v for b in ns["boxes"]) == [101, 102, 103]
        next(b for b in ns["boxes"] if b.v == 102).v = 7  # a plain cell's change to one item
        assert s.run("sorted(b.v for b in boxes)") == [7, 101, 103]
        next(b for b in ns["fz"] if b.v == 10).v = 11
        assert s.run("sorted(b.v for b in fz)") == [11, 20]
        s.run("for b in fz:\n    b.v *= 2")
        assert sorted(b.v for b in ns["fz"]) == [22, 40]
        assert s.run("x = 1\nx") == 1


class Keyed:
    """Hashed so that a set iterates its items in one order in this process and in the opposite
    order on the ranks: matching items by iteration order would pair the wrong ones."""

    def __init__(self, k, w=0):
        self.k, self.w = k, w

    def __hash__(self):
        import os

        return -self.k if "RANK" in os.environ else self.k


def test_set_items_are_never_matched_by_iteration_order():
    ns = {"keyed": {Keyed(1), Keyed(2), Keyed(3)}, "fkeyed": frozenset({Keyed(4), Keyed(5), Keyed(6)})}
    with start("fork", namespace=ns) as s:
        assert s.run("[k.k for k in keyed]") != [k.k for k in ns["keyed"]]  # the orders differ
        assert s.run("[k.k for k in fkeyed]") != [k.k for k in ns["fkeyed"]]  # the ranks hold both now
        next(k for k in ns["keyed"] if k.k == 1).w = 100
        next(k for k in ns["fkeyed"] if k.k == 4).w = 400
        assert s.run("sorted((k.k, k.w) for k in [*keyed, *fkeyed])") == [
            (1, 100),
            (2, 0),
            (3, 0),
            (4, 400),
            (5, 0),
            (6, 0),
        ]


def test_a_large_log_of_plain_records_is_one_object_changed_in_place_both_ways():
    """300,000 ``{"i": ..., "tag": ...}`` records (kind PLAIN: digested whole, never walked): a
    change inside one comes back in place (the list and the record keep their identity), a
    plain cell's change reaches the ranks."""
    from enot_nb._state.kinds import Kind, kind_of

    records = [{"i": i, "tag": "a", "seen": [i]} for i in range(300_000)]
    assert kind_of(records) is Kind.PLAIN
    fifth, ns = records[5], {"records": records}
    with start("fork", namespace=ns) as s:
        assert s.run("len(records)") == 300_000
        s.run("records[5]['i'] = -1\nrecords[5]['seen'].append(0)\nrecords.append({'i': 'new'})")
        assert ns["records"] is records and records[5] is fifth and fifth == {"i": -1, "tag": "a", "seen": [5, 0]}
        assert records[-1] == {"i": "new"} and len(records) == 300_001
        records[7]["tag"] = "b"  # a plain cell's change
        assert s.run("(records[7]['tag'], records[5]['i'], len(records))") == ("b", -1, 300_001)


def test_a_plain_log_changed_by_the_cell_that_first_reaches_it_comes_back():
    """The master tells a large container plain once (one pickle) while it finds its registry and
    takes its snapshot; the cell's own change to it must still be seen after (the master lets
    go of what it learned before the cell's code runs)."""
    log = [{"i": i} for i in range(2000)]
    ns = {"log": log}
    with start("fork", namespace=ns) as s:
        s.run("log[3]['i'] = -3")
        assert ns["log"] is log and log[3] == {"i": -3}
        log[4]["i"] = -4  # a plain cell's change: pushed, so the master finds its registry anew
        s.run("log[5]['i'] = -5")
        assert log[5] == {"i": -5} and s.run("log[4]['i']") == -4


# ----------------------------------------------------------------------------- conflicts settled
# (issue 43, items 2.4 and 2.5: a --no-return cell's tensor writes are stale as its NumPy writes
# are; a pull of one name neither depends on nor clears another name's conflict)


@pytest.mark.parametrize("write", ["t.add_(1)", "v = t[1:]\nv.add_(3)", "ddp.module.load_state_dict(ones)"])
def test_a_no_return_cells_tensor_write_is_stale_as_a_numpy_write_is(write):
    """An in-place tensor write (through the variable, a view, or DDP's ``.module``) in a
    --no-return cell marks the variable stale: a plain write to it after is a conflict, never
    pushed silently over (or merged page by page into) the master's newer value."""
    torch.manual_seed(0)
    ns = {"t": torch.zeros(4), "model": torch.nn.Linear(2, 2), "arr": __import__("numpy").zeros(2)}
    with start("fork", namespace=ns) as s:
        s.run(DDP_SETUP + "ones = {k: torch.ones_like(v) for k, v in model.state_dict().items()}\nn = len(t)")
        s.run(write + "\narr += 1", no_return=True)
        name = "model" if "ddp" in write else "t"
        assert set(s.flow.mirror.stale) == {name, "arr"}, s.flow.mirror.stale
        held = ns[name] if name == "t" else ns[name].weight
        with torch.no_grad():
            held[0] = 5.0  # a plain cell writes the stale copy
        with pytest.raises(enot_nb.StaleError, match=f"'{name}'"):
            s.run("pass")
        master = s.pull(name, overwrite=True)[name]  # rank 0's value wins, whole
        expected = [1.0, 1.0] if name == "model" else [1.0] * 4 if write == "t.add_(1)" else [0.0, 3.0, 3.0, 3.0]
        assert (master.weight[0] if name == "model" else master).tolist() == expected


def test_keep_notebook_of_one_name_beside_another_conflict_settles_that_one_alone():
    """``%enot_pull a --keep-notebook`` while ``b`` is in conflict too: ``a`` goes to every rank
    (nothing of ``b`` with it), ``b`` is still asked about, and once settled neither side's ``a``
    is a merge of both."""
    ns = {"a": {"x": 0}, "b": torch.zeros(3)}
    with start("fork", namespace=ns) as s:
        s.run("n = len(a) + len(b)")
        s.run("a['m'] = 1\nb.add_(1)", no_return=True)
        ns["a"]["x"] = 5
        ns["b"][0] = 7.0
        assert s.pull("a", keep_notebook=True) == {"a": {"x": 5}}
        assert "a" not in s.flow.mirror.stale and s.flow.mirror.conflicts == {"b"}
        with pytest.raises(enot_nb.StaleError, match="'b'"):
            s.run("pass")
        assert s.pull("b", overwrite=True)["b"].tolist() == [1.0, 1.0, 1.0]
        assert s.run("(dict(a), b.tolist())") == ({"x": 5}, [1.0, 1.0, 1.0])
        ns["a"]["y"] = 2  # current again: a plain change reaches the ranks
        assert s.launch(lambda: dict(a)) == {"x": 5, "y": 2}  # noqa: F821 - the rank's globals


def test_a_keep_notebook_a_rank_refuses_settles_nothing():
    """The notebook's value cannot be applied on rank 1 (its storage has another size): the
    conflict it was to settle is still asked about, though the record takes the notebook's value."""
    ns = {"w": torch.zeros(2)}
    with start("fork", namespace=ns) as s:
        s.run("import torch.distributed as dist\nn = len(w)")
        s.run("w.add_(2)\nif dist.get_rank() == 1:\n    w.resize_(5)", no_return=True)
        ns["w"][0] = 7.0
        with pytest.raises(WorkerFailedError) as failed:
            s.pull("w", keep_notebook=True)
        assert failed.value.rank == 1
        with pytest.raises(enot_nb.StaleError, match="'w'"):
            s.run("pass")
        assert s.pull("w", overwrite=True)["w"].tolist() == [7.0, 0.0]  # rank 0 had applied the push
        assert s.run("w.tolist()") == [7.0, 0.0] and not s.flow.mirror.stale


@pytest.mark.parametrize("bound", ["synced", "bound-on-the-ranks-alone"])
def test_a_stale_name_deleted_here_is_a_conflict_keep_notebook_deletes_it_on_the_ranks(bound):
    """A stale variable the notebook deleted: every session cell is refused, naming it, until
    the user says which side wins; ``--keep-notebook`` deletes it on every rank, ``--overwrite``
    brings the master's value back. Also where no sync sent it (a rank-only function bound it)."""
    ns = {"a": [1]}
    with start("fork", namespace=ns) as s:
        if bound == "synced":
            s.run("n = len(a)")
            s.run("a.append(2)", no_return=True)
        else:
            s.run("def put(name, value):\n    put.__globals__[name] = value", no_return=True)  # rank-only
            s.run("put('a', [9])", no_return=True)  # no name the notebook could send
            assert "a" not in s.flow.mirror.record.synced
        assert "a" in s.flow.mirror.stale
        del ns["a"]
        with pytest.raises(enot_nb.StaleError, match="'a'"):
            s.run("m = 1")
        assert s.pull("a", keep_notebook=True) == {}
        assert not s.flow.mirror.stale and "a" not in ns
        assert s.run("'a' in dir()") is False
        assert s.launch(lambda: "a" in globals()) is False


def test_an_overwrite_the_master_cannot_answer_settles_nothing():
    """``%enot_pull a --overwrite`` where rank 0 deleted ``a`` (a --no-return cell) and the
    notebook changed it: the pull fails, naming it, and the conflict is still asked about (the
    record, walked again after the pull, no longer shows the notebook's change)."""
    ns = {"a": [1], "b": [0]}
    with start("fork", namespace=ns) as s:
        s.run("n = len(a) + len(b)")
        s.run("del a\nb.append(1)", no_return=True)
        ns["a"].append(2)
        ns["b"].append(3)
        with pytest.raises(enot_nb.NotHeldError, match="rank 0 holds no variable 'a'"):
            s.pull("a", "b", overwrite=True)
        with pytest.raises(enot_nb.StaleError, match="'a'"):
            s.run("pass")
        assert s.pull("b", overwrite=True) == {"b": [0, 1]}
        with pytest.raises(WorkerFailedError, match="a: no such variable on this rank"):
            s.pull("a", keep_notebook=True)  # (sent in place, where the ranks hold nothing: a limitation)
        with pytest.raises(enot_nb.StaleError, match="'a'"):
            s.run("pass")
        del ns["a"]  # rank 0's side, by hand
        assert s.pull("a", keep_notebook=True) == {}
        assert s.run("('a' in dir(), list(b))") == (False, [0, 1]) and not s.flow.mirror.stale


def test_a_failed_pull_of_a_stale_name_unchanged_here_leaves_no_conflict():
    """Only a conflict the pull was to settle is kept after it fails: a stale name the notebook
    never changed is still no conflict, and the next cell runs."""
    ns = {"a": [1]}
    with start("fork", namespace=ns) as s:
        s.run("n = len(a)")
        s.run("del a", no_return=True)
        with pytest.raises(enot_nb.NotHeldError, match="rank 0 holds no variable 'a'"):
            s.pull("a", overwrite=True)
        assert s.run("n + 1") == 2 and "a" in s.flow.mirror.stale and not s.flow.mirror.conflicts


def test_a_view_of_a_strided_array_the_notebook_holds_comes_back_without_its_owner():
    """A view whose elements are all elements of a strided array the notebook holds comes back
    as a view of that array, by index: its owner's 8 MiB (which the notebook holds only through
    ``row``) do not travel again."""
    ns: dict = {}
    with start("fork", namespace=ns) as s:
        s.run("import numpy as np\na = np.arange(2**20, dtype=np.float64)\nrow = a[::2]\ndel a")
        s.run("sub = row[1:]")
        assert s.last.result_bytes < 1 << 20
        assert ns["sub"].base is ns["row"].base and ns["sub"][0] == 2.0
        ns["row"][1] = -1.0
        assert s.run("float(sub[0])") == -1.0


@pytest.mark.parametrize("tensor_first", [True, False], ids=["tensor-first", "array-first"])
def test_a_tensor_over_the_owner_of_a_strided_view_the_ranks_hold_shares_that_owner_there(tensor_first):
    """``row = a[::2]`` reached the ranks (with all of ``a``'s memory), then a plain cell made
    ``t = torch.from_numpy(a)``: on the ranks ``t``, ``a`` and ``row`` are one memory, as here,
    whichever of ``t`` and ``a`` the push meets first (the fuzzer's seed 69000455 found ``t`` a
    copy)."""
    import numpy as np

    ns: dict = {"t": None} if tensor_first else {}  # the push goes in the namespace's order
    ns["a"] = np.arange(6, dtype=np.float64)
    ns["row"] = ns["a"][::2]
    with start("fork", namespace=ns) as s:
        s.run("row.sum()")
        ns["t"] = torch.from_numpy(ns["a"])
        shared = "np.shares_memory(t.numpy(), a), np.shares_memory(row, a), row.base is a"
        assert s.run(f"import numpy as np\n{shared}") == (True, True, True)
        assert s.run("t[2] = 7\nrow.tolist()") == [0.0, 7.0, 4.0]
        assert ns["row"].tolist() == [0.0, 7.0, 4.0] and ns["t"][2] == 7


def test_a_tensor_over_a_fortran_owner_of_a_view_the_ranks_hold_reaches_them_as_its_bytes():
    """``t`` over the owner of a view the ranks hold: where their owner is laid out otherwise
    it goes as its own bytes, values kept (it once failed the push: "laid out otherwise"); a
    Fortran-ordered owner now travels with its view, and ``t`` shares it there."""
    import numpy as np

    ns = {"a": np.asfortranarray(np.arange(12.0).reshape(3, 4))}
    ns["row"] = ns["a"][:, ::2]
    with start("fork", namespace=ns) as s:
        s.run("row.sum()")
        ns["t"] = torch.from_numpy(ns["a"])
        assert s.run("t.add_(1)\nfloat(t.sum())") == 78.0
        assert float(ns["t"].sum()) == 78.0
