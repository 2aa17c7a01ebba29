"""notebook_launcher with real processes in plain Python (the kernel tests are in test_kernel.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import enot_nb
from enot_nb import WorkerFailedError
from enot_nb.errors import LaunchError
from tests._util import (
    HELPERS,
    METHODS,
    alive,
    clean_env,
    descendants,
    free_port,
    needs_fsdp2,
    record_figure,
    wait_gone,
)
from tests.helpers import jobs

pytestmark = pytest.mark.timeout(60)


def launch(fn, *args, nprocs=2, **options):
    options.setdefault("backend", "gloo")
    return enot_nb.notebook_launcher(fn, args=args, nprocs=nprocs, **options)


@pytest.mark.parametrize("method", METHODS)
def test_result_comes_back(method):
    assert launch(jobs.rank_sum, 10, start_method=method) == {"sum": 30.0, "rank": 0, "world": 2}


@pytest.mark.parametrize("method", METHODS)
def test_worker_environment_and_threads(method):
    before = dict(os.environ)
    torch.set_num_threads(1)  # user code in the caller must not shrink the workers' share
    try:
        info = launch(jobs.describe, nprocs=1, start_method=method)
    finally:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    assert dict(os.environ) == before  # the caller's environment is untouched
    assert info["WORLD_SIZE"] == "1" and info["RANK"] == "0" and info["LOCAL_RANK"] == "0"
    assert info["LOCAL_WORLD_SIZE"] == "1" and info["NODE_RANK"] == "0"
    assert info["MASTER_ADDR"] == "127.0.0.1" and int(info["MASTER_PORT"]) > 0
    assert info["TORCHELASTIC_RESTART_COUNT"] == "0"
    cores = len(os.sched_getaffinity(0))
    assert info["threads"] == cores and info["OMP_NUM_THREADS"] == str(cores)
    assert info["pgid"] == info["pid"]  # own process group: the launcher can stop the tree


def test_threads_are_shared_between_workers():
    info = launch(jobs.describe, nprocs=2)
    assert info["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)


def test_user_omp_num_threads_is_respected(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert launch(jobs.describe, nprocs=1)["threads"] == 1


def test_fork_after_openmp_use_in_caller_does_not_hang():
    torch.set_num_threads(2)
    a = torch.randn(300, 300)
    _ = a @ a  # starts libgomp's thread pool in this process (the trap)
    assert launch(jobs.parallel_matmul, nprocs=1, start_method="fork") == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("method", METHODS)
def test_only_rank_0_prints_by_default(method, capfd):
    launch(jobs.chatty, start_method=method)
    out, err = capfd.readouterr()
    assert "python line from 0" in out and "C-level line from 0" in out
    assert "progress 1/2\rprogress 2/2\n" in out  # \r progress bars intact
    assert "from 1" not in out + err
    assert "stderr from 0" in err


def test_output_all_prefixes_every_rank(capfd):
    launch(jobs.chatty, output="all")
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] python line from {rank}\n" in out
        assert f"[rank {rank}] C-level line from {rank}\n" in out
        assert f"[rank {rank}] stderr from {rank}\n" in err
    # with several ranks on the screen, each redraw after "\r" starts a line of its own rank
    assert "[rank 1] progress 1/2\n[rank 1] progress 2/2\n" in out  # a redraw: a line of its own


def test_output_none_shows_nothing(capfd):
    launch(jobs.chatty, output="none")
    out, err = capfd.readouterr()
    assert "line from" not in out + err


@pytest.mark.parametrize("method", METHODS)
def test_raise_on_rank_1_while_rank_0_waits_in_barrier(method):
    """The error names the failing rank and shows its own frames (that the launcher stops the
    others is test_other_ranks_are_stopped_by_the_launcher_after_a_failure: here gloo's peer-loss
    detection may end rank 0 first; a hang is caught by the test's timeout)."""
    with pytest.raises(WorkerFailedError) as info:
        launch(jobs.raise_on, 1, start_method=method)
    err = info.value
    assert err.rank == 1 and err.exitcode == 1 and err.signal_name is None
    assert "ValueError: boom on rank 1" in err.traceback
    assert 'raise ValueError(f"{message} on rank {rank}")' in err.traceback  # the worker's source
    assert "enot_nb/_worker/" not in err.traceback
    assert "rank 1 raised ValueError" in str(err)
    rendered = "\n".join(err._render_traceback_())
    assert "boom on rank 1" in rendered and "Root Cause" in rendered


@pytest.mark.parametrize("method", METHODS)
def test_os_exit_of_a_worker(method):
    with pytest.raises(WorkerFailedError) as info:
        launch(jobs.exit_on, 1, 7, start_method=method)
    assert (info.value.rank, info.value.exitcode, info.value.signal_name) == (1, 7, None)
    assert "exited with code 7" in str(info.value)


def test_sys_exit_in_a_worker():
    with pytest.raises(WorkerFailedError) as info:
        launch(jobs.sys_exit_on, 0, 3)
    assert (info.value.rank, info.value.exitcode) == (0, 3)
    assert "sys.exit(3)" in str(info.value)


@pytest.mark.parametrize("signum, words", [(signal.SIGKILL, "out-of-memory"), (signal.SIGSEGV, "native code")])
@pytest.mark.parametrize("method", METHODS)
def test_worker_killed_by_signal(method, signum, words):
    with pytest.raises(WorkerFailedError) as info:
        launch(jobs.kill_self_on, 1, signum, start_method=method)
    err = info.value
    assert (err.rank, err.exitcode, err.signal_name) == (1, -signum, signum.name)
    assert words in str(err)


@pytest.mark.parametrize("method", METHODS)
def test_a_sigkill_names_the_oom_killer_only_where_the_kernel_counted_one(method):
    """The worker kills itself: no OOM kill is counted in this cgroup, so the error says who
    else sends SIGKILL; where no cgroup counter is readable, it points at the kernel log."""
    from enot_nb._processes.oom import oom_kills

    readable = oom_kills() is not None
    with pytest.raises(WorkerFailedError) as info:
        launch(jobs.kill_self_on, 1, signal.SIGKILL, start_method=method)
    text = str(info.value)
    if readable:
        assert "not the out-of-memory killer (the kernel counted none in this cgroup)" in text
        assert "a person, a scheduler" in text
    else:
        assert "if the kernel log says so" in text


def test_children_of_a_failed_worker_are_stopped(capfd):
    with pytest.raises(WorkerFailedError, match="failing with children"):
        launch(jobs.with_dataloader_children, output="all")
    out, _ = capfd.readouterr()
    pids = [int(p) for line in re.findall(r"children \[(.*)\]", out) for p in line.split(",")]
    assert len(pids) == 4
    # Orphans are adopted by init and would escape conftest's check of our descendants.
    wait_gone(pids)  # the test's timeout says if one outlives the launcher


def test_restarts_see_their_attempt_number():
    assert launch(jobs.fail_first_attempt, max_restarts=2) == 1


def test_restarts_exhausted_list_every_root_cause():
    with pytest.raises(WorkerFailedError) as info:
        launch(jobs.always_fail, max_restarts=1)
    assert [f.attempt for f in info.value.attempts] == [0, 1]
    assert "attempt 1 fails" in info.value.traceback
    assert "attempt 0 fails" in str(info.value) and "attempt 1 fails" in str(info.value)


def test_large_result_arrives_intact():
    result = launch(jobs.big_result, 200)  # 200 MB through the pipe
    assert torch.equal(result, torch.arange(200 * 2**18, dtype=torch.float32))


def test_nested_launch_is_a_clear_error():
    with pytest.raises(WorkerFailedError) as info:
        launch(jobs.nested_launch, nprocs=1)
    assert info.value.failures[0].error_type == "LaunchError"
    assert "do not nest" in str(info.value)


def test_concurrent_launch_from_another_thread_is_refused():
    started_r, started_w = os.pipe()
    release_r, release_w = os.pipe()
    results = []
    thread = threading.Thread(target=lambda: results.append(launch(jobs.wait_for_release, started_w, release_r)))
    thread.start()
    try:
        assert os.read(started_r, 1) == b"s"
        with pytest.raises(LaunchError, match="another enot_nb launch is running"):
            launch(jobs.describe, nprocs=1)
    finally:
        os.write(release_w, b"r")
        thread.join()
        for fd in (started_r, started_w, release_r, release_w):
            os.close(fd)
    assert results == ["released"]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_ten_launches_leave_no_process_fd_or_port():
    launch(jobs.describe)  # warm-up: the clean thread and lazy imports
    fds = open_fds()
    ports = [int(launch(jobs.describe)["MASTER_PORT"]) for _ in range(10)]
    assert open_fds() == fds
    assert len(set(ports)) > 1  # a fresh port per launch
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0  # nobody listens there any more


def test_relaunch_right_after_failure_works():
    with pytest.raises(WorkerFailedError):
        launch(jobs.raise_on, 0)
    assert launch(jobs.rank_sum, 1)["sum"] == 3.0


@pytest.mark.timeout(60)
def test_a_rank_leaves_without_destroying_its_process_group():
    """A finished rank leaves by os._exit, not through destroy_process_group, which torch
    2.3.1's gloo could block in for good once a peer had left (one launch in about ten)."""
    assert launch(jobs.rank_sum_undestroyable, 1)["sum"] == 3.0


# ------------------------------------------------------------------- bad input, before any start


@pytest.mark.parametrize(
    "options, words",
    [
        ({"nprocs": 0}, "nprocs=0 must be an integer >= 1"),
        ({"nprocs": "2"}, "nprocs='2'"),
        ({"nprocs": True}, "nprocs=True"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 29500}, "node_rank=2 is out of range"),
        ({"node_rank": -1}, "node_rank=-1"),
        ({"backend": "nccl"}, "backend='nccl' needs one GPU per process"),
        ({"output": "loud"}, "output='loud'"),
        ({"start_method": "forkserver"}, "start_method='forkserver'"),
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"nnodes": 2}, "needs master_port"),
        ({"timeout": 0}, "must be positive"),
    ],
)
def test_bad_arguments_fail_fast(options, words):
    options = {"nprocs": 2, "backend": "gloo"} | options
    with pytest.raises(ValueError, match=re.escape(words)):
        enot_nb.notebook_launcher(jobs.describe, **options)


