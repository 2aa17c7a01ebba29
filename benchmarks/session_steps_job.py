"""50 DistributedDataParallel steps of a small model: in a session cell, and in a torchrun script
that is already running (the reference: no import, no process group, no sync repeated).

``build()`` makes the model, its DDP wrapper, the optimizer and a batch once; ``fifty()`` runs 50
steps. Under torchrun (``torchrun benchmarks/session_steps_job.py OUT.json REPEATS``) the script
times ``fifty()`` REPEATS times after a warm-up and writes rank 0's seconds.
"""

from __future__ import annotations

import json
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


if __name__ == "__main__":
    from enot_nb import distributed as ed

    ed.init_torch(backend="gloo")
    parts = build()
    fifty(parts["ddp"], parts["optimizer"], parts["x"], parts["y"])  # warm-up
    seconds = []
    for _ in range(int(sys.argv[2])):
        dist.barrier()
        start = time.perf_counter()
        fifty(parts["ddp"], parts["optimizer"], parts["x"], parts["y"])
        dist.barrier()  # as a cell ends when every rank is done
        seconds.append(time.perf_counter() - start)
    if ed.is_master():
        with open(sys.argv[1], "w") as f:
            json.dump(seconds, f)
