"""What the session tests share: a session of two gloo ranks, and the DDP wrapper a cell builds."""

from __future__ import annotations

from enot_nb.sessions import Session

DDP_SETUP = (
    "import torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "ddp = DDP(model)\n"
)


def start(start_method: str, **kwargs) -> Session:
    return Session(nprocs=2, backend="gloo", start_method=start_method, quiet=True, **kwargs)
