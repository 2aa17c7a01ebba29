"""The CUDA and nccl paths, on a real GPU (marker ``gpu``; skipped without one).

Run on a lent GPU machine by ``scripts/gpu_check.sh``. One GPU is the usual case, so the suite
also runs two gloo ranks on that one GPU (CUDA tensors through bucketing and the state return)
and a one-rank nccl group made explicitly (device binding, nccl collectives, staging of CPU
tensors); NCCL refuses two ranks on one GPU. The device-choice logic one GPU cannot exercise is
covered on the CPU by tests/unit/.
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


def two_seeds_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))


def cuda_tensors_through_gloo() -> dict:
    """Two ranks on one GPU with gloo: each starts from its own seed, so only sync_model (its
    CUDA buckets) can make rank 0 hold the average; the result comes back to the CPU."""
    torch.manual_seed(ed.get_rank())
    model = two_seeds_model().cuda()
    ed.sync_model(model)  # floating tensors averaged, integers broadcast
    return {"state": model.state_dict(), "big": torch.ones(2**20, device="cuda")}


def cpu_model_through_nccl() -> dict:
    """Two nccl ranks (two GPUs) with a model still on the CPU: sync_model stages it through
    each rank's GPU; the ranks start from different seeds."""
    torch.manual_seed(ed.get_rank())
    model = two_seeds_model()
    ed.sync_model(model)
    return {"state": model.state_dict(), "device": next(model.parameters()).device.type}


def averaged_state(seeds: list[int]) -> dict:
    """What sync_model must leave on every rank: the ranks' floating tensors averaged."""
    states = []
    for seed in seeds:
        torch.manual_seed(seed)
        states.append(two_seeds_model().state_dict())
    return {
        name: sum(s[name] for s in states) / len(states) if states[0][name].is_floating_point() else states[0][name]
        for name in states[0]
    }


def assert_averaged(state: dict, seeds: list[int]) -> None:
    expected = averaged_state(seeds)
    torch.manual_seed(0)
    rank0_alone = two_seeds_model().state_dict()
    for name, value in expected.items():
        assert state[name].device.type == "cpu", name
        assert torch.allclose(state[name], value, rtol=0, atol=1e-6), name
    # Without the sync, rank 0 would hold its own weights: far from the average.
    assert (state["0.weight"] - rank0_alone["0.weight"]).abs().max().item() > 1e-2


def init_flags(speed: bool, reproducible: bool) -> dict:
    ed.init_torch(seed=0, cuda_optimize_for_speed=speed, cuda_reproducible=reproducible, backend="gloo")
    return {
        "benchmark": torch.backends.cudnn.benchmark,
        "deterministic": torch.backends.cudnn.deterministic,
        "tf32": torch.backends.cuda.matmul.allow_tf32,
        "algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def train_reproducibly() -> dict:
    """Training whose result depends on the order of float atomics unless deterministic
    algorithms are on: index_add_ on CUDA with many collisions (and its backward, a gather)."""
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 30 * 30, 10)
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(16, 3, 32, 32, device="cuda")
    index = torch.randint(0, 4, (16 * 10,), device="cuda")  # 160 rows into 4: collisions
    for _ in range(5):
        optimizer.zero_grad()
        out = model(data).reshape(-1, 1).expand(-1, 64)
        pooled = torch.zeros(4, 64, device="cuda").index_add_(0, index, out * 1e3)
        pooled.pow(2).mean().backward()
        optimizer.step()
    return {
        "weights": torch.cat([p.detach().flatten() for p in model.parameters()]).cpu(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


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
    assert_averaged(result["state"], seeds=[0, 1])
    assert result["big"].device.type == "cpu" and result["big"].sum().item() == 2**20


@pytest.mark.skipif(GPUS < 2, reason="two nccl ranks need two GPUs (NCCL refuses two ranks on one)")
def test_two_nccl_ranks_stage_a_cpu_model_through_their_gpus():
    result = enot_nb.notebook_launcher(cpu_model_through_nccl, nprocs=2, backend="nccl")
    assert result["device"] == "cpu"
    assert_averaged(result["state"], seeds=[0, 1])


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
    assert runs[0]["deterministic"] and runs[1]["deterministic"]  # the flag reached the worker
    assert torch.equal(runs[0]["weights"], runs[1]["weights"])
    # For the record (not asserted: atomics may happen to agree): without the flag.
    free = [enot_nb.notebook_launcher(train_reproducibly, nprocs=1, backend="gloo", seed=0) for _ in range(2)]
    same = torch.equal(free[0]["weights"], free[1]["weights"])
    print(f"GPU-ROW index_add_ training without cuda_reproducible: equal twice = {same}")


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
    """One rank (two ranks need two GPUs: test_two_nccl_ranks_stage_a_cpu_model_through_their_gpus).
    sync_model does nothing in a world of one, so the staging itself is driven here: CPU tensors
    (one of them not contiguous) packed on cuda:0, reduced by nccl, and copied back."""
    from enot_nb._runtime import sync

    tensors = [torch.arange(6.0).reshape(2, 3).t(), torch.full((1000,), 3.0), torch.arange(4.0)]
    before = [t.clone() for t in tensors]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    sync._sync_group(tensors, sync._REDUCE)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() >= 4 * 1006  # the bucket went through the GPU
    for tensor, old in zip(tensors, before):
        assert tensor.device.type == "cpu" and torch.equal(tensor, old)  # a world of one: the same values
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))  # on the CPU
    ed.sync_model(model)
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
    import nbformat

    cells = [c for c in nbformat.read(tmp_path / "run.ipynb", as_version=4).cells if c.cell_type == "code"]
    assert not [o for c in cells for o in c.outputs if o.output_type == "error"]

    def text(cell) -> str:
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    training = next(c for c in cells if c.source.startswith("%%enot_distributed"))
    assert text(training).count("loss") == 6  # one line per epoch, from the master only
    assert any("image/png" in o.get("data", {}) for o in training.outputs)  # the loss curve
    evaluation = text(cells[-1])
    assert "well above chance: True" in evaluation and "loss went down: True" in evaluation


