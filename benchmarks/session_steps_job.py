"""50 DistributedDataParallel steps of a small model: in a session cell, and in a torchrun script
that is already running (the reference: no import, no process group, no sync repeated).

``build()`` makes the model, its DDP wrapper, the optimizer and a batch once; ``fifty()`` runs 50
steps. Under torchrun (``torchrun benchmarks/session_steps_job.py CONTROL``) the script runs
``fifty()`` once per command it reads (see ``serve``), alternating with the bench's session cells.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

STEPS = 50


def build() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    return {
        "model": model,
        "ddp": ddp,
        "optimizer": torch.optim.SGD(ddp.parameters(), lr=0.01),
        "x": torch.randn(64, 256),
        "y": torch.randint(0, 10, (64,)),
    }


def fifty(ddp, optimizer, x, y) -> None:
    for _ in range(STEPS):
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def timed_fifty(ddp, optimizer, x, y) -> float:
    """``fifty()`` between two barriers: its seconds, as a cell ends when every rank is done
    (the script's blocks, and the session cell that the bench times around this)."""
    dist.barrier()
    start = time.perf_counter()
    fifty(ddp, optimizer, x, y)
    dist.barrier()
    return time.perf_counter() - start


def serve(control: str) -> None:
    """Under torchrun, already running: one block of 50 steps for each line read from this
    rank's command pipe (``CONTROL.rankN``), its seconds (``timed_fifty``) written by rank 0 to
    ``CONTROL.out``, a line each; until the pipe closes.
    The bench alternates these blocks with session cells, so both see the machine as it is."""
    from enot_nb import distributed as ed

    ed.init_torch(backend="gloo")
    parts = build()
    step = (parts["ddp"], parts["optimizer"], parts["x"], parts["y"])
    fifty(*step)  # warm-up
    with open(f"{control}.rank{ed.get_rank()}") as commands:
        out = open(f"{control}.out", "w", buffering=1) if ed.is_master() else None
        for _ in commands:
            seconds = timed_fifty(*step)
            if out is not None:
                out.write(f"{seconds}\n")
        if out is not None:
            out.close()


if __name__ == "__main__":
    serve(sys.argv[1])
