"""A session rank after a failed or interrupted cell: what was made with the world group made
usable again, and the replicas made equal (every rank gets ``Repair``, the group kept or made
again).

Stock torch cannot repair a process group in place, and a DDP wrapper whose backward was cut
short fails its next step ("Expected to have finished reduction in the prior iteration"), or,
on a group made again, waits on the old group's closed connections ("Connection closed by
peer"). So each rank moves every DDP wrapper it holds onto the current world group with its
reducer reset (``DistributedDataParallel._update_process_group``: private, pinned by
tests/session/test_work_kept.py), and every ZeroRedundancyOptimizer too, then compares the
state replicated by construction (see replicas) with the master's by a checksum taken where the
bytes live, and takes the master's bytes where they differ: a stop between one rank's optimizer
step and another's leaves replicas that DDP assumes equal. Sharded state (ZeRO's per-rank
shards, FSDP, DTensor shards) differs by design: it is left as each rank holds it, and named
where the cell may have left the shards out of step.

What a rank holds is walked at any depth, as a cell's registry is (``held``): a wrapper or a
subgroup in a dict, a list or an object's attribute is found, named by its path
(``nets['G']``) and put back there. The walk ends once it has found every object of the kinds
it acts on that the process holds (see held._Search).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from enot_nb._session.worker.groups import Subgroup
from enot_nb._state.kinds import Kind
from enot_nb._state.registry import Registry, user_variables
from enot_nb._state.states import object_dict, slots
from enot_nb._worker.held import DDP, HELD_KINDS, ZERO, imported_classes, reach, reached_through, tracked
from enot_nb._worker.replicas import Equalized, equalize, replicated_by_construction
from enot_nb.errors import DistributedRuntimeException

_NAMED_AT_MOST = 5
"""How many places a part of the repair's line names (then how many more)."""


def repair(namespace: dict[str, Any], lost: Sequence[Subgroup] = (), destroyed: bool = False) -> str | None:
    """Make the user's subgroups that an abort or a regroup destroyed (``lost``) again, put
    them back wherever the rank's variables held the old ones, guard the FSDP modules that
    cannot move (``destroyed``: every group was), rebind and equalize (see the module's
    docstring); a line for the notebook saying what was done, or None where nothing was."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    found = tracked(imported_classes(*HELD_KINDS))
    # Lost subgroups: every holder of each is wanted, so the walk goes to its end.
    held = reach(namespace, None if lost else found)
    remade = _remade(lost, held)
    parts = []
    if remade.names:
        parts.append(f"subgroup(s) {_listed(remade.names)} made again")
    guarded = _guard_sharded(held) if destroyed else []
    if guarded:
        parts.append(
            f"FSDP module(s) {_listed(guarded)} were sharded over the groups that are gone: using one "
            "raises an error that says how to shard it again"
        )
    wrapper, zero = imported_classes(DDP), imported_classes(ZERO)
    parts += _rebind(held, [o for o in found if isinstance(o, wrapper)], remade)
    parts += _move_zero(held, [o for o in found if isinstance(o, zero)], remade)
    replication = replicated_by_construction(held)
    equalized = equalize(replication.replicas)  # every rank, whatever it holds: a collective
    parts += _equalized(equalized)
    unsure = [str(s) for s in replication.sharded if s.where not in guarded]  # guarded: said above
    if unsure and (destroyed or equalized.taken or equalized.apart or equalized.apart_elsewhere):
        parts.append(
            f"sharded state {_listed(unsure)} was left as each rank holds it, and the cell stopped "
            "where its shards may be out of step with each other: load it from a checkpoint, or make it again, "
            "before training on"
        )
    return "enot_nb: " + "; ".join(parts) if parts else None


def _rebind(held: Registry, wrappers: list[Any], remade: _Remade) -> list[str]:
    """Every DDP wrapper the process holds (``wrappers``: a variable's or not, a wrapper left on
    a dead group would fail the next collective) onto the group it now belongs on, its reducer
    reset; what was done, a part of the line each."""
    import torch.distributed as dist

    world = dist.distributed_c10d._get_default_group()
    rebound, left = [], []
    for ddp in wrappers:
        group = remade.new.get(id(ddp.process_group)) or _group_to_rebind(ddp.process_group, world)
        if group is None:
            left.append(_name_of(ddp, held))
            continue
        ddp._update_process_group(group)  # the reducer reset too
        rebound.append(_name_of(ddp, held))
    parts = []
    if rebound:
        parts.append(f"DDP wrapper(s) {_listed(sorted(rebound))} rebound to the ranks' group (reducer reset)")
    if left:
        parts.append(
            f"DDP wrapper(s) {_listed(sorted(left))} were made on a subgroup that is gone: make them again "
            "(DistributedDataParallel(module, process_group=dist.new_group(...)))"
        )
    return parts


def _move_zero(held: Registry, optimizers: list[Any], remade: _Remade) -> list[str]:
    """Each ZeroRedundancyOptimizer onto the group it now belongs on, as a DDP wrapper is: it
    broadcasts each rank's shard of the parameters over its ``process_group`` at every step,
    and a group made again leaves it holding the old one ("Group ... is not registered"). Its
    shards stay as each rank holds them (see replicas)."""
    import torch.distributed as dist

    world = dist.distributed_c10d._get_default_group()
    moved, left = [], []
    for zero in optimizers:
        old = zero.process_group
        group = remade.new.get(id(old)) or _group_to_rebind(old, world)
        if group is None:
            left.append(_name_of(zero, held))
        elif group is not old:
            zero.process_group = group
            moved.append(_name_of(zero, held))
    parts = []
    if moved:
        parts.append(f"ZeroRedundancyOptimizer(s) {_listed(sorted(moved))} moved onto the ranks' group")
    if left:
        parts.append(
            f"ZeroRedundancyOptimizer(s) {_listed(sorted(left))} were made on a subgroup that is gone: make them "
            "again (ZeroRedundancyOptimizer(params, ..., process_group=dist.new_group(...)))"
        )
    return parts


def _equalized(done: Equalized) -> list[str]:
    """The parts of the line that say what ``equalize`` did and left."""
    parts = []
    if done.taken:
        parts.append(
            f"{len(done.taken)} replicated tensor storage(s) differed from the master's and were made equal to it "
            f"({_listed(done.taken)})"
        )
    if done.apart or done.apart_elsewhere:
        where = _listed(done.apart) if done.apart else f"{done.apart_elsewhere} that rank 0 does not hold"
        parts.append(
            f"replicated state held differently on the ranks was left as each rank holds it ({where}): make the "
            "DDP modules and their optimizers the same way on every rank"
        )
    return parts


class _Remade(NamedTuple):
    new: dict[int, Any]
    """Each lost group's new one, by the old one's id."""
    names: list[str]
    """Where the rank's variables held them (``sub``, ``groups['dp']``), or what they are."""


