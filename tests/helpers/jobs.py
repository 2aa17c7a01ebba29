"""Worker functions for launcher tests (importable, so fork and spawn both find them)."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from enot_nb import distributed as ed


def rank_sum(x):
    t = torch.tensor([float(ed.get_rank() + 1)])
    dist.all_reduce(t)
    return {"sum": t.item() * x, "rank": ed.get_rank(), "world": ed.get_world_size()}


def rank_sum_undestroyable(x):
    """rank_sum in a process whose process group cannot be destroyed: destroy_process_group
    blocks, as torch 2.3.1's gloo did for good once a peer had left."""
    dist.destroy_process_group = lambda *args, **kwargs: time.sleep(3600)
    return rank_sum(x)


def describe():
    keys = (
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "OMP_NUM_THREADS",
    )
    return {k: os.environ.get(k) for k in keys} | {
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "is_dist": ed.is_dist(),
        "is_master": ed.is_master(),
        "is_local_master": ed.is_local_master(),
        "pgid": os.getpgid(0),
    }


def chatty():
    print(f"python line from {ed.get_rank()}")
    os.write(1, f"C-level line from {ed.get_rank()}\n".encode())
    sys.stdout.write("progress 1/2\rprogress 2/2\n")
    print(f"stderr from {ed.get_rank()}", file=sys.stderr)
    dist.barrier()


def raise_on(rank, message="boom"):
    if ed.get_rank() == rank:
        raise ValueError(f"{message} on rank {rank}")
    dist.barrier()  # the others wait in a collective: they must be stopped, not hang


def exit_on(rank, code):
    if ed.get_rank() == rank:
        sys.stdout.flush()
        os._exit(code)
    dist.barrier()


def sys_exit_on(rank, code):
    if ed.get_rank() == rank:
        sys.exit(code)
    dist.barrier()


def kill_self_on(rank, signum):
    if ed.get_rank() == rank:
        os.kill(os.getpid(), signum)
        time.sleep(30)
    dist.barrier()


def fail_first_attempt():
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and ed.get_rank() == 1:
        raise RuntimeError("first attempt fails")
    dist.barrier()
    return attempt


def always_fail():
    raise RuntimeError(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} fails")


def parallel_matmul():
    """Several OpenMP threads in the worker's first parallel op (hangs after an unsafe fork)."""
    a = torch.randn(400, 400)
    for _ in range(5):
        a = (a @ a).clamp_(-1, 1)
    return torch.get_num_threads()


def nested_launch():
    import enot_nb

    return enot_nb.notebook_launcher(describe, nprocs=1)


def wait_for_release(started_fd, release_fd):
    """Tell the test we run (a byte on a pipe), then block until it releases us."""
    if ed.is_master():
        os.write(started_fd, b"s")
        os.read(release_fd, 1)
    dist.barrier()
    return "released"


def big_result(megabytes):
    return torch.arange(megabytes * 2**18, dtype=torch.float32)


def sleep_forever_in_barrier():
    if ed.get_rank() == 0:
        print("rank 0 ready", flush=True)
        time.sleep(3600)
    dist.barrier()


def with_dataloader_children():
    """A worker with children of its own (DataLoader workers) that outlive nothing."""
    data = torch.utils.data.DataLoader(list(range(100)), num_workers=2, batch_size=1)
    it = iter(data)
    next(it)
    pids = [w.pid for w in it._workers]
    print("children", pids, flush=True)
    dist.barrier()  # both ranks have their children before rank 1 fails
    if ed.get_rank() == 1:
        raise RuntimeError("failing with children")
    dist.barrier()
    return pids


def inspect_tensors(big, small):
    """Where the tensors of a spawned job live: memfd mappings, not copies from the pipe."""
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if "enot_nb-tensor" in line]
    in_shm = lambda t: any(  # noqa: E731 - a one-line predicate, local to this job
        int(line.split("-")[0], 16) <= t.data_ptr() < int(line.split()[0].split("-")[1], 16) for line in mapped
    )
    result = {
        "sums": [float(big.sum()), float(small.sum())],
        "big_in_shared_memory": in_shm(big),
        "small_in_shared_memory": in_shm(small),
    }
    big[0] = 42  # private mapping: allowed, and invisible to the caller and the other rank
    dist.barrier()
    result["writable_copy_on_write"] = big[0].item() == 42
    return result


def raise_while_rank_0_computes(record):
    """Rank 1 raises while rank 0 computes in Python: no collective that gloo could end by
    itself, so only the launcher's stop can end rank 0. Rank 0 writes the name of the signal
    that ends it into ``record``, then dies of it."""
    if ed.get_rank() == 0:

        def noted(signum, frame):
            with open(record, "w") as f:
                f.write(signal.Signals(signum).name)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, noted)
    dist.barrier()  # rank 0's handler is in place before rank 1 raises
    if ed.get_rank() == 1:
        raise RuntimeError("rank 1 fails first")
    while True:
        sum(range(1000))


def raise_like_a_lost_connection():
    """User code that raises the text of gloo's connect failure: a failure like any other."""
    raise RuntimeError("Gloo connectFullMesh failed with [user code] Connection closed by peer")


def forms_a_group(index):
    """What torch.multiprocessing.spawn's users start: a process that joins a process group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=index, world_size=2, init_method="tcp://127.0.0.1:1")


def ends_with_dataloader_workers_alive():
    """Returns while its DataLoader's (persistent) workers still run, their batches' tensors
    having come back through shared memory (multiprocessing's sockets in its pymp-* folder)."""
    global _alive_at_the_end
    loader = torch.utils.data.DataLoader(torch.arange(8.0), num_workers=2, batch_size=2, persistent_workers=True)
    _alive_at_the_end = iter(loader)
    return float(sum(batch.sum() for batch in [next(_alive_at_the_end), next(_alive_at_the_end)]))


def fails_while_dataloader_workers_alive():
    """Rank 0 holds live DataLoader workers (batches back through shared memory) and computes
    until it is stopped (killed without leaving as a worker leaves); rank 1 fails."""
    if ed.get_rank() == 0:
        ends_with_dataloader_workers_alive()
    dist.barrier()
    if ed.get_rank() == 1:
        raise RuntimeError("rank 1 fails while rank 0 holds DataLoader workers")
    while True:
        sum(range(1000))


def train_sharded(steps: int) -> dict:
    """FSDP2 on every rank (the same data), returning the sharded model and its optimizer."""
    from torch.distributed.fsdp import fully_shard

    return train_plain(steps, shard=lambda model: (fully_shard(model[0]), fully_shard(model)))


def train_plain(steps: int, shard=None) -> dict:
    """The same training in one process (``shard``: how train_sharded shards the model first):
    what train_sharded must come back as."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if shard is not None:
        shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model, "opt": opt}