def test_both_cuda_flags_fail_fast():
    with pytest.raises(RuntimeError, match="mutually exclusive"):
        launch(jobs.describe, cuda_optimize_for_speed=True, cuda_reproducible=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU default")
def test_nprocs_default_without_gpu_asks_for_nprocs():
    with pytest.raises(ValueError, match="pass nprocs=N"):
        enot_nb.notebook_launcher(jobs.describe)


def test_unpicklable_argument_is_named_under_spawn():
    with pytest.raises(ValueError, match=r"args\[1\]: lock cannot be pickled"):
        launch(jobs.rank_sum, 1, threading.Lock(), start_method="spawn")


def test_large_tensors_reach_spawned_workers_through_shared_memory():
    big = torch.arange(2 * 2**20, dtype=torch.int64)  # 16 MB; integer sums are exact
    small = torch.ones(3)
    info = launch(jobs.inspect_tensors, big, small, start_method="spawn")
    assert info["sums"] == [float(big.sum()), 3.0]
    assert info["big_in_shared_memory"] and not info["small_in_shared_memory"]
    assert info["writable_copy_on_write"]
    assert big[0].item() == 0  # a worker's write never reaches the caller's tensor


def test_busy_master_port_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"master_port={port} on 127.0.0.1 is busy"):
            launch(jobs.describe, master_port=port)


