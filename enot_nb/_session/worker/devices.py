"""Which of a session rank's variables live on its GPU, and putting them back there after a
restart (the notebook holds CPU copies: the new workers get those, then move them)."""

from __future__ import annotations

import sys
from typing import Any


def names_on_device(namespace: dict[str, Any]) -> list[str]:
    """The variables that hold tensors on a GPU: a tensor, a module (by its first parameter or
    buffer), an optimizer (by its state). Looked up in sys.modules: nothing is imported."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return []
    return sorted(name for name, value in namespace.items() if not name.startswith("_") and _on_gpu(torch, value))


def _on_gpu(torch: Any, value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, torch.nn.Module):
        first = next(iter([*value.parameters(), *value.buffers()]), None)
        return first is not None and first.is_cuda
    if isinstance(value, torch.optim.Optimizer):
        return any(isinstance(t, torch.Tensor) and t.is_cuda for state in value.state.values() for t in state.values())
    return False


def to_rank_device(namespace: dict[str, Any], names: list[str]) -> None:
    """Move ``names`` onto this rank's GPU (cuda:LOCAL_RANK, as init_torch bound it): a module
    in place (its parameters keep their identity, so optimizers over them still hold them), an
    optimizer's state, a tensor rebound to its copy there. Nothing where this rank has no GPU."""
    if not names:
        return
    import torch

    from enot_nb import distributed

    if not torch.cuda.is_available():
        return
    device = torch.device("cuda", distributed.get_local_rank())
    for name in names:
        value = namespace.get(name)
        if isinstance(value, torch.nn.Module):
            value.to(device)
        elif isinstance(value, torch.Tensor):
            namespace[name] = value.to(device)
        elif isinstance(value, torch.optim.Optimizer):
            for state in value.state.values():
                for key, held in state.items():
                    if isinstance(held, torch.Tensor) and held.dim() > 0:  # a step count stays where it is
                        state[key] = held.to(device)
