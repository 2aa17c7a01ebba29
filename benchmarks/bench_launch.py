"""Launch latency of a trivial 2-process job, every launcher measured in one real kernel.

Variants: a hand-rolled os.fork floor (the reference), enot_nb's notebook_launcher (fork, and
spawn through its warm fork server), ``%%enot_distributed``, Accelerate's notebook_launcher,
torch.multiprocessing spawn, and torchrun. Also: a trivial cell's overhead over the launcher.
"""

from __future__ import annotations

from benchmarks.harness import Row, kernel_json, median, start_kernel

SETUP = r'''
import json, os, socket, subprocess, sys, time, statistics
import torch, torch.distributed as dist
import enot_nb
from benchmarks import trivial_job
%load_ext enot_nb
NPROCS = torch.cuda.device_count() or 2

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

from benchmarks.harness import timed as times

def fork_floor():
    """The least any fork-based launcher can do: fork, set the env, join, reduce, exit."""
    port, pids = free_port(), []
    for rank in range(NPROCS):
        pid = os.fork()
        if pid == 0:
            os.environ.update(WORLD_SIZE=str(NPROCS), RANK=str(rank), LOCAL_RANK=str(rank),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            trivial_job.init_and_all_reduce()
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0

def enot(method):
    return lambda: enot_nb.notebook_launcher(trivial_job.one_all_reduce, nprocs=NPROCS,
                                             start_method=method)

def magic():
    get_ipython().run_cell_magic("enot_distributed", f"-n {NPROCS} --no-return",
                                 "from benchmarks import trivial_job\ntrivial_job.one_all_reduce()")

def accelerate():
    from accelerate import notebook_launcher
    notebook_launcher(trivial_job.init_and_all_reduce, num_processes=NPROCS, use_port=str(free_port()))

def mp_spawn():
    torch.multiprocessing.start_processes(trivial_job.spawned, args=(free_port(), NPROCS),
                                          nprocs=NPROCS, start_method="spawn")

def torchrun():
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={NPROCS}", trivial_job.__file__], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
'''

VARIANTS = [
    ("os.fork floor (reference)", "fork_floor", ""),
    ("enot_nb notebook_launcher, fork", "enot('fork')", "<= 1.3x"),
    ("enot_nb notebook_launcher, spawn (warm fork server)", "enot('spawn')", "<= 2x"),
    ("%%enot_distributed, trivial cell", "magic", ""),
    ("Accelerate notebook_launcher", "accelerate", ""),
    ("torch.multiprocessing spawn", "mp_spawn", ""),
    ("torchrun", "torchrun", ""),
]


def run(repeats: int = 7) -> list[Row]:
    kernel = start_kernel()
    try:
        kernel.ok(SETUP)
        medians = {}
        for label, expression, target in VARIANTS:
            slow = label.startswith(("torchrun", "torch.multiprocessing"))
            count = max(3, repeats // 2) if slow else repeats
            try:
                found = kernel_json(kernel, f"print('RESULT', json.dumps(times({expression}, {count})))")
            except RuntimeError as err:
                if "No module named 'accelerate'" in str(err):
                    continue  # the benchmark extra is not installed
                raise
            medians[label] = (median(found), target, len(found))
    finally:
        kernel.shutdown()
    floor = medians["os.fork floor (reference)"][0]
    rows = [
        Row(
            "launch (trivial job, 2 processes, in a kernel)",
            label,
            value,
            "s",
            "os.fork floor",
            value / floor,
            target,
            n,
        )
        for label, (value, target, n) in medians.items()
    ]
    launcher = medians["enot_nb notebook_launcher, fork"][0]
    cell = medians["%%enot_distributed, trivial cell"][0]
    rows.append(
        Row(
            "cell overhead over the launcher",
            "%%enot_distributed - notebook_launcher",
            cell - launcher,
            "s",
            "notebook_launcher, fork",
            cell / launcher,
            "",
            0,
        )
    )
    return rows
