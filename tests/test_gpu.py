"""The CUDA and nccl paths, on a real GPU (marker ``gpu``; skipped without one).

Run on a lent GPU machine by ``scripts/gpu_check.sh``. One GPU is the usual case, so the suite
also runs two gloo ranks on that one GPU (CUDA tensors through bucketing and the state return)
and a one-rank nccl group made explicitly (device binding, nccl collectives, staging of CPU
tensors); NCCL refuses two ranks on one GPU. The device-choice logic one GPU cannot exercise is
covered on the CPU by tests/test_units.py.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch

import enot_nb
from enot_nb import distributed as ed
from tests.kernel import ROOT, running_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


# ----------------------------------------------------------------------------- jobs


def where_am_i() -> dict:
    import torch.distributed as dist

    t = torch.ones(1, device=f"cuda:{ed.get_local_rank()}")
    dist.all_reduce(t)
    return {
        "backend": dist.get_backend(),
        "world": ed.get_world_size(),
        "sum": t.item(),
        "device": torch.cuda.current_device(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def cuda_tensors_through_gloo() -> dict:
    """Two ranks on one GPU with gloo: sync_model buckets CUDA tensors; the result is CUDA."""
    torch.manual_seed(ed.get_rank())
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).cuda()
    ed.sync_model(model, reduce_parameters=False, reduce_buffers=False)
    return {"state": model.state_dict(), "big": torch.ones(2**20, device="cuda")}


def init_flags(speed: bool, reproducible: bool) -> dict:
    ed.init_torch(seed=0, cuda_optimize_for_speed=speed, cuda_reproducible=reproducible, backend="gloo")
    return {
        "benchmark": torch.backends.cudnn.benchmark,
        "deterministic": torch.backends.cudnn.deterministic,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def train_reproducibly() -> torch.Tensor:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 30 * 30, 10)
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(16, 3, 32, 32, device="cuda")
    for _ in range(5):
        optimizer.zero_grad()
        model(data).pow(2).mean().backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()


# ----------------------------------------------------------------------------- launcher


def test_nprocs_none_starts_one_nccl_rank_per_visible_gpu():
    results = enot_nb.notebook_launcher(where_am_i)
    assert results["backend"] == "nccl" and results["world"] == GPUS and results["sum"] == GPUS
    assert results["device"] == 0


def test_nccl_with_more_ranks_than_gpus_fails_before_start_naming_the_count():
    with pytest.raises(enot_nb.launcher.LaunchConfigError, match=f"{GPUS} GPU"):
        enot_nb.notebook_launcher(where_am_i, nprocs=GPUS + 1, backend="nccl")


def test_cuda_visible_devices_is_honoured():
    code = (
        "import enot_nb, json; from tests.test_gpu import where_am_i; "
        "print(json.dumps(enot_nb.notebook_launcher(where_am_i)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": "0", "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert '"world": 1' in out.stdout and '"visible": "0"' in out.stdout
    hidden = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)},
    )
    assert hidden.returncode != 0 and "no GPU is visible" in hidden.stderr


def test_two_gloo_ranks_on_one_gpu_sync_and_return_cuda_tensors():
    result = enot_nb.notebook_launcher(cuda_tensors_through_gloo, nprocs=2, backend="gloo")
    torch.manual_seed(0)
    expected = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64)).state_dict()
    for name, value in expected.items():  # rank 0's weights everywhere; back on the CPU
        assert result["state"][name].device.type == "cpu"
        assert torch.equal(result["state"][name], value), name
    assert result["big"].device.type == "cpu" and result["big"].sum().item() == 2**20


@pytest.mark.parametrize("speed, reproducible", [(True, False), (False, True)])
def test_init_torch_sets_the_flags_it_promises(speed, reproducible):
    flags = enot_nb.notebook_launcher(init_flags, args=(speed, reproducible), nprocs=1, backend="gloo")
    if speed:
        assert flags["benchmark"] and flags["tf32"] and not flags["deterministic"]
    else:
        assert flags["deterministic"] and not flags["benchmark"] and flags["algorithms"]


def test_a_reproducible_run_gives_bitwise_equal_weights_twice():
    runs = [
        enot_nb.notebook_launcher(train_reproducibly, nprocs=1, backend="gloo", seed=0, cuda_reproducible=True)
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])


# ----------------------------------------------------------------------------- one-rank nccl


@pytest.fixture
def nccl_group(tmp_path):
    """A one-rank nccl process group in this process (NCCL refuses two ranks on one GPU)."""
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    torch.distributed.init_process_group(
        "nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    torch.cuda.set_device(0)
    yield
    torch.distributed.destroy_process_group()
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        os.environ.pop(key, None)


def test_nccl_collectives_and_staging_of_cpu_tensors(nccl_group):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))  # on the CPU
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ed.sync_model(model)  # CPU tensors staged through cuda:0 for nccl
    for name, value in model.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, before[name]), name
    cuda_model = torch.nn.Linear(8, 8).cuda()
    cuda_model.register_buffer("counter", torch.arange(4))  # a CPU-made integer buffer, moved
    ed.sync_model(cuda_model)
    with ed.master_first():
        pass
    t = torch.ones(3, device="cuda")
    torch.distributed.all_reduce(t)
    assert t.sum().item() == 3


# ----------------------------------------------------------------------------- the notebook side


def test_a_kernel_that_initialized_cuda_runs_a_cell_through_the_fork_server():
    with running_kernel(
        "%load_ext enot_nb\nimport torch\nx = torch.zeros(1).cuda()\n"
        "torch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\nw0 = model.weight.clone()"
    ) as k:
        run = k.ok(
            "%%enot_distributed -n 1 --backend nccl\n"
            "from enot_nb import distributed as ed\n"
            "model.cuda(ed.get_local_rank())\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "for _ in range(3):\n    opt.zero_grad()\n"
            "    model(torch.ones(8, 4, device='cuda')).pow(2).mean().backward()\n    opt.step()\n",
            timeout=240,
        )
        assert "Cannot re-initialize CUDA" not in run.stderr
        assert "came back on the CPU" in run.stderr
        check = k.ok("print(model.weight.device.type, not torch.equal(model.weight, w0))")
        assert check.stdout == "cpu True\n"


def test_state_return_of_a_one_gib_cuda_tensor_is_timed():
    def make() -> torch.Tensor:
        return torch.ones(2**28, device=f"cuda:{ed.get_local_rank()}")  # 1 GiB of float32

    start = time.perf_counter()
    result = enot_nb.notebook_launcher(make, nprocs=1, backend="gloo")
    seconds = time.perf_counter() - start
    assert result.device.type == "cpu" and result.numel() == 2**28
    print(f"GPU-ROW state return of a 1 GiB CUDA tensor: {seconds * 1000:.0f} ms")


def test_the_training_notebook_runs_to_the_end_on_the_gpu(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "run_notebook.py"),
            str(ROOT / "notebooks" / "02_train_classifier.ipynb"),
            str(tmp_path / "run.ipynb"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
