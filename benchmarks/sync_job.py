"""Runs inside each worker: time sync_model against the ways users sync models without it."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.shapes import bert_base_like, resnet50_like
from enot_nb import distributed as ed


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    found = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        found.append(time.perf_counter() - start)
    return statistics.median(found)


def _per_tensor(model: torch.nn.Module, reduce: bool) -> None:
    world = dist.get_world_size()
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if reduce and tensor.is_floating_point():
                dist.all_reduce(tensor)
                tensor.div_(world)
            else:
                dist.broadcast(tensor, src=0)


def measure(repeats: int) -> dict[str, dict[str, float]]:
    device = torch.device("cuda", ed.get_local_rank()) if dist.get_backend() == "nccl" else torch.device("cpu")
    results = {}
    for name, build in (("ResNet-50 shape", resnet50_like), ("BERT-base shape", bert_base_like)):
        model = build().to(device)
        nbytes = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
        flat = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
        results[name] = {
            "flat all_reduce (reference)": _time(lambda flat=flat: dist.all_reduce(flat), repeats),
            "sync_model, reduce": _time(lambda model=model: ed.sync_model(model), repeats),
            "per-tensor all_reduce": _time(lambda model=model: _per_tensor(model, True), repeats),
            "flat broadcast (reference)": _time(lambda flat=flat: dist.broadcast(flat, src=0), repeats),
            "sync_model, broadcast": _time(
                lambda model=model: ed.sync_model(model, reduce_parameters=False, reduce_buffers=False), repeats
            ),
            "per-tensor broadcast": _time(lambda model=model: _per_tensor(model, False), repeats),
            "building DistributedDataParallel": _time(
                lambda model=model: torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=[device.index] if device.type == "cuda" else None
                ),
                repeats,
            ),
        }
    return results
