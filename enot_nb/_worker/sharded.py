"""Sharded models come back whole: a module sharded by FSDP2 (``fully_shard``) or holding DTensor
parameters is made the plain module again on the master before its changes are collected.

Why: the notebook had a plain module; after a cell that shards and trains it, the master holds
an ``FSDP<Class>`` whose parameters are DTensors over the workers' process group, with FSDP's
hooks on it. Sent back as it is, the notebook got a half-converted module that fails its first
``model(x)`` ("got mixed torch.Tensor and DTensor"). At the end of the cell, on every rank::

    the sharded modules the cell's names hold, and the optimizers over their parameters
      -> the ranks agree on them (a digest of their names, as tensors: nothing unpickled)
      -> get_model_state_dict / get_optimizer_state_dict, full, offloaded to the CPU from GPUs
         (collectives: only rank 0 keeps the values)
    master: each module back to its own class (FSDP's is ``FSDP<Class>(FSDPModule, Class)``),
            FSDP's hooks and flags removed, every parameter the notebook's original object again
            (matched by name) holding the full trained values; each optimizer over those
            parameters, its state unsharded

On an interrupt or a failure only the master runs (no collective is possible): the modules are
put back as they were before the cell (``restore_as_before``), and one line says so.

A session's ranks keep their sharded modules live (its cells do not gather them): what the
master changed under one stays out of its changes (``left_sharded``), and the notebook keeps its
own module as it was, stale, one line naming it.
"""

from __future__ import annotations

import sys
import warnings
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


def may_be_sharded() -> bool:
    """Whether FSDP or DTensor is imported here (as on every rank: forked from one kernel, and
    running one cell): else nothing can be sharded, and no collective is spent on asking."""
    return any(name in sys.modules for name in ("torch.distributed.fsdp", "torch.distributed.tensor"))


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


SHARDED_ON_THE_RANKS = (
    "it is sharded (FSDP2 or DTensors) on the session's ranks, which keep it so; the notebook keeps "
    "its own as it was (pull it whole: %enot_pull NAME)"
)


def left_sharded(registry: Any, namespace: dict[str, Any], changed: list[int], changes: Any) -> dict[str, str]:
    """A session master's cell (its modules stay sharded): every change under a sharded module
    the namespace holds (the module, what is registered below it, their storages) taken out of
    ``changes`` and ``changed`` (in place), and its name out of the names bound; the names,
    each with why. A half-converted module (FSDP's class and hooks on the notebook's plain
    parameters) is what the notebook would get otherwise."""
    from enot_nb._serialize.tensors import tensor_storages
    from enot_nb._state.kinds import OPS

    names = sharded_names(namespace, list(namespace))
    if not names:
        return {}
    root = {i: n for n in names if (i := registry.find(namespace[n])) is not None}
    under = dict(root)  # each object under a sharded module, to its name
    for i in range(1, len(registry.objects)):  # a parent is registered before its children
        parent = registry.parents[i][0]
        if parent in under and i not in under:
            under[i] = under[parent]
    storages = {
        registry.find_storage(s): name
        for i, name in under.items()
        if OPS[registry.kinds[i]].has_storage
        for s in tensor_storages(registry.objects[i])
    }
    moved = {under[i] for i in changed if i in under} | {
        storages[n.storage] for n in changes.storages if n.storage in storages
    }
    moved |= {n for n in names if n in changes.bound}
    changed[:] = [i for i in changed if i not in under]
    changes.objects = [(i, state) for i, state in changes.objects if i not in under]
    changes.storages = [new for new in changes.storages if new.storage not in storages]
    for name in names:
        changes.bound.pop(name, None)
    return dict.fromkeys(sorted(moved), SHARDED_ON_THE_RANKS)  # only what changed: a read leaves it current


