"""What every rank holds a copy of by construction, and making the copies the master's again
(after a failed or interrupted session cell, see _session/worker/repair), or comparing them
(see replica_check).

One rule decides what is a replica (``replicated_by_construction``): DDP keeps its wrapped
module's parameters and buffers equal on every rank, and an optimizer stepping the same DDP
parameters on every rank keeps its state over them equal too. Nothing else is: a ZeRO
optimizer's inner optimizer holds each rank's own shard of the state, FSDP modules and DTensor
``Shard`` parameters each rank's own slice, and a rank's plain tensors are its own. Taking the
master's bytes for those would overwrite a shard with another rank's, or (shards of different
sizes) crash the ranks in the broadcast.

Each replica is named by a key the ranks agree on without sending objects: where it is held
(its path from the rank's variables, and for optimizer state the parameters its optimizer
steps) and its size. ``equalize`` compares keys across ranks by their hashes: only what every
rank holds under the same key is compared and taken; the rest is named, never broadcast
(``agreed``, which the check shares).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, NamedTuple

from enot_nb._memory.digests import device_checksum
from enot_nb._serialize.tensors import tensor_storages
from enot_nb._state.registry import Registry
from enot_nb._state.states import object_dict
from enot_nb._worker.held import DDP, ZERO, imported_classes, reached_through


class Replica(NamedTuple):
    """One storage this rank holds a copy of by construction."""

    where: str
    """How the rank's variables reach it (``nets['G'].module.0.weight``,
    ``opt.state[nets['G'].module.0.weight]['momentum_buffer']``)."""
    key: str
    """What the ranks compare to know they hold the same replica: ``where``, its size, and for
    optimizer state which DDP parameters its optimizer steps."""
    storage: Any
    tensor: Any
    """The first tensor found over ``storage``: what a check compares, in its dtype."""
    resynced: bool = False
    """A buffer DDP sends from rank 0 at its next forward (``broadcast_buffers``): BatchNorm's
    running statistics differ between forwards by design."""


class _Candidate(NamedTuple):
    where: str
    key: str
    tensor: Any
    resynced: bool = False


class Sharded(NamedTuple):
    """State sharded by design, left as each rank holds it."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where} ({self.what})"


class Replication(NamedTuple):
    """What a rank holds, as the repair sees it: the replicas, and the sharded state left alone."""

    replicas: list[Replica]
    sharded: list[Sharded]
    """State sharded by design: a ZeRO optimizer, an FSDP module, a DTensor ``Shard``
    parameter outside one."""


def replicated_by_construction(held: Registry) -> Replication:
    """Decide which of what the rank holds (``held``: its variables walked at any depth) every
    rank holds a copy of by construction: each DDP wrapper's module's parameters and buffers
    (not those DDP ignores, not DTensors), and the state of each optimizer over them (its key
    names the DDP parameters it steps, so that an optimizer stepping other parameters on
    another rank matches nothing there). ZeRO's inner optimizers, FSDP modules and DTensor
    ``Shard`` parameters are sharded: listed, never replicas."""
    import torch

    sharded_types = _sharded_types()
    params: dict[int, str] = {}  # a DDP replica's tensor -> its path
    inner: set[int] = set()  # ZeRO's per-rank optimizers
    sharded: list[Sharded] = []
    found: list[_Candidate] = []
    for i, obj in enumerate(held.objects):
        if isinstance(obj, sharded_types.ddp):
            found += _ddp_replicas(held, i, obj, params, sharded)
        elif isinstance(obj, sharded_types.zero):
            sharded.append(Sharded(held.path(i), "ZeroRedundancyOptimizer: each rank's shard of the state"))
            inner.add(id(getattr(obj, "optim", None)))
        elif isinstance(obj, sharded_types.fsdp) and not reached_through(held, i, sharded_types.fsdp):
            sharded.append(Sharded(held.path(i), "FSDP: each rank's shard of the parameters"))
        elif _is_sharded_tensor(obj) and not reached_through(held, i, sharded_types.fsdp):
            sharded.append(Sharded(held.path(i), "a DTensor sharded over the ranks"))
    for i, obj in enumerate(held.objects):
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, sharded_types.zero) and id(obj) not in inner:
            found += _optimizer_replicas(held.path(i), obj, params)
    replicas: dict[int, Replica] = {}
    for where, key, tensor, resynced in sorted(found, key=lambda candidate: candidate.key):
        for storage in tensor_storages(tensor):  # a storage two tensors share: its first key
            replicas.setdefault(id(storage), Replica(where, f"{key} {storage.nbytes()}", storage, tensor, resynced))
    return Replication(list(replicas.values()), sharded)