def _remade(lost: Sequence[Subgroup], held: Registry) -> _Remade:
    """Each lost subgroup made again from its recorded ranks, on every rank in the order they
    were first made (``new_group`` is a collective of the world group), and put wherever the
    rank's variables held the old one."""
    import torch.distributed as dist

    new: dict[int, Any] = {}
    names: list[str] = []
    for old in lost:
        if old.group in dist.distributed_c10d._world.pg_map:
            continue  # still alive: the group was kept
        group = dist.new_group(list(old.ranks), backend=old.backend)
        new[id(old.group)] = group
        found = _put_back(old.group, group, held)
        names += found or [f"a group of ranks {list(old.ranks)}"]
    return _Remade(new, names)


def _put_back(old: Any, new: Any, held: Registry) -> list[str]:
    """Bind ``new`` wherever ``held`` bound ``old``: a variable, a dict's value, a list's item,
    an object's attribute, at any depth; where (a tuple cannot take it: named, to be rebound).
    Torch's own holders (a DDP wrapper's or a ZeRO optimizer's ``process_group``) take it too,
    unnamed: the user made the group, not those attributes."""
    where = []
    for i, obj in enumerate(held.objects):
        path = held.path(i)
        for step, put in _places_of(old, obj, held.kinds[i]):
            if put is None:
                where.append(f"{path}{step} (a tuple's item: not put back, bind the new group there)")
                continue
            put(new)
            if not (getattr(type(obj), "__module__", None) or "").startswith("torch."):
                where.append(f"{path}{step}")
    return where


def _places_of(old: Any, obj: Any, kind: Kind) -> list[tuple[str, Callable[[Any], None] | None]]:
    """Where ``obj`` itself holds ``old``: each as (step, how to bind another object there), None
    where nothing can be bound (a tuple)."""
    if kind is Kind.NAMESPACE:
        return [(n, functools.partial(obj.__setitem__, n)) for n in sorted(user_variables(obj)) if obj[n] is old]
    found: list[tuple[str, Callable[[Any], None] | None]] = []
    if kind is Kind.DICT:
        found += [(f"[{k!r}]", functools.partial(obj.__setitem__, k)) for k, v in list(obj.items()) if v is old]
    elif kind in (Kind.LIST, Kind.DEQUE):
        found += [(f"[{n}]", functools.partial(obj.__setitem__, n)) for n, v in enumerate(list(obj)) if v is old]
    elif kind is Kind.TUPLE and isinstance(obj, tuple):
        found += [(f"[{n}]", None) for n, v in enumerate(obj) if v is old]
    if kind in (Kind.DICT, Kind.LIST, Kind.DEQUE, Kind.OBJECT):
        attributes = {**(object_dict(obj) or {}), **slots(obj)}
        found += [(f".{a}", functools.partial(setattr, obj, a)) for a, v in attributes.items() if v is old]
    return found


def _guard_sharded(held: Registry) -> list[str]:
    """Each outermost FSDP2 module the rank's variables hold, after every group was made again:
    FSDP cannot move onto a new group (its mesh holds the old ones), so its next forward raises
    an error naming where it is held and the line that shards it again, before FSDP's own hook
    meets a dead group (a transport error blaming a healthy rank). Where they are held."""
    sharded_type = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if not isinstance(sharded_type, type):
        return []
    guarded = []
    for i, obj in enumerate(held.objects):
        if isinstance(obj, sharded_type) and not reached_through(held, i, (sharded_type,)):
            name = held.path(i)
            held.objects[i].register_forward_pre_hook(_unusable(name), prepend=True)
            guarded.append(name)
    return guarded


def _unusable(name: str) -> Any:
    def refuse(module: Any, args: Any) -> None:
        raise DistributedRuntimeException(
            f"{name} is sharded (FSDP) over the ranks' process groups that were made again after a failed "
            f"or interrupted cell, and FSDP cannot move onto new groups: make it again and shard it, e.g. "
            f"`{name} = fully_shard(build_model())` (the notebook holds its last whole values: "
            f"`%enot_pull {name.split('.')[0].split('[')[0]}` before, then load them)"
        )

    return refuse


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


def _name_of(obj: Any, held: Registry) -> str:
    """Where the rank's variables hold ``obj`` (``ddp``, ``nets['G']``, ``trainer.model``), or its type."""
    i = held.find(obj)
    return held.path(i) if i is not None else f"a {type(obj).__name__}"


def _listed(places: list[str]) -> str:
    shown = ", ".join(places[:_NAMED_AT_MOST])
    return shown + (f" and {len(places) - _NAMED_AT_MOST} more" if len(places) > _NAMED_AT_MOST else "")
