"""Scale out: an exported training cell under torchrun (1 node x 2, and 2 nodes x 1 on
localhost) produces the same model as the same cell run by the magic in a kernel."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import enot_nb
from tests._util import clean_env, free_port, needs_fsdp2, run_all, torchrun_cmd
from tests.kernel import ROOT, running_kernel

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SETUP = """
%load_ext enot_nb
import torch
from enot_nb import distributed as ed
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
data = torch.randn(256, 8)
labels = (data.sum(dim=1) > 0).long()
"""

TRAIN = """\
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
print(f"helpers {ed.get_rank()} {ed.get_local_rank()} {ed.is_master()} {ed.is_local_master()}", flush=True)
dataset = TensorDataset(data, labels)
sampler = DistributedSampler(dataset, seed=0)
ddp = DistributedDataParallel(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y in DataLoader(dataset, batch_size=32, sampler=sampler):
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
final_loss = loss.item()
"""


def helper_lines(output: str) -> set[tuple[str, ...]]:
    # Ranks share torchrun's stdout: their writes may interleave mid-line, so match, don't split.
    return set(re.findall(r"helpers (\d+) (\d+) (True|False) (True|False)", output))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Export the cell, then run it with the magic; keep the magic's model."""
    folder = tmp_path_factory.mktemp("export")
    script = folder / "train.py"
    with running_kernel(SETUP) as kernel:
        run = kernel.ok(f"%%enot_distributed -n 2 --backend gloo --seed 0 --output all --export {script}\n{TRAIN}")
        assert "torchrun --nnodes 1 --nproc-per-node 2" in run.stdout and str(script) in run.stdout
        assert "helpers" not in run.stdout  # exporting does not run the cell
        kernel.ok(f"%%enot_distributed -n 2 --backend gloo --seed 0\n{TRAIN}")
        kernel.ok(f"torch.save({{k: v.clone() for k, v in model.state_dict().items()}}, {str(folder / 'magic.pt')!r})")
    return script, torch.load(folder / "magic.pt")


def check_same_model(script, magic_state):
    results = enot_nb.load_results(script)
    assert {"model", "final_loss", "optimizer"} <= set(results)
    state = results["model"].state_dict()
    assert state.keys() == magic_state.keys()
    for name in state:
        assert torch.equal(state[name], magic_state[name]), name
    assert all(t.device.type == "cpu" for t in state.values())


def _standalone_torchrun(script) -> str:
    """Run an exported script under ``torchrun --standalone`` with 2 processes; its output, once
    it succeeded."""
    proc = subprocess.Popen(
        torchrun_cmd("--standalone", "--nproc-per-node", "2", str(script)),
        env=clean_env(PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    (out,) = run_all([proc], timeout=120)
    assert proc.returncode == 0, out
    return out


def test_torchrun_one_node_two_processes(exported):
    script, magic_state = exported
    out = _standalone_torchrun(script)
    assert helper_lines(out) == {("0", "0", "True", "True"), ("1", "1", "False", "False")}, out
    check_same_model(script, magic_state)


def test_torchrun_two_nodes_on_localhost(exported):
    script, magic_state = exported
    enot_nb.export._beside(script, "results.pkl").unlink(missing_ok=True)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            torchrun_cmd(
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                str(script),
            ),
            env=clean_env(PYTHONPATH=str(ROOT)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = run_all(procs, timeout=120)
    assert [p.returncode for p in procs] == [0, 0], outs
    # Each node's helpers: rank 1 is the master of node 1 but not the global master.
    assert helper_lines(outs[0]) == {("0", "0", "True", "True")}
    assert helper_lines(outs[1]) == {("1", "0", "False", "True")}
    check_same_model(script, magic_state)


def test_plain_run_of_a_multiprocess_export_refuses(exported):
    script, _ = exported
    proc = subprocess.run(
        [sys.executable, str(script)], env=clean_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "exported for 2 processes" in proc.stderr and "torchrun" in proc.stderr


def test_torchrun_with_a_world_of_one_shows_our_line_as_the_root_cause(exported, tmp_path):
    """torchrun reports any non-zero exit as ChildFailedError; the error file it gives each
    process makes our one line that report's root cause."""
    script, _ = exported
    proc = subprocess.run(
        torchrun_cmd("--nproc-per-node", "1", "--master-port", str(free_port()), str(script)),
        env=clean_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    report = proc.stderr[proc.stderr.index("Root Cause") :]
    assert "this cell was exported for 2 processes, but runs as one plain process" in report
    assert "exitcode  : 2" in report


def test_export_cell_without_ipython(tmp_path):
    namespace = {"scale": 3, "weights": torch.ones(4)}
    code = "import torch.distributed as dist\ntotal = weights * scale\ndist.all_reduce(total)\n"
    exported = enot_nb.export_cell(code, tmp_path / "job.py", namespace, nprocs=2, backend="gloo")
    assert exported.command.startswith("torchrun --nnodes 1 --nproc-per-node 2")
    header = exported.script.read_text()
    assert "Requirements:" in header and "enot_nb" in header
    _standalone_torchrun(exported.script)
    assert torch.equal(enot_nb.load_results(exported.script)["total"], torch.full((4,), 6.0))


def test_export_without_nprocs_leaves_the_count_to_torchrun(tmp_path):
    with running_kernel("%load_ext enot_nb") as kernel:
        run = kernel.ok(f"%%enot_distributed --export {tmp_path / 'job.py'}\nx = 1")
    assert "--nproc-per-node gpu" in run.stdout and (tmp_path / "job.py").exists()


def test_load_results_before_a_run_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="run the exported script with torchrun"):
        enot_nb.load_results(tmp_path / "never_run.py")


@needs_fsdp2
def test_an_exported_cell_brings_a_sharded_model_back_whole(tmp_path):
    """FSDP2 under torchrun: the results file holds the plain module (its own class, plain
    parameters with the full trained values), as a cell's notebook gets it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    code = (
        "from torch.distributed.fsdp import fully_shard\nfully_shard(model[0])\nfully_shard(model)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.ones(3, 4)).sum().backward()\nopt.step()\n"
    )
    exported = enot_nb.export_cell(
        code, tmp_path / "job.py", {"model": model, "torch": torch}, nprocs=2, backend="gloo"
    )
    _standalone_torchrun(exported.script)
    back = enot_nb.load_results(exported.script)["model"]
    model(torch.ones(3, 4)).sum().backward()  # the same step here, in one process
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert type(back) is torch.nn.Sequential and all(type(p) is torch.nn.Parameter for p in back.parameters())
    for got, want in zip(back.parameters(), model.parameters()):
        assert torch.allclose(got, want, atol=1e-6)