def test_a_module_a_cell_imported_that_initializes_cuda_is_not_kept_in_the_kernel(tmp_path):
    """Imports are kept across cells (preload), but never one that initializes CUDA in the
    kernel: the next fork would then be refused. The cell's module calls torch.cuda.init() at
    import; afterwards the kernel has not initialized CUDA, does not hold the module, and the
    next cell still forks."""
    (tmp_path / "enot_cuda_at_import.py").write_text("import torch\ntorch.cuda.init()\n")
    with running_kernel(f"%load_ext enot_nb\nimport sys, torch\nsys.path.insert(0, {str(tmp_path)!r})") as k:
        k.ok("%%enot_distributed -n 2 --backend gloo --start-method fork\nimport enot_cuda_at_import")
        after = k.ok(
            "from enot_nb._worker import preload\npreload.PRELOADER.wait()\n"
            "print(torch.cuda.is_initialized(), 'enot_cuda_at_import' in sys.modules)"
        )
        assert after.stdout == "False False\n"
        again = k.ok("%%enot_distributed -n 2 --backend gloo --start-method fork\nprint('forked')")
        assert again.stdout == "forked\n"


def test_a_model_sharded_by_fsdp2_on_cuda_comes_back_whole():
    """FSDP2 over nccl (a world of one: NCCL refuses two ranks on one GPU): the notebook's
    module comes back plain, on the CPU (the kernel never initializes CUDA), trained."""
    with running_kernel(
        "%load_ext enot_nb\nimport torch\ntorch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "w0, before = model[0].weight, model[0].weight.detach().clone()"
    ) as k:
        k.ok(
            "%%enot_distributed -n 1 --backend nccl\nfrom torch.distributed.fsdp import fully_shard\n"
            "model.cuda()\nfully_shard(model)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "model(torch.ones(3, 4, device='cuda')).sum().backward()\nopt.step()"
        )
        check = k.ok(
            "print(type(model) is torch.nn.Sequential, model[0].weight is w0, w0.device.type,"
            " bool((w0 != before).any()), torch.cuda.is_initialized())"
        )
        assert check.stdout == "True True cpu True False\n"


# ----------------------------------------------------------------------------- sessions


def nccl_session(ns: dict) -> enot_nb.Session:
    """A session of one nccl rank per GPU (NCCL refuses two ranks on one), mirroring into ``ns``."""
    return enot_nb.Session(nprocs=GPUS, backend="nccl", namespace=ns, quiet=True)


