"""Sharded models come back whole: a module sharded by FSDP2 (``fully_shard``) or holding DTensor
parameters is made the plain module again on the master before its changes are collected.

Why: the notebook had a plain module; after a cell that shards and trains it, the master holds
an ``FSDP<Class>`` whose parameters are DTensors over the workers' process group, with FSDP's
hooks on it. Sent back as it is, the notebook got a half-converted module that fails its first
``model(x)`` ("got mixed torch.Tensor and DTensor"). At the end of the cell, on every rank::

    the sharded modules the cell's names hold, and the optimizers over their parameters
      -> the ranks agree on them (a digest of their names, as tensors: nothing unpickled)
      -> get_model_state_dict / get_optimizer_state_dict, full and offloaded to the CPU
         (collectives: only rank 0 receives the values)
    master: each module back to its own class (FSDP's is ``FSDP<Class>(FSDPModule, Class)``),
            FSDP's hooks and flags removed, every parameter the notebook's original object again
            (matched by name) holding the full trained values; each optimizer over those
            parameters, its state unsharded

On an interrupt or a failure only the master runs (no collective is possible): the modules are
put back as they were before the cell (``restore_as_before``), and one line says so.
"""

from __future__ import annotations

import sys
import zlib
from collections import defaultdict
from typing import Any

_FSDP_KEYS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
_COMPOSABLE_KEY = "__composable_api_state_key"
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
"""Tables keyed by a hook's id that say how torch calls it."""


def _dtensor_type() -> Any:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _fsdp_module_type() -> Any:
    module = sys.modules.get("torch.distributed.fsdp")
    return getattr(module, "FSDPModule", None)


def is_sharded(module: Any) -> bool:
    """A module that FSDP2 sharded, or that holds DTensor parameters or buffers."""
    fsdp, dtensor = _fsdp_module_type(), _dtensor_type()
    if fsdp is None and dtensor is None:  # neither imported: nothing can be sharded
        return False
    for sub in module.modules():
        if fsdp is not None and isinstance(sub, fsdp):
            return True
        held = (*sub._parameters.values(), *sub._buffers.values())
        if dtensor is not None and any(isinstance(t, dtensor) for t in held):
            return True
    return False


def originals(namespace: dict[str, Any], names: set[str]) -> dict[str, dict[str, Any]]:
    """Before the cell: each module's parameters and buffers by qualified name (the objects the
    notebook holds), for the modules among ``names``."""
    import torch

    found = {}
    for name in sorted(names):
        value = namespace.get(name)
        if isinstance(value, torch.nn.Module):
            tensors: dict[str, Any] = dict(value.named_parameters(remove_duplicate=False))
            tensors.update(value.named_buffers(remove_duplicate=False))
            found[name] = tensors
    return found


def sharded_names(namespace: dict[str, Any], names: list[str]) -> list[str]:
    import torch

    return [n for n in sorted(names) if isinstance(namespace.get(n), torch.nn.Module) and is_sharded(namespace[n])]


def optimizers_over(namespace: dict[str, Any], names: list[str], modules: list[str]) -> dict[str, list[str]]:
    """For each sharded module, the optimizers (by name) over its parameters."""
    import torch

    found: dict[str, list[str]] = {m: [] for m in modules}
    for module_name in modules:
        params = {id(p) for p in namespace[module_name].parameters()}
        for name in sorted(names):
            value = namespace.get(name)
            if isinstance(value, torch.optim.Optimizer) and any(
                id(p) in params for group in value.param_groups for p in group["params"]
            ):
                found[module_name].append(name)
    return found


def whole_result(result: Any) -> Any:
    """Every rank, once a launched function returned: the sharded modules in its result (the
    result itself, or an item of a returned dict, list or tuple) made whole on the master, as a
    cell's are (see gather_whole). The ranks must return the same shape of result."""
    if isinstance(result, dict):
        top = {f"[{k!r}]": v for k, v in result.items()}
    elif isinstance(result, (list, tuple)):
        top = {f"[{i}]": v for i, v in enumerate(result)}
    else:
        top = {"the result": result}
    for line in gather_whole(top, sorted(top), {}):
        print(f"enot_nb: {line}", file=sys.stderr)
    return result


def _agreed(plan: dict[str, list[str]]) -> bool:
    """Whether every rank found the same modules and optimizers: a digest of their names, reduced
    as a tensor (min and max), never exchanged as pickled objects."""
    import torch
    import torch.distributed as dist

    text = ";".join(f"{m}:{','.join(o)}" for m, o in sorted(plan.items()))
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    digest = torch.tensor([zlib.crc32(text.encode())], dtype=torch.int64, device=device)
    low, high = digest.clone(), digest.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(low == high)


