"""Do the replicas still agree? ``Session.check()``, ``%enot_session check`` and
``%%enot_distributed --check-replicas`` compare every tensor replicated by construction across
the ranks, in a real kernel and through the API, and name each one that drifted, its rank and how
far; sharded state is named, never compared."""

from __future__ import annotations

import pytest

from tests.kernel import running_kernel
from tests.session.common import start

pytestmark = pytest.mark.timeout(240)

TRAINED = (
    "import torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))\n"
    "ddp = DDP(model)\n"
    "opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)\n"
    "g = torch.Generator().manual_seed(dist.get_rank())\n"
    "for _ in range(3):\n"
    "    ddp(torch.randn(16, 4, generator=g)).pow(2).mean().backward()\n"
    "    opt.step()\n"
    "    opt.zero_grad()\n"
)
# Rank 1 alone moves one weight by 0.5 and doubles one momentum buffer: a drift DDP never undoes.
DRIFT_ON_RANK_1 = (
    "if dist.get_rank() == 1:\n"
    "    with torch.no_grad():\n"
    "        model[0].weight[0, 0] += 0.5\n"
    "        opt.state[model[2].bias]['momentum_buffer'].mul_(2)\n"
)
WEIGHT = "ddp.module.0.weight"
MOMENTUM = "opt.state[ddp.module.2.bias]['momentum_buffer']"


def test_a_drift_on_rank_1_is_named_with_its_rank_and_distance_and_nothing_is_changed(start_method):
    with start(start_method, namespace={}) as s:
        assert "no replicated state" in str(s.check())
        s.run(TRAINED)
        trained = s.check()
        # BatchNorm's running statistics are each rank's own after a forward on its own data:
        # DDP sends rank 0's at the next forward, so they are named but are no disagreement.
        assert trained.agree, trained
        assert trained.compared == 6 + 3 + 6  # parameters, BatchNorm's buffers, momentum buffers
        assert {d.where for d in trained.differences} == {"ddp.module.1.running_mean", "ddp.module.1.running_var"}
        assert "buffers that DDP sends from rank 0 at its next forward differ" in str(trained)
        s.run(DRIFT_ON_RANK_1)
        drifted = s.check()
        assert not drifted.agree
        found = {d.where: d for d in drifted.drifted}
        assert set(found) == {WEIGHT, MOMENTUM}
        assert found[WEIGHT].rank == 1 and found[WEIGHT].max_abs_difference == pytest.approx(0.5)
        momentum = s.run("opt.state[model[2].bias]['momentum_buffer'].abs().max().item()")
        assert found[MOMENTUM].max_abs_difference == pytest.approx(momentum)  # 2m - m on rank 1
        text = str(drifted)
        assert f"{WEIGHT}: rank 1 differs from rank 0, max abs difference 0.5" in text
        assert f"{MOMENTUM}: rank 1 differs from rank 0" in text
        assert s.check().drifted == drifted.drifted  # a check changes nothing


def test_sharded_state_is_named_never_compared_and_state_on_one_rank_only_is_named(start_method):
    with start(start_method, namespace={}) as s:
        s.run(
            TRAINED + "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
            "zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)\n"
            "ddp(torch.randn(16, 4, generator=g)).pow(2).mean().backward()\n"
            "zero.step()\n"
        )
        report = s.check()
        assert report.agree, report
        assert any(line.startswith("zero (ZeroRedundancyOptimizer") for line in report.sharded)
        assert "sharded, not compared: zero (ZeroRedundancyOptimizer" in str(report)
        # An optimizer over DDP's parameters that only rank 1 stepped: held differently, not compared.
        s.run(
            "if dist.get_rank() == 1:\n"
            "    mine = torch.optim.SGD(ddp.parameters(), lr=0.0, momentum=0.9)\n"
            "    for p in ddp.parameters():\n"
            "        p.grad = torch.ones_like(p)\n"
            "    mine.step()\n"
        )
        apart = s.check()
        assert not apart.agree and apart.not_everywhere_elsewhere == 6 and not apart.drifted
        assert "not held alike on every rank, not compared: 6 that rank 0 does not hold" in str(apart)


def test_ddp_over_a_subgroup_is_named_not_compared_with_another_groups_replicas():
    """Each rank its own data-parallel group of one (its own seed): its replicas agree within
    it, and taking rank 0's for a reference would report a drift that is none."""
    with start("fork", namespace={}) as s:
        s.run(
            "import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
            "groups = [dist.new_group([0]), dist.new_group([1])]\n"
            "torch.manual_seed(dist.get_rank())\n"
            "alone = DDP(torch.nn.Linear(4, 4), process_group=groups[dist.get_rank()])\n"
        )
        report = s.check()
        assert report.agree and report.compared == 0, report
        assert report.sharded == ["alone (DDP over a subgroup of the ranks: its replicas agree within it)"]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_the_session_check_and_a_cells_check_replicas_name_a_drift_in_the_notebook(start_method):
    with running_kernel("%load_ext enot_nb") as k:
        k.ok(f"%enot_session start -n 2 --backend gloo --start-method {start_method}")
        k.ok("%%enot_distributed\n" + TRAINED)
        agreed = k.ok("%enot_session check")
        assert "the replicas agree" in agreed.result["text/plain"], agreed.result
        drifted = k.ok("%%enot_distributed --check-replicas\n" + DRIFT_ON_RANK_1)
        assert f"{WEIGHT}: rank 1 differs from rank 0, max abs difference 0.5" in drifted.stdout, drifted.stdout
        assert MOMENTUM in drifted.stdout
        again = k.ok("%enot_session check")
        assert "2 difference(s)" in again.result["text/plain"]
        assert k.ok("import enot_nb\nenot_nb.session().check().agree").result["text/plain"] == "False"
        refused = k.run("%enot_session check -n 2")
        assert "UsageError: %enot_session: options go with start or restart" in refused.stderr  # IPython's way
        k.ok("%enot_session stop")
        assert "no session is running" in k.ok("%enot_session check").stdout


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_one_off_cell_with_check_replicas_names_a_drift_and_the_sharded_state(start_method):
    with running_kernel("%load_ext enot_nb") as k:
        run = k.ok(
            f"%%enot_distributed -n 2 --backend gloo --start-method {start_method} --check-replicas --no-return\n"
            + TRAINED
            + DRIFT_ON_RANK_1
            + "from torch.distributed.optim import ZeroRedundancyOptimizer\n"
            "zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.01)\n"
        )
        assert "replica check on 2 ranks: 15 tensor(s) compared, 2 difference(s)" in run.stdout, run.stdout
        assert f"{WEIGHT}: rank 1 differs from rank 0, max abs difference 0.5" in run.stdout
        assert "sharded, not compared: zero (ZeroRedundancyOptimizer" in run.stdout
        quiet = k.ok(f"%%enot_distributed -n 2 --backend gloo --start-method {start_method}\n" + TRAINED)
        assert "replica check" not in quiet.stdout  # only when asked