def full_state_dicts(namespace: dict[str, Any], names: list[str]) -> dict[str, dict[str, Any]]:
    """Every rank, for a session's pull: the full values of the sharded modules among ``names``
    (``get_model_state_dict``, a collective every rank joins; offloaded to the CPU from GPUs),
    on the master, by name; the ranks' live modules stay sharded. {} on the other ranks, or
    where none is sharded (then no collective is spent)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {}
    modules = sharded_names(namespace, [n for n in names if n in namespace])
    if not modules:
        return {}
    if not _agreed({name: [] for name in modules}):
        raise RuntimeError(
            f"pull: the ranks hold different sharded modules among {', '.join(map(repr, names))}; "
            "pull the same ones on every rank"
        )
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = {}
    for name in modules:
        module = namespace[name]
        with warnings.catch_warnings():  # FSDP's own deprecations
            warnings.simplefilter("ignore")
            values = get_model_state_dict(module, options=_full_options(module))
        # Each its own copy: a gathered tensor may view a buffer FSDP frees (resizes to nothing)
        # once the next parameter is gathered, and it would travel as a view of nothing.
        full[name] = {key: _own_copy(value) for key, value in values.items()}
    return full if dist.get_rank() == 0 else {}


def load_plain_changes(module: Any, training: dict[str, bool], values: dict[str, Any] | None) -> None:
    """A module sharded here takes the notebook's plain copy's training flags and, if given, its
    full values (``set_model_state_dict``: a collective every rank joins, each keeping its shard)."""
    for name, sub in module.named_modules():
        if name in training:
            sub.training = training[name]
    if values is None:
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    with warnings.catch_warnings():  # FSDP's own deprecations
        warnings.simplefilter("ignore")
        set_model_state_dict(module, values, options=StateDictOptions(full_state_dict=True))


def _full_options(module: Any) -> Any:
    """Full state dicts, offloaded to the CPU (and to rank 0 alone) from GPUs; FSDP1 over CPU
    tensors fails to offload ("setStorage ... out of bounds", torch 2.13), and needs no copy
    anyway."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    on_gpu = any(p.device.type != "cpu" for p in module.parameters())
    return StateDictOptions(full_state_dict=True, cpu_offload=on_gpu)


def _own_copy(value: Any) -> Any:
    import torch

    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def sharded_names(namespace: dict[str, Any], names: list[str]) -> list[str]:
    """The names holding a sharded module (FSDP2, DTensors) or an FSDP1 wrapper."""
    import torch

    wrapper = _fsdp1_type()
    return [
        n
        for n in sorted(names)
        if isinstance(namespace.get(n), torch.nn.Module)
        and (is_sharded(namespace[n]) or wrapper is not None and isinstance(namespace[n], wrapper))
    ]


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
    if not modules:  # no collective: a rank that holds none may finish and exit at once
        return []
    plan = optimizers_over(namespace, names, modules)
    try:
        if not _agreed(plan):
            return [
                "the ranks hold different sharded modules or optimizers, so none was gathered; "
                "they come back as the master holds them (return or keep the same ones on every rank)"
            ]
        _gather_each(namespace, modules, plan, before)
    except Exception as err:  # noqa: BLE001 - the rest of the cell's state still comes back
        return [
            f"the sharded modules {', '.join(modules)} could not be gathered ({type(err).__name__}: {err}); "
            "they come back as the master holds them"
        ]
    return []


def _gather_each(
    namespace: dict[str, Any], modules: list[str], plan: dict[str, list[str]], before: dict[str, dict[str, Any]]
) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    for name in modules:
        module = namespace[name]
        options = _full_options(module)
        with warnings.catch_warnings():  # FSDP's own deprecations: a local cell would not see them
            warnings.simplefilter("ignore")
            full = get_model_state_dict(module, options=options)
            opt_states = {o: get_optimizer_state_dict(module, namespace[o], options=options) for o in plan[name]}
        if dist.get_rank() == 0:
            made = _make_whole(namespace, name, before, full)
            for opt_name, state in opt_states.items():
                _unshard_optimizer(namespace[opt_name], made, state)


def _make_whole(namespace: dict[str, Any], name: str, before: dict[str, dict[str, Any]], full: dict[str, Any]) -> Any:
    """The master: the module at ``name`` made plain with ``full``'s values. An FSDP1 wrapper
    (``FullyShardedDataParallel(model)``) stays the worker's, as DDP does; the module it wraps,
    the notebook's ``model``, is made plain."""
    module, wrapper = namespace[name], _fsdp1_type()
    if wrapper is not None and isinstance(module, wrapper):
        inner = _unwrapped(module)
        return _unflatten(inner, _originals_of(inner, namespace, before), full)
    return make_plain(module, before.get(name, {}), full)


def _fsdp1_type() -> Any:
    module = sys.modules.get("torch.distributed.fsdp")
    return getattr(module, "FullyShardedDataParallel", None)


