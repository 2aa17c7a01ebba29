"""Launch options, defined once (_launch/options.py), their errors and the magic's words."""

from __future__ import annotations

import inspect
import pickle
import re

import pytest

import enot_nb
from enot_nb._launch.options import LaunchOptions
from enot_nb.errors import LaunchConfigError, WorkerFailedError, WorkerFailure


def test_launch_options_are_one_definition_for_every_front():
    fields = set(LaunchOptions.names())
    launcher = set(inspect.signature(enot_nb.notebook_launcher).parameters)
    assert fields <= launcher
    export = set(inspect.signature(enot_nb.export_cell).parameters)
    # An export runs nothing here: where and how torchrun starts it is torchrun's to say, and
    # torchrun watches it (no hang watch).
    assert fields - {"start_method", "node_rank", "max_restarts", "hang_after"} <= export
    from enot_nb.magic import EnotMagics

    parser = EnotMagics.enot_distributed.parser
    dests = {action.dest for action in parser._actions}
    renamed = {"cuda_optimize_for_speed": "speed", "cuda_reproducible": "reproducible"}
    assert {renamed.get(name, name) for name in fields} <= dests
    flags = {s for action in parser._actions for s in action.option_strings}
    assert set(LaunchOptions.FLAGS.values()) <= flags


@pytest.mark.parametrize(
    "options, parameter",
    [
        ({"nprocs": 0}, "nprocs"),
        ({"timeout": float("nan")}, "timeout"),
        ({"seed": 2**40}, "seed"),
        ({"cuda_optimize_for_speed": True, "cuda_reproducible": True}, "cuda_reproducible"),
        ({"nnodes": 2}, "master_port"),
        ({"output": "loud"}, "output"),
    ],
)
def test_bad_options_name_their_parameter(options, parameter):
    with pytest.raises(LaunchConfigError) as caught:
        LaunchOptions(**options)
    assert caught.value.parameter == parameter


def test_errors_survive_a_pickle_round_trip():
    failure = WorkerFailure(rank=1, exitcode=-9, signal_name="SIGKILL", error_type=None, message="", traceback=None)
    err = pickle.loads(pickle.dumps(WorkerFailedError([failure])))
    assert err.rank == 1 and err.signal_name == "SIGKILL" and "SIGKILL" in str(err)
    config = pickle.loads(pickle.dumps(LaunchConfigError("bad", parameter="seed")))
    assert config.parameter == "seed" and str(config) == "bad"


@pytest.mark.parametrize(
    "nprocs, gpus, backend",
    [(2, 0, "gloo"), (2, 1, "gloo"), (2, 2, "nccl"), (1, 8, "nccl"), (8, 8, "nccl"), (9, 8, "gloo")],
)
def test_default_backend(nprocs, gpus, backend):
    from enot_nb._runtime.devices import default_backend

    assert default_backend(nprocs, gpus) == backend


def test_device_for_a_local_rank():
    from enot_nb._runtime.devices import device_for

    assert [device_for(rank, 4) for rank in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="only 2 GPU"):
        device_for(2, 2)
    with pytest.raises(ValueError, match="no GPU is available"):
        device_for(0, 0)


@pytest.mark.parametrize(
    "line, words",
    [
        ("", "pass -n N (for example -n 2, --backend gloo)"),  # no GPU here: -n has no default
        ("-n 2 --timeout -3", "--timeout -3.0 must be positive and finite"),
        ("-n 2 --speed --reproducible", "--speed and --reproducible are mutually exclusive"),
    ],
)
def test_magic_errors_speak_the_magics_words(line, words):
    """A launcher message shown for the magic names the flags the user typed, never the
    launcher's keyword arguments."""
    from IPython.core.error import UsageError

    from enot_nb.launcher import LaunchOptions
    from enot_nb.magic import parse_options

    with pytest.raises(UsageError) as info:
        parse_options(line)
    assert words in str(info.value)
    assert not any(f"{name}=" in str(info.value) for name in LaunchOptions.FLAGS), str(info.value)


def test_only_options_are_put_in_the_magics_words():
    from enot_nb.magic import in_magic_words

    assert in_magic_words("/home/me/output/seed_3/nprocs/train.py is a link") == (
        "/home/me/output/seed_3/nprocs/train.py is a link"
    )
    assert in_magic_words("the backend is not available; use a seed") == "the backend is not available; use a seed"
    assert in_magic_words("seed='abc def' and nprocs=2") == "--seed 'abc def' and -n 2"
    assert in_magic_words("cuda_reproducible=False") == "no --reproducible"


@pytest.mark.parametrize(
    "options, parameter, words",
    [
        ({"engine": "slurm"}, "engine", "not one of 'local' or 'ray'"),
        ({"engine": "ray", "address": "ray://head:10001"}, "address", "Ray Client (ray://) is not supported"),
        ({"gpus_per_rank": 1}, "engine", "add engine='ray'"),
        ({"engine": "ray", "placement": "strict"}, "placement", "'pack' or 'spread'"),
        ({"engine": "ray", "gpus_per_rank": -1}, "gpus_per_rank", ">= 0"),
    ],
)
def test_bad_engine_options_name_their_parameter(options, parameter, words):
    from enot_nb._launch.options import EngineOptions

    with pytest.raises(LaunchConfigError, match=re.escape(words)) as caught:
        EngineOptions(**options)
    assert caught.value.parameter == parameter


def test_engine_options_are_one_definition_for_the_session_and_its_magic():
    from enot_nb._launch.options import EngineOptions
    from enot_nb.magic import EnotMagics

    parser = EnotMagics.enot_session.parser
    assert set(EngineOptions.names()) <= {action.dest for action in parser._actions}
    assert set(EngineOptions.FLAGS.values()) <= {s for action in parser._actions for s in action.option_strings}
    assert set(EngineOptions.names()) <= set(inspect.signature(enot_nb.Session).parameters)