def _ddp_replicas(held: Registry, i: int, ddp: Any, params: dict[int, str], sharded: list[Sharded]) -> list[_Candidate]:
    """A DDP wrapper's module's parameters and buffers (``ddp.module.0.weight``); recorded in
    ``params`` by the tensor's id (a DTensor among them: in ``sharded``)."""
    if _over_a_subgroup(ddp):
        sharded.append(Sharded(held.path(i), "DDP over a subgroup of the ranks: its replicas agree within it"))
        return []
    ignored = getattr(ddp, "parameters_to_ignore", ()) or ()
    resynced = bool(getattr(ddp, "broadcast_buffers", False))
    buffers = {id(b) for b in ddp.module.buffers()}
    found = []
    for name, tensor in (*ddp.module.named_parameters(), *ddp.module.named_buffers()):
        if name in ignored:
            continue
        where = f"{held.path(i)}.module.{name}"  # the wrapper's path: the same on every rank
        if _is_dtensor(tensor):  # DDP over a device mesh: not a whole replica
            sharded.append(Sharded(where, "a DTensor in a DDP module"))
            continue
        params[id(tensor)] = where
        found.append(_Candidate(where, where, tensor, resynced and id(tensor) in buffers))
    return found


def _over_a_subgroup(ddp: Any) -> bool:
    """Whether a DDP wrapper keeps its replicas over fewer ranks than the world (a data-parallel
    subgroup): comparing them with rank 0's would take another group's for a drift."""
    import torch.distributed as dist

    group = (object_dict(ddp) or {}).get("process_group")
    if group is None:
        return False
    try:
        return dist.get_world_size(group) != dist.get_world_size()
    except (RuntimeError, ValueError):  # a group aborted or gone: a repair moves the wrapper first
        return False


def _optimizer_replicas(path: str, optimizer: Any, params: dict[int, str]) -> list[_Candidate]:
    """The tensors of an optimizer's state over DDP's replicated parameters; each key names
    every DDP parameter the optimizer steps."""
    import torch

    mine = [p for group in optimizer.param_groups for p in group["params"] if id(p) in params]
    steps = hashlib.blake2b("\n".join(sorted(params[id(p)] for p in mine)).encode(), digest_size=8).hexdigest()
    found = []
    for param in mine:
        for name, value in sorted(optimizer.state.get(param, {}).items(), key=lambda item: str(item[0])):
            if isinstance(value, torch.Tensor) and not _is_dtensor(value):
                where = f"{path}.state[{params[id(param)]}][{name!r}]"
                found.append(_Candidate(where, f"{where} over {steps}", value))
    return found


class _ShardedTypes(NamedTuple):
    ddp: tuple[type, ...]
    zero: tuple[type, ...]
    fsdp: tuple[type, ...]


def _sharded_types() -> _ShardedTypes:
    return _ShardedTypes(
        ddp=imported_classes(DDP),
        zero=imported_classes(ZERO),
        fsdp=imported_classes(
            ("torch.distributed.fsdp", "FSDPModule"),
            ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
        ),
    )


def _is_dtensor(obj: Any) -> bool:
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return isinstance(dtensor, type) and isinstance(obj, dtensor)


