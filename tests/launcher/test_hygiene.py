"""Process hygiene and security: never signal a stranger, never leave a process, never leak.

Each test runs a plain Python launcher (tests/helpers/hygiene.py) in a subprocess, injects the
fault, and reads what it saw; figures go to RELIABILITY.md (ENOT_NB_RELIABILITY_FIGURES).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests._util import METHODS, free_port, record_figure, wait_gone
from tests.kernel import ROOT

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(120), pytest.mark.slow]


def helper(*args: str, stdin: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.hygiene", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=stdin,
        text=True,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )


def lines_of(proc: subprocess.Popen, timeout: float = 90) -> dict[str, list[str]]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out + err
    seen: dict[str, list[str]] = {}
    for line in out.splitlines():
        word, _, rest = line.partition(" ")
        seen.setdefault(word, []).append(rest)
    return seen


# ----------------------------------------------------------------------------- 1. pid reuse


def _take_pid(pid: int) -> subprocess.Popen | None:
    """Start an unrelated `sleep` with exactly ``pid`` (root: /proc/sys/kernel/ns_last_pid)."""
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        stranger = subprocess.Popen(["sleep", "30"])
        if stranger.pid == pid:
            return stranger
        stranger.kill()
        stranger.wait()
    return None


@pytest.mark.skipif(
    not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK),
    reason="choosing the next pid needs root (/proc/sys/kernel/ns_last_pid)",
)
def test_a_reused_pid_is_never_signalled(start_method, tmp_path):
    flag = tmp_path / "go"
    proc = helper("pid_reuse", start_method, str(flag))
    pid = None
    while pid is None:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if "rank 1 pid" in line:
            pid = int(line.split()[-1])
    wait_gone([pid], reaped=True)  # rank 1 is reaped (the test's timeout says if never)
    stranger = _take_pid(pid)
    assert stranger is not None, "could not start a process with the freed pid"
    try:
        flag.touch()  # rank 0 fails now: the launcher stops and closes everything
        assert "failed" in lines_of(proc)
        time.sleep(0.2)
        assert stranger.poll() is None, f"the stranger that took pid {pid} was signalled"
    finally:
        stranger.kill()
        stranger.wait()


# ----------------------------------------------------------------------------- 2. interrupts at start


STEPS = {
    "fork": ["before_forks", "between_forks", "after_forks"],
    "spawn": ["server_starting", "before_launch", "launch_sent", "started"],
}


@pytest.mark.parametrize("method, step", [(m, s) for m in METHODS for s in STEPS[m]])
def test_an_interrupt_at_each_step_of_a_start_leaves_nothing(method, step):
    seen = lines_of(helper("interrupt_at", method, step))
    assert "interrupted" in seen, seen
    assert json.loads(seen["left"][0]) == []
    result, seconds = seen["next"][0].split()
    assert result == "41"  # the fork server is idle and usable
    record_figure(f"interrupt_at_{method}_{step}_next_launch_s", float(seconds))


@pytest.mark.timeout(1200)  # a hang fails after 30 s in the helper; 1200 s is for --soak
def test_a_stop_press_before_any_line_of_the_launcher_leaves_nothing(start_method, request):
    """The random sweep below found, once in many CI runs, a press between two steps that the
    interrupt's own cleanup then tripped over. This one is systematic: a press (KeyboardInterrupt
    from a line tracer) before the k-th line of enot_nb the launching thread runs, for every
    k with --soak, for every 10th otherwise."""
    stride = "1" if request.config.getoption("--soak") else "10"
    seen = lines_of(helper("press_before_every_line", start_method, stride), timeout=1150)
    assert int(seen["lines"][0]) > 500
    assert "bad" not in seen, "\n".join(seen["bad"])
    assert int(seen["pressed"][0]) > int(seen["lines"][0]) // int(stride) // 2
    assert seen["next"] == [str(float(2**19))]


def test_interrupts_at_random_moments_leave_nothing(start_method):
    tries = 8
    proc = helper("interrupt_sweep", start_method, str(tries), stdin=subprocess.PIPE)
    rng = random.Random(12)
    interrupted = 0
    for _ in range(tries):
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(rng.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGINT)
        outcome = proc.stdout.readline().strip()
        interrupted += outcome == "interrupted"
        left = proc.stdout.readline().strip()
        if left != "left []":
            proc.kill()
            _, err = proc.communicate()
            raise AssertionError(f"after {outcome!r}: {left!r}\n{err[-4000:]}")
    assert proc.stdout.readline().strip() == "ready"
    proc.stdin.write("go\n")
    proc.stdin.flush()
    seen = lines_of(proc)
    assert seen["next"] == ["41"]
    assert interrupted >= 1


# ----------------------------------------------------------------------------- 3. descendants


def _launch_folders() -> set[Path]:
    folder = Path(tempfile.gettempdir())
    return set(folder.glob("enot_nb-rendezvous-*")) | set(folder.glob("pymp-enot_nb-*"))


def test_sigkill_of_the_launcher_takes_grandchildren_and_rendezvous_down(start_method):
    before = _launch_folders()
    proc = helper("descendants_then_block", start_method)
    trees = []
    while len(trees) < 2:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if "tree " in line:
            trees.append([int(p) for p in line.split("tree ")[1].split()])
    pids = [p for tree in trees for p in tree]
    proc.kill()
    proc.communicate(timeout=10)
    took = wait_gone(pids)
    record_figure(f"launcher_sigkill_tree_gone_{start_method}_s", took)
    # The watchdog removes the launch folders once the launcher is gone: waited for until they
    # are (the test's timeout says if never)
    while _launch_folders() - before:
        time.sleep(0.02)


# ----------------------------------------------------------------------------- 4, 5. resources


def assert_one_clear_error_and_nothing_left(seen: dict[str, list[str]], *words: str) -> list[int]:
    """The scenario raised one LaunchError with ``words``, leaked no fd, left no process, and
    the next launch worked; returns the fd counts before and after."""
    error = json.loads(seen["error"][0])
    assert all(word in error for word in words), error
    before, after = map(int, seen["fds"][0].split())
    assert after == before
    assert json.loads(seen["left"][0]) == []
    assert seen["next"] == ["41"]
    return [before, after]


def test_too_few_file_descriptors_is_one_clear_error_and_leaks_nothing(start_method):
    seen = lines_of(helper("fd_limit", start_method))
    fds = assert_one_clear_error_and_nothing_left(seen, "too many open files", "ulimit -n")
    record_figure(f"fd_limit_fds_{start_method}", fds)


def test_a_fork_that_fails_part_way_is_one_clear_error_and_leaves_nothing():
    seen = lines_of(helper("fork_fails", "fork"))  # the second of three forks fails (EAGAIN)
    assert_one_clear_error_and_nothing_left(seen, "RLIMIT_NPROC", "rank 1")


def test_a_fork_server_fork_that_fails_part_way(monkeypatch):
    monkeypatch.setenv("ENOT_NB_TEST_FORK_FAIL_AT", "2")  # the third of three forks fails
    seen = lines_of(helper("fork_fails", "spawn"))
    assert_one_clear_error_and_nothing_left(seen, "RLIMIT_NPROC")


def test_a_launch_whose_watchdog_cannot_start_leaves_nothing(start_method):
    seen = lines_of(helper("watchdog_fails", start_method))
    assert json.loads(seen["folders"][0]) == []  # the rendezvous folder was made, then removed
    assert_one_clear_error_and_nothing_left(seen, "the launch could not start", "RLIMIT_NPROC")


# ----------------------------------------------------------------------------- 6. binding


def _is_loopback(hex_address: str) -> bool:
    if len(hex_address) == 8:  # IPv4, little-endian
        return hex_address.endswith("7F")
    return (
        hex_address in ("00000000000000000000000001000000",)
        or hex_address.startswith("0000000000000000FFFF0000")
        and hex_address.endswith("7F")
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("port", ["none", "explicit"])
def test_one_node_listens_and_talks_on_loopback_only(method, port):
    seen = lines_of(helper("sockets", method, str(free_port()) if port == "explicit" else "none"))
    found = json.loads(seen["sockets"][0])
    assert found["mine"], "the worker has no TCP socket at all?"
    assert all(_is_loopback(a) for a in found["mine"]), found
    if port == "explicit":
        assert found["listening"] and all(_is_loopback(a) for a in found["listening"]), found


# ----------------------------------------------------------------------------- 7, 8. many things


def test_three_hundred_tensors_reach_spawned_workers():
    total, expected = map(float, lines_of(helper("many_tensors", "spawn"))["total"][0].split())
    assert total == expected


def test_kept_results_hold_no_file_descriptor(start_method):
    before, after, kept, total = lines_of(helper("kept_results", start_method))["fds"][0].split()
    n = 2**18  # each kept result is rank 0's arange(n) * 3 + 1, summed exactly in float64
    assert int(kept) == 50 and float(total) == 50 * (3 * n * (n - 1) // 2 + n)
    assert int(after) - int(before) <= 2, (before, after)
    record_figure(f"kept_results_fds_{start_method}", [int(before), int(after)])


# ----------------------------------------------------------------------------- 9. bad inputs


def _launch(**options):
    import enot_nb
    from tests.helpers import jobs

    return enot_nb.notebook_launcher(jobs.describe, **({"nprocs": 2, "backend": "gloo"} | options))


@pytest.mark.parametrize(
    "options, words",
    [
        ({"timeout": float("nan")}, "timeout=nan must be positive and finite"),
        ({"timeout": float("inf")}, "timeout=inf must be positive and finite"),
        ({"timeout": 1e20}, "timeout=1e+20 must be positive and finite"),
        ({"master_addr": "no-such-host.invalid"}, "master_addr='no-such-host.invalid' cannot be resolved"),
        ({"master_addr": None}, "master_addr=None must be a host name or an IP address"),
        ({"backend": "foo"}, "backend='foo' is not available in this PyTorch build"),
        ({"seed": 2**70}, "must be below 2**32"),
    ],
)
def test_bad_launch_inputs_fail_before_anything_starts(options, words):
    from enot_nb.launcher import LaunchConfigError

    forks, folders = _FORKS[0], _launch_folders()
    with pytest.raises(LaunchConfigError) as caught:
        _launch(**options)
    assert words in str(caught.value)
    assert _FORKS[0] == forks and _launch_folders() == folders  # nothing was started


_FORKS = [0]
"""Forks this test process made (its launches start their workers by fork here)."""
os.register_at_fork(before=lambda: _FORKS.__setitem__(0, _FORKS[0] + 1))


def test_accelerates_positional_nprocs_is_named():
    import enot_nb
    from enot_nb.launcher import LaunchConfigError
    from tests.helpers import jobs

    with pytest.raises(LaunchConfigError, match=r"args=2 must be a tuple.*pass nprocs=2"):
        enot_nb.notebook_launcher(jobs.describe, 2)


def test_a_bad_seed_seeds_nothing():
    import random

    import numpy
    import torch

    from enot_nb.distributed import init_torch
    from enot_nb.errors import LaunchConfigError

    states = (random.getstate(), numpy.random.get_state()[1].tolist(), torch.random.get_rng_state())
    for seed in ("abc", 2**70, -1, 1.5):
        with pytest.raises(LaunchConfigError, match="seed=") as caught:
            init_torch(seed=seed, backend="gloo")
        assert caught.value.parameter == "seed"
    assert random.getstate() == states[0]
    assert numpy.random.get_state()[1].tolist() == states[1]
    assert torch.equal(torch.random.get_rng_state(), states[2])


@pytest.fixture(scope="module")
def kernel():
    from tests.kernel import running_kernel

    with running_kernel("%load_ext enot_nb\nimport torch\nmodel = torch.nn.Linear(2, 2)\nlr = 0.1") as k:
        yield k


@pytest.mark.parametrize(
    "line, words",
    [
        ("-n 2 --timeout nan", "--timeout nan must be positive"),
        ("-n 2 --timeout 1e20", "--timeout 1e+20"),
        ("-n 2 --backend glo", "--backend glo is not available"),
        ("-n 2 --backend gloo --sync modle", "--sync modle: the notebook has no variable 'modle'"),
        ("-n 2 --backend gloo --sync lr", "--sync lr: 'lr' is a float, not a torch.nn.Module"),
        ("-n -3 --export run/x.py", "-n -3 must be an integer >= 1"),
        ("--nnodes 0 --export run/x.py", "--nnodes 0 must be an integer >= 1"),
        ("-n 2 --seed 99999999999 --export run/x.py", "below 2**32"),
    ],
)
def test_bad_magic_inputs_are_usage_errors_before_anything_starts(kernel, line, words, tmp_path):
    run = kernel.run(f"%%enot_distributed {line.replace('run/', str(tmp_path) + '/')}\nx = 1")
    assert run.status == "error" and run.stderr.startswith("UsageError: "), run.stderr
    assert words in run.stderr and "Traceback" not in run.stderr
    assert not list(tmp_path.iterdir())  # no export written


# ----------------------------------------------------------------------------- 10. links


@pytest.mark.parametrize("planted", ["train.namespace.pkl", "train.py", "train.results.pkl"])
def test_export_refuses_to_write_through_a_link(tmp_path, planted):
    import enot_nb

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / planted).symlink_to(victim)
    with pytest.raises(ValueError, match="is a symbolic link"):
        enot_nb.export_cell("y = 1", run / "train.py", {"x": 1}, nprocs=2, backend="gloo")
    assert victim.read_text() == "precious"
    assert sorted(p.name for p in run.iterdir()) == [planted]