def gather_whole(namespace: dict[str, Any], names: list[str], before: dict[str, dict[str, Any]]) -> list[str]:
    """Every rank, at the end of a cell that succeeded: make the sharded modules whole on the
    master (see the module's docstring). Returns lines for the notebook (what could not be)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    modules = sharded_names(namespace, names)
    plan = optimizers_over(namespace, names, modules)
    if not _agreed(plan):
        return [
            "the ranks hold different sharded modules or optimizers, so none was gathered; "
            "they come back as the master holds them"
        ]
    if not modules:
        return []
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for name in modules:
        module = namespace[name]
        full = get_model_state_dict(module, options=options)
        opt_states = {o: get_optimizer_state_dict(module, namespace[o], options=options) for o in plan[name]}
        if dist.get_rank() == 0:
            by_id = {id(p): q for q, p in module.named_parameters(remove_duplicate=False)}
            made = make_plain(module, before.get(name, {}), full)
            for opt_name, state in opt_states.items():
                _unshard_optimizer(namespace[opt_name], by_id, made, state)
    return []


def make_plain(module: Any, originals: dict[str, Any], full: dict[str, Any] | None) -> dict[str, Any]:
    """Make ``module`` the plain module again: its classes, hooks and flags as before FSDP, each
    sharded parameter or buffer the notebook's original object (by qualified name) holding
    ``full``'s values (None: keep the values it had before the cell). Returns the tensor now at
    each qualified name."""
    import torch

    dtensor, fsdp = _dtensor_type(), _fsdp_module_type()
    now: dict[str, Any] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if fsdp is not None and isinstance(sub, fsdp):
            sub.__class__ = next(c for c in type(sub).__mro__ if not issubclass(c, fsdp))
        _remove_fsdp_hooks(sub)
        for key in [k for k in sub.__dict__ if k in _FSDP_KEYS or k.startswith(_COMPOSABLE_KEY)]:
            del sub.__dict__[key]
        for table, make in ((sub._parameters, _as_parameter), (sub._buffers, _as_buffer)):
            for leaf, tensor in list(table.items()):
                qualified = f"{prefix}.{leaf}" if prefix else leaf
                if dtensor is not None and isinstance(tensor, dtensor):
                    original = originals.get(qualified)
                    values = None if full is None else full.get(qualified)
                    if original is not None:
                        if values is not None:
                            with torch.no_grad():
                                original.data = values
                        table[leaf] = original
                    elif values is not None:
                        table[leaf] = make(values, tensor)
                now[qualified] = table[leaf]
    return now


def _as_parameter(values: Any, sharded: Any) -> Any:
    import torch

    return torch.nn.Parameter(values, requires_grad=sharded.requires_grad)


def _as_buffer(values: Any, sharded: Any) -> Any:
    return values


def _remove_fsdp_hooks(module: Any) -> None:
    """FSDP's forward and state-dict hooks (by the module that defined them), with their ids in
    the with-kwargs and always-called tables."""
    for table in [v for k, v in vars(module).items() if k.endswith("hooks") and isinstance(v, dict)]:
        for key, hook in list(table.items()):
            owner = getattr(hook, "__module__", None) or type(hook).__module__
            if isinstance(owner, str) and owner.startswith("torch.distributed"):
                del table[key]
                for extra in _HOOK_FLAGS:
                    vars(module).get(extra, {}).pop(key, None)


def _unshard_optimizer(optimizer: Any, qualified_of: dict[int, str], now: dict[str, Any], full: dict[str, Any]) -> None:
    """The optimizer over the plain parameters, its state the full (unsharded) state by name."""
    for group in optimizer.param_groups:
        group["params"] = [now.get(qualified_of.get(id(p), ""), p) for p in group["params"]]
    name_of = {id(t): q for q, t in now.items()}
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = name_of.get(id(p))
            if name is not None and name in full.get("state", {}):
                state[p] = dict(full["state"][name])
    optimizer.state = state


def restore_as_before(
    namespace: dict[str, Any], before: dict[str, dict[str, Any]], bound_before: dict[str, Any]
) -> dict[str, str]:
    """Only the master runs (an interrupt, a failure): no collective can gather the shards, so
    each sharded module is put back as it was before the cell, and a name the cell bound to a
    new sharded module, or to an optimizer over shards, gets its old value back (or none).
    Returns each such name with why."""
    modules = sharded_names(namespace, list(namespace))
    for name in modules:
        if name in before and namespace[name] is bound_before.get(name):
            make_plain(namespace[name], before[name], None)
        elif name in bound_before:
            namespace[name] = bound_before[name]
        else:
            del namespace[name]
    optimizers = _optimizers_over_shards(namespace)
    for name in optimizers:  # over DTensors: it cannot drive the notebook's plain parameters
        if name in bound_before:
            namespace[name] = bound_before[name]
        else:
            del namespace[name]
    why = "only the master got to save its state, and it alone cannot gather the shards"
    return {
        **{m: f"it was sharded (FSDP) and {why}; the notebook keeps it as it was before the cell" for m in modules},
        **{o: f"it is over sharded (FSDP) parameters and {why}" for o in optimizers},
    }


def _optimizers_over_shards(namespace: dict[str, Any]) -> list[str]:
    import torch

    dtensor = _dtensor_type()
    if dtensor is None:
        return []
    return [
        name
        for name, value in namespace.items()
        if isinstance(value, torch.optim.Optimizer)
        and any(isinstance(p, dtensor) for group in value.param_groups for p in group["params"])
    ]
