"""FSDP2 modules in a session: sharded on the ranks, plain in the notebook, pulled whole."""

from __future__ import annotations

import pytest
import torch

from enot_nb.errors import WorkerFailedError
from tests._util import needs_fsdp2
from tests.session.common import start

pytestmark = [pytest.mark.timeout(120), needs_fsdp2]


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


def test_an_fsdp2_module_after_the_groups_were_made_again_says_how_to_shard_it_again():
    """A failure that leaves a collective half done makes every group again; FSDP2 cannot move
    onto new groups, so the module's next use is our error naming the variable and the line
    that shards it again, never gloo's transport error blaming a healthy rank."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ns = {"model": model, "torch": torch}
    with start("fork", namespace=ns) as s:
        s.run("import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\nfully_shard(model)")
        with pytest.raises(WorkerFailedError):
            s.run("if dist.get_rank() == 1:\n    raise ValueError('x')\nout = model(torch.ones(3, 4))")
        with pytest.raises(WorkerFailedError) as used:
            s.run("out = model(torch.ones(3, 4))")
        text = str(used.value)
        assert "model is sharded (FSDP) over the ranks' process groups that were made again" in text
        assert "model = fully_shard(build_model())" in text and "Connection closed" not in text
        assert s.run("t = torch.ones(1)\ndist.all_reduce(t)\nfloat(t)") == 2.0  # the rest goes on


def test_an_fsdp2_module_held_in_a_dict_is_guarded_by_its_path(capsys):
    """The FSDP2 module sits in a dict, a submodule of it sharded too: after the groups were
    made again the outermost one is guarded and named by its path (once: not again as sharded
    state), and its next use is our error naming that path."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ns = {"nets": {"G": model}, "torch": torch}
    with start("fork", namespace=ns) as s:
        s.run(
            "import torch.distributed as dist\nfrom torch.distributed.fsdp import fully_shard\n"
            "fully_shard(nets['G'][0])\nfully_shard(nets['G'])"
        )
        with pytest.raises(WorkerFailedError):
            s.run("if dist.get_rank() == 1:\n    raise ValueError('x')\nout = nets['G'](torch.ones(3, 4))")
        out = capsys.readouterr().out
        assert "FSDP module(s) nets['G'] were sharded over the groups that are gone" in out, out
        assert "sharded state" not in out, out
        with pytest.raises(WorkerFailedError) as used:
            s.run("out = nets['G'](torch.ones(3, 4))")
        assert "nets['G'] = fully_shard(build_model())" in str(used.value) and "%enot_pull nets`" in str(used.value)


def test_a_pulled_fsdp2_module_takes_plain_changes_onto_the_ranks_sharded_one():
    """After a pull, the notebook's module is its plain copy: a plain cell's ``model.eval()``
    reaches the ranks' sharded module (FSDP's dynamic subclass is the same module type for the
    path check), and a change to its values is loaded into it (every rank takes part), never a
    structural path mismatch that refuses every later cell."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    model.config = {"lr": 1}
    ns = {"model": model, "torch": torch}
    full = "full = [p.full_tensor().tolist() for p in model.parameters()]\ntraining = model.training"
    with start("fork", namespace=ns) as s:
        s.run(
            "from torch.distributed.fsdp import fully_shard\nfully_shard(model[0])\nfully_shard(model)\n"
            "model(torch.ones(3, 4)).sum().backward()",
            no_return=True,
        )
        s.pull("model")
        model.config["lr"] = 2  # a plain cell's change to an object the module holds
        assert s.run("model.config['lr']") == 2  # at its path through the ranks' sharded module
        model.eval()  # a plain cell
        s.run(full, no_return=True)
        assert s.pull("training") == {"training": False}
        with torch.no_grad():
            model[0].weight.fill_(0.5)  # a plain cell's change to its values
        s.run(full + "\nkind = type(model).__name__", no_return=True)
        got = s.pull("full", "kind")
        assert got["kind"] == "FSDPSequential" and got["full"][0] == [[0.5] * 4] * 8
        assert s.run("x = 1\nx") == 1
        s.run("_ = model.train()")  # the master's sharded module, found at the notebook's path
        assert "model" in s.flow.mirror.stale and model.training is False  # named stale, kept as it was


def test_a_cell_that_leaves_a_sharded_module_alone_leaves_the_pulled_copy_current():
    """(A forward pass through it is no read: FSDP changes its own state there.)"""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ns = {"model": model, "torch": torch}
    with start("fork", namespace=ns) as s:
        s.run("from torch.distributed.fsdp import fully_shard\nfully_shard(model)", no_return=True)
        s.pull("model")
        assert s.run("n = len(model)\nx = n + 1\nx") == 4
        assert "model" not in s.flow.mirror.stale
