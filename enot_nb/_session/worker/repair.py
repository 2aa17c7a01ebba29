"""A session rank after a failed or interrupted cell: what was made with the world group made
usable again, and the replicas made equal (every rank gets ``Repair``, the group kept or made
again).

Stock torch cannot repair a process group in place, and a DDP wrapper whose backward was cut
short fails its next step ("Expected to have finished reduction in the prior iteration"), or,
on a group made again, waits on the old group's closed connections ("Connection closed by
peer"). So each rank moves every DDP wrapper it holds onto the current world group with its
reducer reset (``DistributedDataParallel._update_process_group``: private, pinned by
tests/session/test_work_kept.py), then compares its replicated state (the wrapped modules' parameters
and buffers, and the state of the optimizers over them) with the master's by a checksum taken
where the bytes live, and takes the master's bytes where they differ: a stop between one rank's
optimizer step and another's leaves replicas that DDP assumes equal. Sharded state (FSDP,
ZeRO's per-rank shards) differs by design and is left alone.
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Sequence
from typing import Any, NamedTuple

from enot_nb._memory.digests import device_checksum
from enot_nb._session.worker.groups import Subgroup
from enot_nb.errors import DistributedRuntimeException


def repair(namespace: dict[str, Any], lost: Sequence[Subgroup] = (), destroyed: bool = False) -> str | None:
    """Make the user's subgroups that an abort or a regroup destroyed (``lost``) again, put
    them back where the namespace held the old ones, guard the FSDP modules that cannot move
    (``destroyed``: every group was), rebind and equalize (see the module's docstring); a line
    for the notebook saying what was done, or None where nothing was."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    remade = _remade(lost, namespace)
    parts = []
    if remade.names:
        parts.append(f"subgroup(s) {', '.join(remade.names)} made again")
    guarded = _guard_sharded(namespace) if destroyed else []
    if guarded:
        parts.append(
            f"FSDP module(s) {', '.join(guarded)} were sharded over the groups that are gone: using one "
            "raises an error that says how to shard it again"
        )
    ddp_type = _ddp_type()
    if ddp_type is not None:
        parts += _rebind_and_equalize(namespace, ddp_type, remade)
    return "enot_nb: " + "; ".join(parts) if parts else None


def _rebind_and_equalize(namespace: dict[str, Any], ddp_type: Any, remade: _Remade) -> list[str]:
    """Every DDP wrapper onto the group it now belongs on, its reducer reset; the replicas made
    the master's where they differ; what was done, a part of the line each."""
    import torch.distributed as dist

    world = dist.distributed_c10d._get_default_group()
    rebound, left = [], []
    for ddp in [o for o in gc.get_objects() if isinstance(o, ddp_type)]:
        group = remade.new.get(id(ddp.process_group)) or _group_to_rebind(ddp.process_group, world)
        if group is None:
            left.append(_name_of(ddp, namespace))
            continue
        ddp._update_process_group(group)  # the reducer reset too
        rebound.append(_name_of(ddp, namespace))
    taken = equalize(_replicated(namespace, ddp_type))
    parts = []
    if rebound:
        parts.append(f"DDP wrapper(s) {', '.join(sorted(rebound))} rebound to the ranks' group (reducer reset)")
    if left:
        parts.append(
            f"DDP wrapper(s) {', '.join(sorted(left))} were made on a subgroup that is gone: make them again "
            "(DistributedDataParallel(module, process_group=dist.new_group(...)))"
        )
    if taken:
        parts.append(f"{taken} replicated tensor storage(s) differed from the master's and were made equal to it")
    return parts


class _Remade(NamedTuple):
    new: dict[int, Any]
    """Each lost group's new one, by the old one's id."""
    names: list[str]
    """Where the namespace held them (``sub``, ``trainer.group``), or what they are."""


def _remade(lost: Sequence[Subgroup], namespace: dict[str, Any]) -> _Remade:
    """Each lost subgroup made again from its recorded ranks, on every rank in the order they
    were first made (``new_group`` is a collective of the world group), and put where the
    namespace, or an object it holds, held the old one."""
    import torch.distributed as dist

    new: dict[int, Any] = {}
    names: list[str] = []
    for old in lost:
        if old.group in dist.distributed_c10d._world.pg_map:
            continue  # still alive: the group was kept
        group = dist.new_group(list(old.ranks), backend=old.backend)
        new[id(old.group)] = group
        found = _put_back(old.group, group, namespace)
        names += found or [f"a group of ranks {list(old.ranks)}"]
    return _Remade(new, names)


def _put_back(old: Any, new: Any, namespace: dict[str, Any]) -> list[str]:
    """Bind ``new`` wherever the namespace, or an object it holds, bound ``old``; where."""
    where = []
    for name, value in sorted(namespace.items()):
        if value is old:
            namespace[name] = new
            where.append(name)
            continue
        for attribute, held in _attributes(value):
            if held is old:
                setattr(value, attribute, new)
                where.append(f"{name}.{attribute}")
    return where


def _guard_sharded(namespace: dict[str, Any]) -> list[str]:
    """Each FSDP2 module the namespace holds, after every group was made again: FSDP cannot move
    onto a new group (its mesh holds the old ones), so its next forward raises an error naming
    the variable and the line that shards it again, before FSDP's own hook meets a dead group
    (a transport error blaming a healthy rank). The names guarded."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    sharded_type = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if sharded_type is None:
        return []
    guarded = []
    for name, value in sorted(namespace.items()):
        if isinstance(value, sharded_type):
            value.register_forward_pre_hook(_unusable(name), prepend=True)
            guarded.append(name)
    return guarded


def _unusable(name: str) -> Any:
    def refuse(module: Any, args: Any) -> None:
        raise DistributedRuntimeException(
            f"{name} is sharded (FSDP) over the ranks' process groups that were made again after a failed "
            f"or interrupted cell, and FSDP cannot move onto new groups: make it again and shard it, e.g. "
            f"`{name} = fully_shard(build_model())` (the notebook holds its last whole values: "
            f"`%enot_pull {name}` before, then load them)"
        )

    return refuse


def _ddp_type() -> Any:
    module = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(module, "DistributedDataParallel", None) if module is not None else None


def _group_to_rebind(group: Any, world: Any) -> Any:
    """The group a wrapper goes on: its own where it still lives (the reducer is reset on it),
    the world group where its own was the world group that is gone, None where it was a subgroup
    that is gone."""
    import torch.distributed as dist

    if group is None or group is world or group in dist.distributed_c10d._world.pg_map:
        return world if group is None else group
    try:
        spanned_the_world = group.size() == world.size()
    except RuntimeError:  # an aborted group that no longer answers
        spanned_the_world = False
    return world if spanned_the_world else None


def _name_of(obj: Any, namespace: dict[str, Any]) -> str:
    """The variable that holds ``obj``, or an attribute of one (``trainer.model``), or its type."""
    for name, value in sorted(namespace.items()):
        if value is obj:
            return name
    for name, value in sorted(namespace.items()):
        for attribute, held in _attributes(value):
            if held is obj:
                return f"{name}.{attribute}"
    return f"a {type(obj).__name__}"


def _attributes(value: Any) -> list[tuple[str, Any]]:
    """An object's own attributes, by name (a Trainer's ``.model``, a Fabric wrapper's module);
    none of a module's, a class's or a function's: those hold no wrapper of a user's."""
    if isinstance(value, types.ModuleType | type | types.FunctionType):
        return []
    held = getattr(value, "__dict__", None)
    return sorted(held.items()) if isinstance(held, dict) else []


def _replicated(namespace: dict[str, Any], ddp_type: Any) -> list[Any]:
    """The storages every rank holds a replica of, in one order on every rank (by the names
    that reach them): each DDP wrapper's module's parameters and buffers, then the tensors in
    the state of the optimizers over them (not ZeRO's: sharded by design)."""
    import torch

    wrappers, optimizers = [], []
    for _, value in sorted(namespace.items(), key=lambda item: item[0]):
        for held in (value, *[v for _, v in _attributes(value)]):
            if isinstance(held, ddp_type) and held not in wrappers:
                wrappers.append(held)
            elif isinstance(held, torch.optim.Optimizer) and held not in optimizers:
                if type(held).__name__ != "ZeroRedundancyOptimizer":
                    optimizers.append(held)
    storages: dict[int, Any] = {}
    replicated_params = set()
    for ddp in wrappers:
        for tensor in (*ddp.module.parameters(), *ddp.module.buffers()):
            replicated_params.add(id(tensor))
            storages.setdefault(id(tensor.untyped_storage()), tensor.untyped_storage())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) not in replicated_params:
                    continue
                for _, value in sorted(optimizer.state.get(param, {}).items(), key=lambda item: str(item[0])):
                    if isinstance(value, torch.Tensor):
                        storages.setdefault(id(value.untyped_storage()), value.untyped_storage())
    return list(storages.values())


def equalize(storages: list[Any]) -> int:
    """Each storage compared with the master's by a checksum (taken on its own device); where
    one rank's differs, every rank takes the master's bytes (a broadcast over the world group).
    The number of storages taken; none where the ranks do not hold the same storages."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    counts = torch.tensor([len(storages), -len(storages)], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if int(counts[0]) != len(storages) or -int(counts[1]) != len(storages):
        return 0  # the ranks hold different replicas: nothing to compare them by
    if not storages:
        return 0
    sums = torch.tensor([device_checksum(s)[1] for s in storages], dtype=torch.int64, device=device)
    masters = sums.clone()
    dist.broadcast(masters, 0)
    differ = (sums != masters).to(torch.int64)
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)  # every rank takes part in every broadcast
    taken = 0
    for storage, different in zip(storages, differ.tolist()):
        if different:
            data = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            if data.device == device:
                dist.broadcast(data, 0)
            else:  # a CPU replica under nccl: through the device
                moved = data.to(device)
                dist.broadcast(moved, 0)
                data.copy_(moved)
            taken += 1
    return taken
