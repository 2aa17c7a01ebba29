"""Where a session cell's time goes: each phase stamped in the kernel and on the ranks.

Usage: .venv/bin/python benchmarks/session_profile.py [--cells N] [--tree PATH] [--cell pass|ddp] [--ray]

A real kernel with a two-rank gloo session runs N session cells, each its own execute request:
trivial ones (``pass``), or bench_session's 50 DDP steps (``ddp``, the steps stamped too);
wrappers stamp the phases of each (the kernel's own steps, and on each rank from reading the
task to sending the answer), and the medians over the cells are printed. The stamps cost about
a microsecond each. ``--ray``: the session on the Ray engine, one rank per node of a two-node
cluster on this machine (bench_ray's). ``--tree``: the checkout whose ``enot_nb`` runs (default: this one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_session  # noqa: E402
from benchmarks.harness import ROOT  # noqa: E402
from tests.kernel import Kernel  # noqa: E402

STAMPS = r"""
import time as _t, functools as _ft
{name} = []
def {name}_wrap(owner, name, label):
    f = getattr(owner, name)
    @_ft.wraps(f)
    def stamped(*args, **kwargs):
        start = _t.perf_counter_ns()
        try:
            return f(*args, **kwargs)
        finally:
            {name}.append((label, start, _t.perf_counter_ns()))
    setattr(owner, name, stamped)
"""
"""Each wrapped call appends (label, start, end) to the list ``name`` (the kernel's and the
ranks' lists have names of their own: a session cell that named the kernel's would send it)."""


KERNEL = (
    STAMPS.format(name="_kernel_stamps")
    + r"""
from enot_nb._session.kernel import flow as _flow, session as _session, workers as _workers
from {host_module} import {host_class} as _Host
for owner, name, label in [
    (_session.Session, "run_cell", "the session's part (Session.run_cell)"),
    (_flow.NamespaceFlow, "cell", "the task made (compare, reach, push)"),
    (_flow.NamespaceFlow, "pickle", "the task pickled"),
    (_Host, "put_task", "the task written"),
    (_Host, "send", "the command sent"),
    (_workers.CommandRound, "_supervise", "waiting for the ranks' answers"),
    (_Host, "load", "the master's answer loaded"),
    (_flow.NamespaceFlow, "after_cell", "the answer applied"),
]:
    _kernel_stamps_wrap(owner, name, label)
get_ipython().events.register("pre_run_cell", lambda info: _kernel_stamps.append(("<", _t.perf_counter_ns(), 0)))
get_ipython().events.register("post_run_cell", lambda result: _kernel_stamps.append((">", _t.perf_counter_ns(), 0)))
"""
)

RANKS = (
    "%%enot_distributed --no-return\n"
    + STAMPS.format(name="_rank_stamps")
    + r"""
from enot_nb._session.worker import loop as _loop
from enot_nb._worker import bootstrap as _bootstrap, cell as _cell
for owner, name, label in [
    (_loop.framing, "recv_message", "recv"),
    (_loop, "run_task", "the task loaded and run"),
    (_cell, "run_cell", "the cell run (snapshot, code, comparison)"),
    (_bootstrap, "send_outcome", "the answer sent (output fences, result)"),
]:
    _rank_stamps_wrap(owner, name, label)