def test_a_nccl_session_binds_its_device_once_and_reuses_its_communicator():
    """One nccl rank per GPU (NCCL refuses two ranks on one): the device is bound at the start,
    and the world group (its communicator) is the same object cell after cell."""
    ns: dict = {}
    with nccl_session(ns) as s:
        s.run(
            "import torch, torch.distributed as dist\n"
            "device = torch.cuda.current_device()\ngroup = id(dist.distributed_c10d._get_default_group())\n"
            "t = torch.ones(4, device='cuda')\ndist.all_reduce(t)"
        )
        same = s.run(
            "dist.all_reduce(t)\n"
            "(torch.cuda.current_device() == device, id(dist.distributed_c10d._get_default_group()) == group)"
        )
        assert same == (True, True)
        assert ns["t"].device.type == "cpu" and ns["t"].tolist() == [float(GPUS**2)] * 4  # a CPU copy
        ns["t"][0] = 100.0  # a plain change: the rank's CUDA tensor is updated on its device
        assert s.run("(t.device.type, t[0].item())") == ("cuda", 100.0)
        rows = s.status().rows
        assert rows[0].device == "cuda:0" and rows[0].gpu_allocated_mib is not None


def test_two_gloo_ranks_on_one_gpu_keep_a_cuda_model_across_cells():
    ns = {"model": torch.nn.Linear(8, 8)}
    with enot_nb.Session(nprocs=2, backend="gloo", namespace=ns, quiet=True) as s:
        s.run("import torch\nmodel.cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)")
        s.run("model(torch.ones(2, 8, device='cuda')).sum().backward()\nopt.step()")
        assert ns["model"].weight.device.type == "cpu"  # mirrored as CPU copies
        assert s.run("next(model.parameters()).device.type") == "cuda"  # still on the GPU there


def test_a_restarted_session_puts_a_cuda_model_back_on_each_ranks_gpu():
    """A rank dies while the session's model and optimizer live on the GPU: the restart restores
    them from the notebook's CPU copies onto each rank's GPU, where they lived, and says so."""
    import signal

    ns = {"model": torch.nn.Linear(8, 8)}
    with enot_nb.Session(nprocs=2, backend="gloo", namespace=ns, quiet=True) as s:
        s.run("import torch\nmodel.cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)")
        s.run("model(torch.ones(2, 8, device='cuda')).sum().backward()\nopt.step()")
        os.kill(s.status().rows[1].pid, signal.SIGKILL)
        where = s.run("(next(model.parameters()).device.type, opt.state[model.weight]['momentum_buffer'].device.type)")
        assert where == ("cuda", "cuda")
        s.run("model(torch.ones(2, 8, device='cuda')).sum().backward()\nopt.step()")  # trains on, on the GPU


def test_a_cuda_out_of_memory_on_one_rank_fails_the_cell_and_the_session_goes_on():
    ns: dict = {}
    with enot_nb.Session(nprocs=2, backend="gloo", namespace=ns, quiet=True) as s:
        s.run("import torch, torch.distributed as dist\nx = torch.ones(4, device='cuda')")
        with pytest.raises(enot_nb.WorkerFailedError) as failed:
            s.run("if dist.get_rank() == 1:\n    big = torch.empty(1 << 50, device='cuda')\ny = x * 2")
        assert failed.value.rank == 1 and "OutOfMemoryError" in str(failed.value)
        assert s.run("float((x * 3).sum())") == 12.0


def test_a_nccl_session_trains_on_with_the_same_ddp_after_a_failed_cell():
    """nccl: a cell fails on the last rank mid-epoch; the repair moves ``ddp`` onto the ranks'
    group (made again where a collective was left half done) and the same wrapper trains on."""
    ns = {"model": torch.nn.Linear(8, 8)}
    with nccl_session(ns) as s:
        s.run(
            "import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
            "model.cuda()\nddp = DDP(model)\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1)\n"
            "def step():\n    opt.zero_grad()\n"
            "    ddp(torch.ones(2, 8, device='cuda')).sum().backward()\n    opt.step()\n"
        )
        s.run("step()")
        with pytest.raises(enot_nb.WorkerFailedError):
            s.run(f"step()\nif dist.get_rank() == {GPUS - 1}:\n    raise ValueError('mid-epoch')\nstep()")
        s.run("step()")  # the same ddp, on the group as it is now
        assert s.run("next(model.parameters()).device.type") == "cuda"


