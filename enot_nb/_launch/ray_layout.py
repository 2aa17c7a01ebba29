"""Where a Ray session's ranks landed, and the torchrun variables that follows from it (see
ray_ranks). Plain data and one pure function, so that it is checked without a cluster.

Ray places one actor per bundle of a placement group; ``PACK`` may put three ranks on one node
and one on the next, ``SPREAD`` one per node where it can. torchrun numbers ranks node by node,
so here the nodes are ordered by the first bundle that landed on each, and each node's ranks
are numbered after the previous node's: ``RANK`` is contiguous per node, ``LOCAL_RANK`` counts
within the node, ``LOCAL_WORLD_SIZE`` is that node's own count (uneven placements too), and
``GROUP_RANK`` = ``NODE_RANK`` is the node's index.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Landing:
    """Where one bundle's actor runs, as it says itself (``RankAgent.where``)."""

    bundle: int
    node_id: str
    node_ip: str
    pid: int
    gpu_ids: tuple[str, ...] = ()
    """The GPUs Ray assigned to the actor (``ray.get_gpu_ids()``)."""
    package_dir: str = ""
    """Where enot_nb lies on the node (the runtime_env's copy): its frames are ours in a stack."""
    actor_id: str = ""
    """The actor's Ray id (hex): the rank's ``ray_context()`` names it."""


@dataclass(frozen=True)
class RankPlace:
    """One rank: the bundle that runs it and its torchrun numbers."""

    rank: int
    landing: Landing
    local_rank: int
    local_world_size: int
    node_rank: int
    nnodes: int
    visible_gpus: tuple[str, ...]
    """``CUDA_VISIBLE_DEVICES`` for the rank: its node's assigned GPUs, each rank's first one at
    index ``LOCAL_RANK`` (init_torch binds ``cuda:LOCAL_RANK``: the GPU Ray gave this rank)."""


def place_ranks(landings: list[Landing]) -> list[RankPlace]:
    """The ranks, in rank order, for actors that landed as ``landings`` (see the docstring)."""
    by_bundle = sorted(landings, key=lambda landing: landing.bundle)
    nodes: list[str] = []
    for landing in by_bundle:
        if landing.node_id not in nodes:
            nodes.append(landing.node_id)
    ordered = [landing for node in nodes for landing in by_bundle if landing.node_id == node]
    places: list[RankPlace] = []
    for rank, landing in enumerate(ordered):
        mates = [other for other in ordered if other.node_id == landing.node_id]
        firsts = [other.gpu_ids[0] for other in mates if other.gpu_ids]
        rest = [gpu for other in mates for gpu in other.gpu_ids[1:]]
        places.append(
            RankPlace(
                rank=rank,
                landing=landing,
                local_rank=mates.index(landing),
                local_world_size=len(mates),
                node_rank=nodes.index(landing.node_id),
                nnodes=len(nodes),
                visible_gpus=tuple(firsts + rest) if landing.gpu_ids else (),
            )
        )
    return places


def torchrun_variables(
    place: RankPlace, world_size: int, master_addr: str, master_port: int, run_id: str, threads: int
) -> dict[str, str]:
    """The variables torchrun sets for this rank (see attempt.rank_environment, one machine's)."""
    rank = str(place.rank)
    env = {
        "WORLD_SIZE": str(world_size),
        "RANK": rank,
        "LOCAL_RANK": str(place.local_rank),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "NODE_RANK": str(place.node_rank),
        "GROUP_RANK": str(place.node_rank),
        "GROUP_WORLD_SIZE": str(place.nnodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "OMP_NUM_THREADS": str(threads),
    }
    if place.visible_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(place.visible_gpus)
    return env
