"""A plain Python program that launches workers which block forever (for signal tests).

Usage: python launch_script.py START_METHOD
Every rank prints "pid <pid>" (output="all"), then they wait in a collective forever.
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


if __name__ == "__main__":
    print(f"launcher {os.getpid()}", flush=True)
    enot_nb.notebook_launcher(block, nprocs=2, backend="gloo", start_method=sys.argv[1], output="all")
