"""enot_nb.distributed in one process: single-process answers, bad inputs, init_torch flags."""

from __future__ import annotations

import datetime
import random

import numpy as np
import pytest
import torch

from enot_nb import distributed as ed
from enot_nb.errors import DistributedRuntimeException
from tests._util import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def no_launch_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("world_size", [None, "1"])
def test_single_process_answers(monkeypatch, world_size):
    if world_size:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    ed.init_torch(backend="nccl")  # nothing to initialize, so even nccl without a GPU is fine
    assert not torch.distributed.is_initialized()
    assert (ed.get_world_size(), ed.get_rank(), ed.get_local_rank()) == (1, 0, 0)
    assert ed.is_master() and ed.is_local_master() and not ed.is_dist()
    with ed.master_first():
        pass
    model = torch.nn.Linear(2, 2)
    before = model.weight.clone()
    ed.sync_model(model)
    assert torch.equal(model.weight, before)


def test_master_only_keeps_name_and_doc():
    def log(x):
        """Write x."""
        return x * 2

    wrapped = ed.master_only(log)
    assert (wrapped.__name__, wrapped.__doc__) == ("log", "Write x.")
    assert wrapped(4) == 8


@pytest.mark.parametrize(
    "env, words",
    [
        ({"WORLD_SIZE": "2"}, ["LOCAL_RANK", "not set", "torchrun"]),
        ({"WORLD_SIZE": "two"}, ["WORLD_SIZE", "'two'", "not an integer"]),
        ({"WORLD_SIZE": "0"}, ["WORLD_SIZE=0", "out of range"]),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "x"}, ["LOCAL_RANK", "'x'"]),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, ["LOCAL_RANK=-1", "out of range"]),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "2"}, ["LOCAL_RANK=2", "[0, 2)"]),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "RANK": "5"}, ["RANK=5", "[0, 2)"]),
    ],
)
def test_bad_environment_is_named(monkeypatch, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedRuntimeException) as info:
        ed.init_process_group(backend="gloo")
    for word in words:
        assert word in str(info.value)
    assert "set WORLD_SIZE, RANK and LOCAL_RANK" in str(info.value)


def test_rank_defaults_to_local_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert (ed.get_rank(), ed.get_local_rank(), ed.get_world_size()) == (1, 1, 2)
    assert not ed.is_master() and not ed.is_local_master()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_nccl_without_cuda_says_use_gloo(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DistributedRuntimeException, match="backend='gloo'"):
        ed.init_process_group()


def test_refused_connection_is_chained(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    with pytest.raises(DistributedRuntimeException, match="rank 1.*MASTER_PORT") as info:
        ed.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    assert info.value.__cause__ is not None
    assert not torch.distributed.is_initialized()


def test_unknown_backend_is_chained(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(DistributedRuntimeException, match="no_such_backend") as info:
        ed.init_process_group(backend="no_such_backend", timeout=datetime.timedelta(seconds=2))
    assert info.value.__cause__ is not None


def test_both_cuda_flags_raise_before_seeding():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    with pytest.raises(RuntimeError, match="mutually exclusive"):
        ed.init_torch(seed=7, cuda_optimize_for_speed=True, cuda_reproducible=True)
    assert random.random() == expected  # the seed was not applied


def test_seed_seeds_python_numpy_and_torch():
    ed.init_torch(seed=11)
    first = (random.random(), float(np.random.rand()), torch.rand(1).item())
    ed.init_torch(seed=11)
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == first


@pytest.fixture
def restore_cuda_flags(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.are_deterministic_algorithms_enabled(),
    )
    yield
    (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    ) = saved[:4]
    torch.use_deterministic_algorithms(saved[4])


def test_speed_flags(restore_cuda_flags):
    ed.init_torch(cuda_optimize_for_speed=True)
    assert torch.backends.cudnn.benchmark and torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cudnn.allow_tf32


def test_reproducible_flags(restore_cuda_flags):
    import os

    ed.init_torch(cuda_reproducible=True)
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
