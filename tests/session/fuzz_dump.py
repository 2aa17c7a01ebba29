"""A canonical dump of a user namespace, the session fuzzer's probe (tests/session/fuzz.py).

The same function runs in the reference shell, in the session's kernel and on every rank; two
namespaces that a user could not tell apart dump equal. It records:

* tensors and NumPy arrays bitwise (a digest of their bytes), with dtype, shape, strides, offset,
  ``requires_grad`` and ``.grad``, and which of them share memory (groups of overlapping address
  ranges, numbered in the order met, with each one's byte offset in its group);
* identities: a mutable object met again is a reference to its first visit (an optimizer's params
  being the model's, ``last is log[-1]``);
* modules (parameters, buffers, submodules, ``training``, plain attributes), optimizers (groups,
  and state in the order of their params), schedulers, dataclasses, ``__slots__`` objects,
  containers (dicts in insertion order, sets as sorted dumps).
"""

from __future__ import annotations

import hashlib
import re
import types
from typing import Any

import numpy as np
import torch

_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
_ATOMS = (int, float, complex, str, bytes, bool, type(None))
_IPYTHON = re.compile(r"^(_|__|___|_i|_ii|_iii|_i\d+|_\d+|_dh|_oh|_ih|In|Out|exit|quit|get_ipython|__\w+__)$")


def user_names(ns: dict[str, Any], skip: Any = frozenset()) -> list[str]:
    """The user's names, sorted (IPython's own, private ``_fuzz`` ones and ``skip`` left out)."""
    return sorted(
        n
        for n, v in ns.items()
        if isinstance(n, str)
        and not _IPYTHON.match(n)
        and not n.startswith("_fuzz")
        and n not in skip
        and not isinstance(v, types.ModuleType)
        and not type(v).__module__.startswith(("enot_nb", "IPython"))
    )


def dump(
    ns: dict[str, Any], skip: Any = frozenset(), names: list[str] | None = None, grads: bool = True
) -> dict[str, Any]:
    """The namespace's user variables (or ``names``), dumped (see the module's docstring).
    ``grads``: with each tensor's ``.grad`` (a stop press between one rank's backward and
    another's leaves them apart; the replicas are their values and optimizer state)."""
    dumper = _Dumper(grads)
    out = {name: dumper.value(ns[name]) for name in (names if names is not None else user_names(ns, skip))}
    dumper.number_memory()
    return out


