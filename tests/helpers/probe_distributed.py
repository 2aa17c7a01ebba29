"""Run under torchrun: exercise enot_nb.distributed and write what each rank saw as JSON.

Usage: torchrun ... probe_distributed.py OUT_DIR SCENARIO
"""

import json
import os
import sys
import time

import torch

from enot_nb import distributed as ed

out_dir, scenario = sys.argv[1], sys.argv[2]


def report(**values):
    path = os.path.join(out_dir, f"rank{os.environ['RANK']}.json")
    with open(path, "w") as f:
        json.dump(values, f)


def helpers():
    ed.init_torch(seed=3, backend="gloo")
    ed.init_torch(seed=3, backend="gloo")  # second call: no-op
    order_file = os.path.join(out_dir, "master_first.log")
    with ed.master_first():
        with open(order_file, "a") as f:
            f.write(f"{ed.get_rank()}\n")
        if ed.is_master():
            time.sleep(0.3)  # a slow download: the others must not enter before it ends
    shouted = ed.master_only(lambda: "from master")()
    report(
        rank=ed.get_rank(),
        local_rank=ed.get_local_rank(),
        world_size=ed.get_world_size(),
        is_dist=ed.is_dist(),
        is_master=ed.is_master(),
        is_local_master=ed.is_local_master(),
        master_only=shouted,
        wrapped_name=ed.master_only(helpers).__name__,
        first_rand=torch.rand(1).item(),
    )


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 3, bias=False)
        self.b = torch.nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight


class BuffersOnly(torch.nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.register_buffer("mean", torch.full((4,), float(rank + 1)))
        self.register_buffer("flag", torch.tensor([rank == 0, rank == 1]))


def fill_(model, rank):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))


def sync():
    ed.init_torch(backend="gloo")
    rank = ed.get_rank()
    results = {}

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    fill_(model, rank)
    model[1].running_mean.fill_(10.0 * (rank + 1))
    model[1].num_batches_tracked.fill_(100 + rank)
    ed.sync_model(model)
    results["avg_weight"] = model[0].weight.tolist()
    results["avg_running_mean"] = model[1].running_mean.tolist()
    results["counter"] = int(model[1].num_batches_tracked)

    fill_(model, rank)
    model[1].running_mean.fill_(10.0 * (rank + 1))
    ed.sync_model(model, reduce_parameters=False, reduce_buffers=False)
    results["bcast_weight"] = model[0].weight.tolist()
    results["bcast_running_mean"] = model[1].running_mean.tolist()

    fill_(model, rank)
    model[1].running_mean.fill_(10.0 * (rank + 1))
    ed.sync_model(model, sync_parameters=False)
    results["buffers_only_weight"] = model[0].weight.tolist()

    tied = Tied()
    fill_(tied, rank)
    ed.sync_model(tied)
    results["tied_weight"] = tied.b.weight.tolist()
    results["still_tied"] = tied.a.weight is tied.b.weight

    buffers = BuffersOnly(rank)
    ed.sync_model(buffers)
    results["buf_mean"] = buffers.mean.tolist()
    results["buf_flag"] = buffers.flag.tolist()

    # Many tensors, many buckets (ENOT_NB_SYNC_BUCKET_MB is tiny in this run): exact values.
    big = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    with torch.no_grad():
        for i, p in enumerate(big.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).view_as(p) * (rank + 1) + i)
    ed.sync_model(big)
    ok = all(
        torch.equal(p, torch.arange(p.numel(), dtype=torch.float32).view_as(p) * 1.5 + i)
        for i, p in enumerate(big.parameters())
    )
    results["bucketed_exact"] = ok
    report(**results)


def mismatch():
    import pickle

    import torch.distributed.distributed_c10d as c10d

    class Refused(pickle.Unpickler):
        def load(self):
            raise AssertionError("sync_model unpickled what a peer sent over the collectives")

    c10d._unpickler = Refused  # what all_gather_object loads its peers' pickles with
    ed.init_torch(backend="gloo")
    rank = ed.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3 if rank == 0 else 5))
    start = time.monotonic()
    try:
        ed.sync_model(model)
    except ed.DistributedRuntimeException as err:
        report(error=str(err), seconds=time.monotonic() - start)
    else:
        report(error=None)


{"helpers": helpers, "sync": sync, "mismatch": mismatch}[scenario]()
# End as enot_nb's workers do: the interpreter's own teardown aborts in some gloo runs on
# torch 2.13 ("terminate called without an active exception"; 2 of 16 runs here, 6 of 16 with
# a DistributedDataParallel model alive).
sys.stdout.flush()
torch.distributed.destroy_process_group()
os._exit(0)