"""
)


def kernel_phases(stamps: list) -> dict[str, float]:
    """Median milliseconds of each stamped phase over the cells, and of each cell as a whole."""
    cells, current = [], None
    for label, start, end in stamps:
        if label == "<":
            current = {"cell": [start, None]}
        elif label == ">" and current is not None:
            current["cell"][1] = start
            cells.append(current)
            current = None
        elif current is not None:
            current[label] = [start, end]
    cells = [c for c in cells if "waiting for the ranks' answers" in c]
    phases = {"the whole cell, pre_run_cell to post_run_cell": [c["cell"][1] - c["cell"][0] for c in cells]}
    session = "the session's part (Session.run_cell)"
    phases["IPython and the magic's options, before"] = [c[session][0] - c["cell"][0] for c in cells]
    phases["IPython, after"] = [c["cell"][1] - c[session][1] for c in cells]
    for label in cells[0] if cells else []:
        if label != "cell":
            phases[label] = [c[label][1] - c[label][0] for c in cells]
    return {label: statistics.median(values) / 1e6 for label, values in phases.items()}


def rank_phases(stamps: list) -> dict[str, float]:
    """Median milliseconds of each phase on a rank, between one command read and the next."""
    reads = [(start, end) for label, start, end in stamps if label == "recv"]
    phases: dict[str, list[int]] = {}
    for (_, read), (next_read, _) in zip(reads, reads[1:]):
        phases.setdefault("busy: a command read to the next read", []).append(next_read - read)
        for label, start, end in stamps:
            if label != "recv" and read <= start and end <= next_read:
                phases.setdefault(label, []).append(end - start)
    return {label: statistics.median(values) / 1e6 for label, values in phases.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--tree", default=str(ROOT))
    parser.add_argument("--cell", choices=["pass", "ddp"], default="pass")
    parser.add_argument("--ray", action="store_true")
    args = parser.parse_args()
    cell = "%%enot_distributed\n" + ("pass" if args.cell == "pass" else bench_session.FIFTY_STEPS)
    if args.ray:
        from benchmarks.bench_ray import loopback_cluster

        with loopback_cluster() as (address, folder):
            ours, theirs = profile(args, cell, {"RAY_ADDRESS": address}, folder)
    else:
        ours, theirs = profile(args, cell, {}, None)
    print(f"| where | phase | median over {args.cells} cells |")
    print("|---|---|---|")
    for label, ms in kernel_phases(ours).items():
        print(f"| kernel | {label} | {ms:.3f} ms |")
    for line in theirs.splitlines():
        if "STAMPS " in line:
            rank = line.split("]")[0].strip("[") if line.startswith("[") else "rank 0"
            for label, ms in rank_phases(json.loads(line.split("STAMPS ", 1)[1])).items():
                print(f"| {rank} | {label} | {ms:.3f} ms |")
    return 0


def profile(args: argparse.Namespace, cell: str, env: dict[str, str], folder: str | None) -> tuple[list, str]:
    """The kernel's stamps and the ranks' (their printed lines) over ``args.cells`` cells."""
    kernel = Kernel(extra_env={"PYTHONPATH": args.tree, **env}, cwd=Path(folder) if folder else ROOT)
    start = "%enot_session start -n 2 --engine ray --placement spread" if args.ray else "%enot_session start -n 2"
    host = ("enot_nb._launch.ray_ranks", "RayRanks") if args.ray else ("enot_nb._launch.local_ranks", "LocalRanks")
    try:
        kernel.ok(f"import sys; sys.path[:0] = [{args.tree!r}]\n%load_ext enot_nb")
        kernel.ok(start + " --backend gloo", timeout=300)
        kernel.ok(KERNEL.replace("{host_module}", host[0]).replace("{host_class}", host[1]))
        kernel.ok(RANKS)
        if args.cell == "ddp":
            for line in bench_session.ddp_setup():
                kernel.ok(line)
            kernel.ok("%%enot_distributed --no-return\n_rank_stamps_wrap(job, 'timed_fifty', 'the 50 steps')")
        for _ in range(5):
            kernel.ok(cell)
        kernel.ok("_kernel_stamps.clear()")
        kernel.ok("%%enot_distributed --no-return\n_rank_stamps.clear()")
        for _ in range(args.cells):
            kernel.ok(cell)
        ours = json.loads(kernel.ok("import json\nprint(json.dumps(_kernel_stamps))").stdout.strip().splitlines()[-1])
        theirs = kernel.ok(
            "%%enot_distributed --no-return --output all\nimport json\nprint('STAMPS', json.dumps(_rank_stamps))"
        ).stdout
        kernel.ok("%enot_session stop")
    finally:
        kernel.shutdown()
    return ours, theirs


if __name__ == "__main__":
    sys.exit(main())