def test_a_nccl_ranks_collectives_are_recorded_and_its_replicas_checked_on_its_gpu():
    """nccl: the flight recorder names the rank's collectives (op, group, dtype and shape), which
    the collectives table reads; the replica check compares DDP's CUDA parameters and momentum
    where they live (checksums on the GPU, all-gathered over nccl), and with two GPUs names a
    weight the last rank moved."""
    ns: dict = {}
    with nccl_session(ns) as s:
        s.run(
            "import torch, torch.distributed as dist\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
            "from enot_nb._worker import collectives\n"
            "t = torch.ones(4, device='cuda')\ndist.all_reduce(t)\ntorch.cuda.synchronize()\n"
            "ddp = DDP(torch.nn.Linear(8, 8).cuda())\nopt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)\n"
            "ddp(torch.ones(2, 8, device='cuda')).sum().backward()\nopt.step()"
        )
        recorded = s.run("[(c.op, c.group, c.tensors) for c in collectives.snapshot().collectives]")
        assert any(op == "all_reduce" and group == "WORLD" and tensors for op, group, tensors in recorded), recorded
        report = s.check()
        assert report.agree and report.compared == 4, report
        if GPUS >= 2:
            s.run(f"if dist.get_rank() == {GPUS - 1}:\n    with torch.no_grad():\n        ddp.module.bias[0] += 0.25")
            drifted = s.check().drifted
            assert [(d.where, d.rank) for d in drifted] == [("ddp.module.bias", GPUS - 1)], drifted
            assert abs(drifted[0].max_abs_difference - 0.25) < 1e-6


@pytest.mark.skipif(GPUS < 2, reason="a mismatch needs two nccl ranks, and NCCL refuses two ranks on one GPU")
def test_a_nccl_mismatch_is_named_in_the_collectives_table_on_a_stop_press():
    with running_kernel("%load_ext enot_nb") as k:
        k.ok("%enot_session start -n 2 --backend nccl")
        k.ok(
            "%%enot_distributed\nimport torch, torch.distributed as dist\ndist.all_reduce(torch.ones(4, device='cuda'))"
        )
        pressed = []

        def press(run) -> None:
            if "ranks-in-place" in run.stdout and not pressed:
                pressed.append(True)
                time.sleep(3)  # both ranks are in their collectives by now
                k.manager.interrupt_kernel()

        run = k.run(
            "%%enot_distributed\nprint('ranks-in-place', flush=True)\n"
            "if dist.get_rank() == 0:\n    dist.broadcast(torch.ones(8, device='cuda'), 0)\n"
            "else:\n    dist.all_reduce(torch.ones(1024, device='cuda'))\ntorch.cuda.synchronize()",
            timeout=240,
            on_output=press,
        )
        assert pressed and "rank 1 waits in all_reduce #" in run.stderr, run.stderr
        assert "rank 0 is in broadcast #" in run.stderr


# ----------------------------------------------------------------------------- the Ray engine


def test_a_ray_session_gives_each_rank_the_gpu_ray_assigned_it(tmp_path):
    """A one-node Ray cluster on loopback with this machine's GPUs: ``--gpus-per-rank 1`` places
    one rank per GPU, nccl by default; each rank's device is the GPU Ray assigned its actor
    (``ray_context().gpu_ids``, as ``CUDA_VISIBLE_DEVICES`` shows it at ``LOCAL_RANK``)."""
    pytest.importorskip("ray", reason="the Ray engine's GPU case needs Ray: pip install -e '.[ray]'")
    from tests.kernel import Kernel
    from tests.ray_engine.loopback import ray_variables

    env = ray_variables(str(tmp_path))
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    head = subprocess.run(
        [
            ray_cli,
            "start",
            "--head",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={GPUS}",
            f"--num-gpus={GPUS}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    try:
        assert head.returncode == 0, head.stderr
        kernel = Kernel(extra_env=env)
        try:
            kernel.ok("%load_ext enot_nb")
            started = kernel.ok(f"%enot_session start -n {GPUS} --engine ray --address auto --gpus-per-rank 1", 400)
            assert f"{GPUS} rank(s), nccl" in started.stdout, started.stdout
            run = kernel.ok(
                "%%enot_distributed\nimport os, torch, torch.distributed as dist\n"
                "from enot_nb.distributed import ray_context\n"
                "t = torch.ones(1, device='cuda')\ndist.all_reduce(t)\n"
                "print(repr((torch.cuda.current_device(), os.environ['CUDA_VISIBLE_DEVICES'], "
                "ray_context().gpu_ids, t.item())))"
            )
            device, visible, assigned, total = eval(run.stdout.strip())
            assert visible.split(",")[device] == assigned[0] and total == float(GPUS)
            print(f"GPU-ROW Ray session: rank 0 on GPU {assigned[0]} (cuda:{device}), nccl all_reduce over {GPUS}")
            kernel.ok("%enot_session stop")
        finally:
            kernel.shutdown()
    finally:
        subprocess.run([ray_cli, "stop"], env={**os.environ, **env}, timeout=240)
