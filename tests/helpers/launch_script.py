"""A plain Python program that launches workers which block forever (for signal tests).

Usage: python launch_script.py START_METHOD [dataloader]
Every rank prints "pid <pid>" (output="all"), then they wait in a collective forever; with
``dataloader``, rank 0 first holds a DataLoader with two live workers.
"""

import os
import sys
import time

import enot_nb
from enot_nb import distributed as ed


def block():
    import torch.distributed as dist

    print(f"pid {os.getpid()}", flush=True)
    if ed.get_rank() == 0:
        time.sleep(3600)
    dist.barrier()


def block_with_dataloader():
    import torch

    if ed.get_rank() == 0:
        loader = torch.utils.data.DataLoader(list(range(64)), num_workers=2, batch_size=1)
        batches = iter(loader)
        next(batches)  # its workers run, each with batches prefetched
    block()


if __name__ == "__main__":
    print(f"launcher {os.getpid()}", flush=True)
    job = block_with_dataloader if sys.argv[2:] == ["dataloader"] else block
    enot_nb.notebook_launcher(job, nprocs=2, backend="gloo", start_method=sys.argv[1], output="all")