def _originals_of(module: Any, namespace: dict[str, Any], before: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The tensors ``module`` held before the cell (see originals), found by the name that holds it."""
    held = next((n for n, v in namespace.items() if v is module and n in before), None)
    return before[held] if held is not None else {}


def _remove_fsdp_flags(module: Any) -> None:
    """The attributes FSDP set on a module: its flags and the composable API's state keys."""
    for key in [k for k in module.__dict__ if k in _FSDP_KEYS or k.startswith(_COMPOSABLE_KEY)]:
        del module.__dict__[key]


def _unwrapped(module: Any) -> Any:
    """The module an FSDP1 wrapper wraps, with the wrappers FSDP put in place of its submodules
    (an auto-wrap policy) replaced by the submodules they wrap."""
    wrapper = _fsdp1_type()
    while isinstance(module, wrapper):
        module = module.module
    for sub in module.modules():
        for key, child in list(sub._modules.items()):
            while isinstance(child, wrapper):
                child = child.module
            sub._modules[key] = child
    return module


def _unflatten(module: Any, originals: dict[str, Any], full: dict[str, Any] | None) -> dict[str, Any]:
    """FSDP1 moved the parameters into flat ones on its wrappers and left views as plain
    attributes: each original (by qualified name) is put back, holding ``full``'s values (None:
    the values it had before the cell)."""
    import torch

    flat = getattr(sys.modules.get("torch.distributed.fsdp._flat_param"), "FlatParameter", None)
    for sub in module.modules():
        _remove_fsdp_flags(sub)
        for key in [k for k, p in sub._parameters.items() if flat is not None and isinstance(p, flat)]:
            del sub._parameters[key]  # FSDP1's flat parameter, registered on the module it wraps
    now: dict[str, Any] = {}
    for qualified, values in (full if full is not None else dict.fromkeys(originals)).items():
        prefix, _, leaf = qualified.rpartition(".")
        sub = module.get_submodule(prefix) if prefix else module
        original = originals.get(qualified)
        if original is None:
            if values is None:
                continue
            original = torch.nn.Parameter(values) if qualified not in dict(module.named_buffers()) else values
        elif values is not None:
            with torch.no_grad():
                original.data = values
        sub.__dict__.pop(leaf, None)
        table = sub._parameters if isinstance(original, torch.nn.Parameter) else sub._buffers
        table[leaf] = original
        now[qualified] = original
    return now


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
        _remove_fsdp_flags(sub)
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


def _unshard_optimizer(optimizer: Any, now: dict[str, Any], full: dict[str, Any]) -> None:
    """The optimizer over the plain parameters, in the full state's groups (its parameters by
    qualified name: an FSDP1 flat parameter was many), its state unsharded."""
    replaced: dict[int, Any] = {}  # id of the sharded parameter -> the plain one
    for group, named in zip(optimizer.param_groups, full.get("param_groups", [])):
        if len(named["params"]) == len(group["params"]):  # FSDP2: one name per parameter, in order
            pairs = [(p, now.get(q, p)) for p, q in zip(group["params"], named["params"])]
        else:  # FSDP1: a flat parameter was many; the group becomes its parameters, by name
            pairs = [(None, now[q]) for q in named["params"] if q in now]
        replaced.update((id(old), new) for old, new in pairs if old is not None)
        group["params"] = [new for _, new in pairs]
    in_groups = {id(p) for group in optimizer.param_groups for p in group["params"]}
    state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    for param, values in optimizer.state.items():  # those of another module's parameters stay
        if id(param) in in_groups and id(param) not in replaced:
            state[param] = values
    for qualified, values in full.get("state", {}).items():
        if qualified in now:
            state[now[qualified]] = dict(values)
    optimizer.state = state


def restore_as_before(
    namespace: dict[str, Any], before: dict[str, dict[str, Any]], bound_before: dict[str, Any]
) -> dict[str, str]:
    """Only the master runs (an interrupt, a failure): no collective can gather the shards, so
    each sharded module is put back as it was before the cell, and a name the cell bound to a
    new sharded module, or to an optimizer over shards, gets its old value back (or none).
    Returns each such name with why."""
    modules = sharded_names(namespace, list(namespace))
    wrapper = _fsdp1_type()
    for name in modules:
        if wrapper is not None and isinstance(namespace[name], wrapper):
            inner = _unwrapped(namespace[name])
            _unflatten(inner, _originals_of(inner, namespace, before), None)
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
    """Optimizers over DTensors (FSDP2) or FSDP1's flat parameters."""
    import torch

    flat = getattr(sys.modules.get("torch.distributed.fsdp._flat_param"), "FlatParameter", None)
    shard_types = tuple(t for t in (_dtensor_type(), flat) if t is not None)
    if not shard_types:
        return []
    return [
        name
        for name, value in namespace.items()
        if isinstance(value, torch.optim.Optimizer)
        and any(isinstance(p, shard_types) for group in value.param_groups for p in group["params"])
    ]
