"""Where a Ray session's ranks landed -> torchrun's variables (_launch/ray_layout.py; no cluster)."""

from __future__ import annotations

from enot_nb._launch.ray_layout import Landing, place_ranks, torchrun_variables


def _landing(bundle: int, node: str, *gpus: str) -> Landing:
    return Landing(bundle=bundle, node_id=node, node_ip=f"10.0.0.{ord(node[0]) - 64}", pid=100 + bundle, gpu_ids=gpus)


def test_an_uneven_placement_numbers_ranks_node_by_node():
    # Bundles 0, 1 and 3 on node A, 2 on B, 4 on C (what PACK does when A fills after B took one).
    places = place_ranks([_landing(b, n) for b, n in enumerate("AABAC")])
    assert [(p.rank, p.landing.bundle) for p in places] == [(0, 0), (1, 1), (2, 3), (3, 2), (4, 4)]
    assert [p.local_rank for p in places] == [0, 1, 2, 0, 0]
    assert [p.local_world_size for p in places] == [3, 3, 3, 1, 1]
    assert [p.node_rank for p in places] == [0, 0, 0, 1, 2]
    assert {p.nnodes for p in places} == {3}


def test_spread_gives_each_rank_a_node_and_the_variables_follow():
    places = place_ranks([_landing(1, "B"), _landing(0, "A")])  # answers come in any order
    env = [torchrun_variables(p, 2, "10.0.0.1", 29500, "run", 1) for p in places]
    picked = [{k: e[k] for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")} for e in env]
    assert picked == [
        {"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "0", "GROUP_RANK": "0"},
        {"RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "1", "GROUP_RANK": "1"},
    ]
    assert {e["WORLD_SIZE"] for e in env} == {"2"} and {e["GROUP_WORLD_SIZE"] for e in env} == {"2"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env} == {("10.0.0.1", "29500")}
    assert "CUDA_VISIBLE_DEVICES" not in env[0]


def test_each_rank_binds_the_gpu_ray_assigned_it():
    """init_torch binds cuda:LOCAL_RANK: under the node's CUDA_VISIBLE_DEVICES that is the first
    GPU Ray gave the rank, with two GPUs a rank too."""
    places = place_ranks([_landing(0, "A", "3"), _landing(1, "A", "1"), _landing(2, "B", "0")])
    for p in places:
        visible = torchrun_variables(p, 3, "x", 1, "r", 1)["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[p.local_rank] == p.landing.gpu_ids[0]
        assert sorted(visible) == sorted(
            g for o in places if o.landing.node_id == p.landing.node_id for g in o.landing.gpu_ids
        )
    pairs = place_ranks([_landing(0, "A", "0", "1"), _landing(1, "A", "2", "3")])
    for p in pairs:
        visible = p.visible_gpus
        assert visible[p.local_rank] == p.landing.gpu_ids[0] and set(p.landing.gpu_ids) <= set(visible)


def test_node_ids_that_sort_against_placement_number_ranks_by_placement():
    """Ray's node ids are hex strings in no order of placement: the node of bundle 0 is node 0
    whatever its id, each node's ranks follow the previous node's, in bundle order, and every
    variable follows (answers in any order). Written out by hand, not from the layout."""
    landed = {0: ("fe", "1"), 1: ("0a", "0"), 2: ("fe", "0"), 3: ("7c", "0"), 4: ("0a", "1")}
    places = place_ranks([_landing(b, landed[b][0], landed[b][1]) for b in (3, 1, 4, 0, 2)])
    env = [torchrun_variables(p, 5, "10.0.0.9", 29500, "run", 1) for p in places]
    names = ("RANK", "ROLE_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "CUDA_VISIBLE_DEVICES")
    # rank: (bundle, RANK, ROLE_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, GROUP_RANK, GPUs)
    expected = [
        (0, "0", "0", "0", "2", "0", "0", "1,0"),  # node fe: bundles 0 and 2
        (2, "1", "1", "1", "2", "0", "0", "1,0"),
        (1, "2", "2", "0", "2", "1", "1", "0,1"),  # node 0a: bundles 1 and 4
        (4, "3", "3", "1", "2", "1", "1", "0,1"),
        (3, "4", "4", "0", "1", "2", "2", "0"),  # node 7c: bundle 3
    ]
    assert [(p.landing.bundle, *(e[n] for n in names)) for p, e in zip(places, env)] == expected
    assert [p.rank for p in places] == [0, 1, 2, 3, 4]
    assert {(e["WORLD_SIZE"], e["ROLE_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) for e in env} == {("5", "5", "3")}