# ------------------------------------------------------------------- the launching process


def start_script(method: str, *extra: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen(
        [sys.executable, str(HELPERS / "launch_script.py"), method, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": os.getcwd()},
    )
    pids = []
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if "pid " in line and "launcher" not in line:
            pids.append(int(line.split("pid ")[1]))
    return proc, pids


def gone(pid: int) -> bool:
    return not alive(pid)


@pytest.mark.parametrize("method", METHODS)
def test_sigint_to_the_launcher_shows_stacks_and_stops_everything(method):
    proc, pids = start_script(method)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    record_figure("interrupt_to_exit_plain_s", time.monotonic() - start)
    assert "KeyboardInterrupt" in err
    assert "where each of the 2 running rank(s) is" in err
    assert "[rank 0]" in err and "[rank 1]" in err and "in block" in err  # faulthandler stacks
    wait_gone(pids)


@pytest.mark.parametrize("method", METHODS)
def test_the_stack_dump_and_interrupt_reach_the_ranks_not_their_dataloader_workers(method):
    """SIGUSR1 (the stack dump) and SIGINT go to a rank by its pidfd, not to its process group:
    its DataLoader workers neither dump their stacks into its report nor get interrupted."""
    proc, pids = start_script(method, "dataloader")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert "[rank 0] where it was" in err and "in block" in err
    assert "_worker_loop" not in err  # a DataLoader worker's own frame
    assert "KeyboardInterrupt" in err
    wait_gone(pids)


@pytest.mark.parametrize("method", METHODS)
def test_sigkill_of_the_launcher_leaves_no_worker(method):
    proc, pids = start_script(method)
    helpers = descendants(proc.pid)  # the workers, and the fork server under spawn
    proc.kill()
    proc.communicate(timeout=10)
    record_figure("parent_sigkill_cleanup_s", wait_gone(helpers))


def test_two_nodes_on_localhost(tmp_path):
    port = free_port()
    code = (
        "import sys, json, enot_nb; from tests.helpers import jobs; "
        "r = enot_nb.notebook_launcher(jobs.describe, nprocs=1, backend='gloo', nnodes=2, "
        f"node_rank=int(sys.argv[1]), master_port={port}); print('RESULT', json.dumps(r))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(node)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=os.environ | {"PYTHONPATH": os.getcwd()},
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=50)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    import json

    r0 = json.loads(outs[0].split("RESULT ", 1)[1])
    assert (r0["WORLD_SIZE"], r0["RANK"], r0["NODE_RANK"], r0["LOCAL_RANK"]) == ("2", "0", "0", "0")
    assert r0["is_master"] and r0["is_local_master"] and r0["is_dist"]
    assert "RESULT null" in outs[1]  # node 1 has no global rank 0: it returns None


def test_signal_handlers_are_unchanged_by_launches():
    before = {s: signal.getsignal(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)}
    launch(jobs.describe)
    with pytest.raises(WorkerFailedError):
        launch(jobs.raise_on, 1)
    launch(jobs.describe, start_method="spawn")
    assert {s: signal.getsignal(s) for s in before} == before


@pytest.mark.parametrize("method", METHODS)
def test_other_ranks_are_stopped_by_the_launcher_after_a_failure(method, tmp_path):
    """Rank 0 would compute forever: the launch ends because the launcher stopped it (SIGTERM,
    the escalation after a failure), and only rank 1's failure is reported. How fast: the
    fault-to-error row of RELIABILITY.md and benchmarks, not a clock here."""
    record = tmp_path / "rank0-ended-by"
    with pytest.raises(WorkerFailedError) as info:
        launch(jobs.raise_while_rank_0_computes, str(record), start_method=method)
    assert info.value.rank == 1 and "rank 1 fails first" in info.value.traceback
    assert [f.rank for f in info.value.failures] == [1]
    assert record.read_text() == "SIGTERM"


@pytest.mark.parametrize("method", METHODS)
def test_ranks_that_fail_to_connect_are_started_again(method, tmp_path, monkeypatch, capfd):
    """gloo's connectFullMesh fails now and then between healthy ranks (about 1 launch in 500
    here); nothing of the user's has run, so the launch starts again instead of failing."""
    fault = tmp_path / "fault"
    monkeypatch.setenv("ENOT_NB_TEST_CONNECT_FAULT", str(fault))
    assert launch(jobs.rank_sum, 10, start_method=method) == {"sum": 30.0, "rank": 0, "world": 2}
    assert fault.exists()  # one rank did fail to connect
    err = capfd.readouterr().err
    assert err.count("the ranks could not connect") == 1 and "starting them again" in err


def test_the_same_error_from_user_code_is_a_failure():
    with pytest.raises(WorkerFailedError, match="connectFullMesh"):
        launch(jobs.raise_like_a_lost_connection, start_method="fork")


_LOGGED_LAUNCH = (
    "import logging, enot_nb\n"
    "from tests.helpers import jobs\n"
    "logging.basicConfig(level=logging.DEBUG)\n"
    # Every rank connects before it returns (after a failure a rank may be stopped just before
    # it reports that it connected, so the connected lines are looked for here).
    "enot_nb.notebook_launcher(jobs.rank_sum, args=(10,), nprocs=2, backend='gloo')\n"
    "try:\n"
    "    enot_nb.notebook_launcher(jobs.raise_on, args=(1,), nprocs=2, backend='gloo')\n"
    "except enot_nb.WorkerFailedError:\n"
    "    print('failed as expected')\n"
)


@pytest.mark.parametrize("debug", ["", "1"])
def test_the_debug_log_is_silent_unless_asked_for(debug):
    """Under a user's basicConfig(level=DEBUG) enot_nb logs nothing; ENOT_NB_DEBUG=1 logs an
    attempt's transitions (start, first failure, the stop signals, close)."""
    env = clean_env(PYTHONPATH=os.getcwd(), ENOT_NB_DEBUG=debug)
    run = subprocess.run([sys.executable, "-c", _LOGGED_LAUNCH], env=env, capture_output=True, text=True, timeout=50)
    assert run.returncode == 0, run.stderr
    assert "failed as expected" in run.stdout
    ours = [line for line in run.stderr.splitlines() if line.startswith("enot_nb ") or "DEBUG:enot_nb" in line]
    if not debug:
        assert ours == [], run.stderr
    else:
        text = "\n".join(ours)
        assert "attempt 0: starting 2 rank(s) by fork" in text
        assert "attempt 0: started, pids" in text
        assert "rank 0: connected" in text and "rank 1: connected" in text
        assert "attempt 0: first failure, rank 1 (exit code 1)" in text
        assert "attempt 0: closed, exit codes" in text


_LEFT_IN_TMPDIR = (
    "import json, os, tempfile, enot_nb\n"
    "from tests.helpers import jobs\n"
    "try:\n"
    "    total = enot_nb.notebook_launcher(jobs.{job}, nprocs=2, backend='gloo', start_method={method!r})\n"
    "except enot_nb.WorkerFailedError as err:\n"
    "    total = f'rank {{err.rank}} failed'\n"
    "print(json.dumps([total, sorted(os.listdir(tempfile.gettempdir()))]))\n"
)


@pytest.mark.parametrize(
    "job, outcome",
    [
        ("ends_with_dataloader_workers_alive", 6.0),  # the children dealt 0+1 and 2+3
        ("fails_while_dataloader_workers_alive", "rank 1 failed"),  # rank 0 killed, not leaving
    ],
)
@pytest.mark.parametrize("method", METHODS)
def test_no_multiprocessing_folder_is_left_by_dataloader_workers(method, job, outcome, tmp_path):
    """multiprocessing removes its pymp-* folder in an exit finalizer, which a worker's os._exit
    skips (and its DataLoader children die with the worker's process group): none may be left.
    A launcher with a temporary folder of its own, in a process of its own, to look in."""
    run = subprocess.run(
        [sys.executable, "-c", _LEFT_IN_TMPDIR.format(job=job, method=method)],
        env=clean_env(PYTHONPATH=os.getcwd(), TMPDIR=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert run.returncode == 0, run.stderr
    got, left = json.loads(run.stdout)
    assert got == outcome
    assert [name for name in left if name.startswith("pymp-")] == []


@needs_fsdp2
@pytest.mark.parametrize("method", METHODS)
def test_a_returned_sharded_model_comes_back_whole(method):
    """notebook_launcher's result as a cell's state: FSDP2's module plain again, with the full
    trained values, and its optimizer over those parameters with its state unsharded."""
    back = launch(jobs.train_sharded, 3, start_method=method)
    want = jobs.train_plain(3)
    model, opt = back["model"], back["opt"]
    assert type(model) is torch.nn.Sequential and all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    for got, expected in zip(model.parameters(), want["model"].parameters()):
        assert torch.allclose(got, expected, atol=1e-6)
    assert torch.allclose(model(torch.ones(1, 4)), want["model"](torch.ones(1, 4)), atol=1e-6)
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters()))
    assert torch.allclose(opt.state[model[0].weight]["exp_avg"], want["opt"].state[want["model"][0].weight]["exp_avg"])
