"""The same 50 DDP steps in two processes forked from a parent that imported torch, and in two
started fresh (exec): how much of the session's DDP row is the ranks being forks (issue 48).

Usage: .venv/bin/python benchmarks/forked_steps.py [--rounds N] [--blocks N]

No enot_nb: plain ``multiprocessing`` with the ``fork`` and ``spawn`` start methods, alternated
round by round, each pair of ranks running ``session_steps_job``'s steps in blocks of 50 between
barriers (as the session's DDP row does). A session's ranks are forks (of the kernel, or of the
fork server that imported torch), a torchrun script's are exec'd. Prints, per start method, the
median over the rounds of each round's median block: wall time, and rank 0's system and user
CPU time in it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import session_steps_job as job  # noqa: E402


def _rank(rank: int, port: int, blocks: int, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun's and a session's ranks on 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parts = job.build()
    step = (parts["ddp"], parts["optimizer"], parts["x"], parts["y"])
    job.fifty(*step)  # warm-up
    rows = []
    for _ in range(blocks):
        before = resource.getrusage(resource.RUSAGE_SELF)
        seconds = job.timed_fifty(*step)
        after = resource.getrusage(resource.RUSAGE_SELF)
        rows.append((seconds, after.ru_stime - before.ru_stime, after.ru_utime - before.ru_utime))
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def _round(method: str, port: int, blocks: int) -> tuple[float, float, float]:
    context = mp.get_context(method)
    out = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, port, blocks, out)) for r in (0, 1)]
    for process in ranks:
        process.start()
    rows = out.get(timeout=300)
    for process in ranks:
        process.join(timeout=60)
    return tuple(statistics.median(column) for column in zip(*rows))  # type: ignore[return-value]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()
    import torch  # noqa: F401 - the parent imports torch before forking, as a kernel has

    port = 29500 + os.getpid() % 1000
    found: dict[str, list[tuple[float, float, float]]] = {"fork": [], "spawn": []}
    started = time.strftime("%Y-%m-%d %H:%M")
    for _ in range(args.rounds):
        for method in found:
            port += 1
            found[method].append(_round(method, port, args.blocks))
    print(f"50 DDP steps, 2 ranks, gloo, {args.rounds} rounds of {args.blocks} blocks ({started})")
    print("| ranks | wall time | rank 0 system CPU | rank 0 user CPU |\n|---|---|---|---|")
    for method, rounds in found.items():
        wall, system, user = (statistics.median(column) * 1000 for column in zip(*rounds))
        label = "forked from a parent that imported torch" if method == "fork" else "started fresh (spawn)"
        print(f"| {label} | {wall:.1f} ms | {system:.1f} ms | {user:.1f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
