"""A session rank's process groups after a failed or interrupted cell: their sequence numbers
compared (whether a collective was left half done), aborted (which releases a peer waiting in a
collective), and the world group made again in the same process."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Any, NamedTuple

from enot_nb._processes import sockets
from enot_nb._processes.sockets import End


class Subgroup(NamedTuple):
    """A process group the user made (``dist.new_group``), as it can be made again."""

    group: Any
    ranks: tuple[int, ...]
    backend: str


def subgroups() -> list[Subgroup]:
    """Every group but the world group, in the order they were made (the same on every rank:
    the same cells made them), with its global ranks and backend."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    world = dist.distributed_c10d._world
    default = dist.distributed_c10d._get_default_group()
    made = []
    for group, ranks in list(world.pg_group_ranks.items()):
        if group is default:
            continue
        try:
            backend = str(dist.get_backend(group))
        except (RuntimeError, ValueError):
            backend = str(dist.get_backend())
        made.append(Subgroup(group, tuple(sorted(ranks)), backend))
    return made


def sequences() -> dict[str, int] | None:
    """Each process group's sequence number on this rank, by group name (see protocol.Groups)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    world = dist.distributed_c10d._world
    groups: list[Any] = list(world.pg_map)  # their counter is not in torch's stubs
    try:
        return {world.pg_names[group]: int(group._get_sequence_number_for_group()) for group in groups}
    except Exception:  # noqa: BLE001 - a backend that does not count: assume the worst
        return None


def abort_groups(peers: Iterable[End]) -> None:
    """Abort every process group, so that a peer that waits in a collective with this rank is
    released with an error and returns to idle. NCCL's abort does it; gloo closes its
    connections only when the group object dies, and a DDP wrapper (or a user's subgroup) keeps
    it alive: so this rank's connections with the ``peers`` (the ends of their TCP sockets, see
    _processes/sockets) are shut down too (a peer blocked in a gloo wait sees "connection
    closed" within milliseconds)."""
    import torch.distributed as dist

    # Our own descriptors of them, taken while the groups still hold them (an abort may close
    # theirs, and a number closed may be reused by then).
    connections = []
    others = set(peers) - set(sockets.ends_of([os.getpid()]))  # not its connections with itself
    for fd in sockets.connections_to(others):
        try:
            connections.append(socket.socket(fileno=os.dup(fd)))
        except OSError:
            pass
    if dist.is_initialized():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - then destroy, which also releases the peers
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the sockets below release them anyway
                pass
    for connection in connections:
        try:
            connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            connection.close()


def regroup(init_method: str, default_backend: str, timeout: Any) -> None:
    """Make the world group again, in this same process: the old one is gone (aborted, or left
    with a collective half done), and the objects that hold it must be made again."""
    import torch.distributed as dist

    from enot_nb._runtime import env

    backend = None
    if dist.is_initialized():
        backend = dist.get_backend()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - an aborted group may refuse; a new one is made anyway
            pass
    layout = env.read_layout()
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        import torch

        kwargs["device_id"] = torch.device("cuda", layout.local_rank)
    dist.init_process_group(
        backend=backend or default_backend,
        init_method=init_method,
        rank=layout.rank,
        world_size=layout.world_size,
        timeout=timeout,
        **kwargs,
    )
    if dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        dist.barrier()  # every rank connected before any cell runs (see bootstrap._check_connected)
