"""A fixed number of DistributedDataParallel steps of a small model, timed after a warm-up.

The same function runs in a ``%%enot_distributed`` cell and under torchrun (as a script).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

from enot_nb import distributed as ed

STEPS, WARMUP = 600, 30


def steps_per_second(steps: int = STEPS, warmup: int = WARMUP) -> float:
    device = torch.device("cuda", ed.get_local_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
    for step in range(warmup + steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - start)


if __name__ == "__main__":  # torchrun benchmarks/train_job.py OUT.json
    import os

    ed.init_torch(backend="nccl" if torch.cuda.is_available() else "gloo")
    rate = steps_per_second()
    if ed.is_master():
        with open(sys.argv[1], "w") as f:
            json.dump(rate, f)
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)  # as enot_nb's workers do: gloo + DDP teardown can abort on torch 2.13