class _Dumper:
    def __init__(self, grads: bool = True) -> None:
        self.grads = grads
        self.seen: dict[int, int] = {}
        self.keep: list[Any] = []  # keeps ids unique while dumping
        self.memory: list[tuple[int, int, list[Any]]] = []  # (lo, hi, the slot to fill)

    def _first(self, obj: Any) -> int | None:
        """The object's number if met before; else None (and it is numbered now)."""
        if id(obj) in self.seen:
            return self.seen[id(obj)]
        self.seen[id(obj)] = len(self.seen)
        self.keep.append(obj)
        return None

    def value(self, x: Any) -> Any:
        if isinstance(x, _ATOMS):
            return [type(x).__name__, repr(x)]
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return ["tuple", [self.value(v) for v in x]]
        if isinstance(x, frozenset):
            return ["frozenset", sorted(repr(self.value(v)) for v in x)]
        if isinstance(x, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            return ["function", getattr(x, "__qualname__", repr(x))]
        if isinstance(x, type):
            return ["class", x.__qualname__]
        if isinstance(x, types.ModuleType):
            return ["module", x.__name__]
        seen = self._first(x)
        if seen is not None:
            return ["ref", seen]
        number = self.seen[id(x)]
        if isinstance(x, torch.Tensor):
            return self._tensor(x, number)
        if isinstance(x, np.ndarray):
            return self._array(x, number)
        if isinstance(x, list):
            return ["list", number, [self.value(v) for v in x]]
        if isinstance(x, dict):
            return [type(x).__name__, number, [[self.value(k), self.value(v)] for k, v in x.items()]]
        if isinstance(x, set):
            return ["set", number, sorted(repr(self.value(v)) for v in x)]
        if isinstance(x, torch.nn.Module):
            return self._module(x, number)
        if isinstance(x, torch.optim.Optimizer):
            return self._optimizer(x, number)
        return self._object(x, number)

    def _tensor(self, t: torch.Tensor, number: int) -> list[Any]:
        data = t.detach()
        if data.is_sparse or data.layout != torch.strided:
            digest = repr(data)
        else:
            dense = torch.empty(data.shape, dtype=data.dtype).copy_(data)  # strides of its own
            raw = dense.reshape(-1).view(torch.uint8) if data.numel() else data.new_empty(0)
            digest = hashlib.sha1(raw.cpu().numpy().tobytes()).hexdigest()[:16]
        memory: list[Any] = [None]
        storage = t.untyped_storage()
        if storage.nbytes() and t.device.type == "cpu":
            lo = storage.data_ptr()
            self.memory.append((lo, lo + storage.nbytes(), memory))
        offset = t.storage_offset() * t.element_size()
        return [
            type(t).__name__,
            number,
            str(t.dtype),
            list(t.shape),
            list(t.stride()),
            t.storage_offset(),
            t.requires_grad,
            digest,
            memory,
            offset,
            self.value(t.grad) if self.grads and t.is_leaf and t.grad is not None else None,
        ]

    def _array(self, a: np.ndarray, number: int) -> list[Any]:
        memory: list[Any] = [None]
        offset = 0
        if a.nbytes:
            lo, hi = np.byte_bounds(a) if hasattr(np, "byte_bounds") else np.lib.array_utils.byte_bounds(a)
            self.memory.append((lo, hi, memory))
        digest = hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]
        return [
            "ndarray",
            number,
            str(a.dtype),
            list(a.shape),
            list(a.strides),
            a.flags.writeable,
            digest,
            memory,
            offset,
        ]

    def _module(self, m: torch.nn.Module, number: int) -> list[Any]:
        plain = {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}
        return [
            "module:" + type(m).__qualname__,
            number,
            m.training,
            [[k, self.value(v)] for k, v in m._parameters.items()],
            [[k, self.value(v)] for k, v in m._buffers.items()],
            [[k, self.value(v)] for k, v in m._modules.items()],
            [[k, self.value(v)] for k, v in sorted(plain.items())],
        ]

    def _optimizer(self, opt: torch.optim.Optimizer, number: int) -> list[Any]:
        groups = [
            [[k, self.value(v)] for k, v in sorted(g.items())] for g in opt.param_groups
        ]  # load_state_dict reorders
        state = [
            [self.value(p), self.value(dict(opt.state[p]))]
            for g in opt.param_groups
            for p in g["params"]
            if p in opt.state
        ]
        return ["optimizer:" + type(opt).__qualname__, number, groups, state]

    def _object(self, x: Any, number: int) -> list[Any]:
        attrs = getattr(x, "__dict__", None)
        slots = [
            s for c in type(x).__mro__ for s in getattr(c, "__slots__", ()) if s not in ("__dict__", "__weakref__")
        ]
        if attrs is None and not slots:
            return ["other:" + type(x).__qualname__, number, _ADDRESS.sub("", repr(x))[:300]]
        fields = sorted((attrs or {}).items())
        slotted = [[s, self.value(getattr(x, s))] for s in slots if hasattr(x, s)]
        return ["object:" + type(x).__qualname__, number, [[k, self.value(v)] for k, v in fields], slotted]

    def number_memory(self) -> None:
        """Fill each tensor's and array's memory slot: (its group of overlapping ranges, numbered
        in the order met; its start's byte offset in the group)."""
        spans = sorted(self.memory, key=lambda s: (s[0], s[1]))
        groups: list[list[Any]] = []
        for lo, hi, slot in spans:
            if groups and lo < groups[-1][1]:
                groups[-1][1] = max(groups[-1][1], hi)
                groups[-1][2].append((lo, slot))
            else:
                groups.append([lo, hi, [(lo, slot)]])
        order = {}
        for lo, _hi, slot in self.memory:  # numbered in the order met, not by address
            group = next(g for g in groups if g[0] <= lo < g[1] or lo == g[0])
            order.setdefault(id(group), len(order))
            slot[0] = [order[id(group)], lo - group[0]]