def _is_sharded_tensor(obj: Any) -> bool:
    """A DTensor with a ``Shard`` placement: each rank holds its own slice."""
    if not _is_dtensor(obj):
        return False
    shard = getattr(sys.modules.get("torch.distributed.tensor"), "Shard", None)
    return isinstance(shard, type) and any(isinstance(p, shard) for p in getattr(obj, "placements", ()))


class Equalized(NamedTuple):
    """What ``equalize`` did."""

    taken: list[str]
    """Where a replica differed from the master's and took its bytes."""
    apart: list[str]
    """Rank 0's replicas that another rank does not hold under the same key: left alone."""
    apart_elsewhere: int
    """The most replicas any rank holds under a key that some rank lacks (left alone too)."""


def equalize(replicas: list[Replica]) -> Equalized:
    """Make every replica that all ranks hold under the same key the master's: compared by a
    checksum taken on its own device, the master's bytes broadcast over the world group where
    one rank's differ. A collective: every rank calls it, with what it holds."""
    agreement = agreed(replicas)
    return Equalized(_take_the_masters(agreement.common, agreement.device), agreement.apart, agreement.apart_elsewhere)


class Agreement(NamedTuple):
    """The replicas every rank holds under the same key, and the rest."""

    common: list[Replica]
    """In rank 0's order, the same on every rank."""
    apart: list[str]
    """This rank's replicas that another rank does not hold under the same key."""
    apart_elsewhere: int
    """The most replicas any rank holds under a key that some rank lacks."""
    device: Any
    """Where the ranks' collectives take tensors: the rank's GPU under nccl, else the CPU."""


def agreed(replicas: list[Replica]) -> Agreement:
    """Which replicas every rank holds under the same key, by the keys' hashes (rank 0's keys
    broadcast, each rank says which it holds). A collective: every rank calls it."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    by_key = {_key_hash(r.key): r for r in replicas}
    count = torch.tensor([len(by_key)], dtype=torch.int64, device=device)
    dist.broadcast(count, 0)
    common = []
    if int(count):
        mine = list(by_key) if dist.get_rank() == 0 else [0] * int(count)
        keys = torch.tensor(mine, dtype=torch.int64, device=device)
        dist.broadcast(keys, 0)  # rank 0's keys, in its order
        everywhere = torch.tensor([k in by_key for k in keys.tolist()], dtype=torch.int64, device=device)
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
        common = [by_key[k] for k, h in zip(keys.tolist(), everywhere.tolist()) if h]
    elsewhere = torch.tensor([len(by_key) - len(common)], dtype=torch.int64, device=device)
    dist.all_reduce(elsewhere, op=dist.ReduceOp.MAX)
    shared = {id(r) for r in common}
    apart = [r.where for r in by_key.values() if id(r) not in shared]
    return Agreement(common, apart, int(elsewhere), device)


def _take_the_masters(common: list[Replica], device: Any) -> list[str]:
    """Where each of ``common`` (the same replicas, in one order, on every rank) differs from
    the master's by checksum, every rank takes the master's bytes; where they differed."""
    import torch
    import torch.distributed as dist

    if not common:
        return []
    sums = torch.tensor([device_checksum(r.storage)[1] for r in common], dtype=torch.int64, device=device)
    masters = sums.clone()
    dist.broadcast(masters, 0)
    differ = (sums != masters).to(torch.int64)
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)  # every rank takes part in every broadcast
    taken = []
    for replica, different in zip(common, differ.tolist()):
        if different:
            data = torch.empty(0, dtype=torch.uint8, device=replica.storage.device).set_(replica.storage)
            if data.device == device:
                dist.broadcast(data, 0)
            else:  # a CPU replica under nccl: through the device
                moved = data.to(device)
                dist.broadcast(moved, 0)
                data.copy_(moved)
            taken.append(replica.where)
    return taken


def _key_hash(key: str) -> int:
    """A key as a signed 64-bit number, the same in every process (``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)