def diff(left: Any, right: Any, path: str = "") -> str | None:
    """Where two dumps first differ, readably; None where they are equal."""
    if isinstance(left, dict) and isinstance(right, dict):
        for key in sorted(set(left) | set(right)):
            if key not in left or key not in right:
                return f"{path}{key}: only in {'right' if key not in left else 'left'}"
            found = diff(left[key], right[key], f"{path}{key}")
            if found:
                return found
        return None
    if isinstance(left, list) and isinstance(right, list):
        for i, (a, b) in enumerate(zip(left, right)):
            found = diff(a, b, f"{path}[{i}]")
            if found:
                return found
        if len(left) != len(right):
            return f"{path}: {len(left)} items != {len(right)}, the last: {_short(left[-1:])} != {_short(right[-1:])}"
        return None
    return None if left == right else f"{path}: {_short(left)} != {_short(right)}"


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 400 else text[:400] + "..."


# ----------------------------------------------------------------------------- in the kernel


def _user_ns() -> dict[str, Any]:
    from IPython import get_ipython

    return get_ipython().user_ns


def probe(skip: frozenset[str] = frozenset({"ddp"})) -> None:
    """Print the notebook's dump as one JSON line (a library function: the tracker's reach of the
    cell ``_fuzz_probe()`` is that name alone, so probing changes nothing it compares)."""
    import json

    from IPython import get_ipython

    print(json.dumps(dump(_user_ns(), skip | set(get_ipython().user_ns_hidden))))


def stale() -> None:
    """Print the session's stale variables (names a ``--no-return`` cell changed), as JSON."""
    import json

    from enot_nb.sessions import session

    live = session()
    print(json.dumps(sorted(live.flow.mirror.stale) if live is not None else []))


def held() -> None:
    """Print the notebook's variables the ranks hold, as JSON."""
    import json

    from enot_nb.sessions import session

    live = session()
    ns = _user_ns()
    print(json.dumps(sorted(n for n in live.flow.mirror.record.synced if n in ns) if live is not None else []))


def save(path: str, names: list[str]) -> None:
    """Save the state of ``names`` that a stop-pressed loop changed (a new tensor; a module's
    parameters, buffers and their ``.grad``; an optimizer's or scheduler's state), for the
    reference to take in place (``load_into``): identities and shared memory stay its own."""
    ns = _user_ns()
    state: dict[str, Any] = {}
    for name in names:
        if name not in ns:  # deleted by an earlier cell (a replica's name is the program's)
            continue
        value = ns[name]
        if isinstance(value, torch.nn.Module):
            grads = [p.grad for p in value.parameters()]
            state[name] = ("module", value.state_dict(), grads, value.training)
        elif isinstance(value, torch.Tensor):
            state[name] = ("tensor", value.detach().clone())
        else:  # an optimizer or a scheduler
            state[name] = ("state", value.state_dict())
    torch.save(state, path)


def load_into(ns: dict[str, Any], path: str) -> None:
    """What ``save`` wrote, loaded in place into the reference's objects of those names."""
    for name, (kind, *saved) in torch.load(path, weights_only=False).items():
        if kind == "module":
            module, (values, grads, training) = ns[name], saved
            module.load_state_dict(values)
            module.train(training)
            for p, grad in zip(module.parameters(), grads):
                p.grad = grad
        elif kind == "tensor":
            if name in ns and isinstance(ns[name], torch.Tensor) and ns[name].shape == saved[0].shape:
                ns[name].copy_(saved[0])
            else:
                ns[name] = saved[0]
        else:
            ns[name].load_state_dict(saved[0])


def ranks_report(ns: dict[str, Any], names: list[str], replicated: list[str] | None) -> None:
    """On every rank (a session cell): dump ``names`` and compare the ranks' dumps of
    ``replicated`` (None: every variable; a DDP wrapper's module stands for it); the master
    prints one JSON line: its dump, and where the ranks differ."""
    import json

    import torch.distributed as dist

    present = [n for n in names if n in ns]
    mine = dump(ns, names=present)
    mine["<missing on the master>"] = sorted(set(names) - set(present))
    keys = sorted(ns_key for ns_key in (replicated if replicated is not None else user_names(ns)) if ns_key in ns)
    shown = {n: getattr(ns[n], "module", ns[n]) if n == "ddp" else ns[n] for n in keys}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dump(shown, grads=replicated is None))
    apart = next((f"rank {r}: {d}" for r, other in enumerate(everyone) if (d := diff(everyone[0], other))), None)
    if dist.get_rank() == 0:
        print(json.dumps({"master": mine, "apart": apart}))
