"""enot_nb.distributed under torchrun: one node with 2 processes, and 2 nodes simulated on localhost."""

from __future__ import annotations

import subprocess

import pytest

from tests._util import HELPERS, clean_env, free_port, read_ranks, run_all, torchrun_cmd

PROBE = str(HELPERS / "probe_distributed.py")
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def torchrun_one_node(tmp_path, scenario, **env):
    cmd = torchrun_cmd("--standalone", "--nproc-per-node", "2", PROBE, str(tmp_path), scenario)
    proc = subprocess.Popen(cmd, env=clean_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    (out,) = run_all([proc], timeout=90)
    assert proc.returncode == 0, out
    return read_ranks(tmp_path, 2)


def test_helpers_on_one_node(tmp_path):
    r0, r1 = torchrun_one_node(tmp_path, "helpers")
    assert (r0["rank"], r0["local_rank"], r0["world_size"]) == (0, 0, 2)
    assert (r1["rank"], r1["local_rank"], r1["world_size"]) == (1, 1, 2)
    assert r0["is_dist"] and r1["is_dist"]
    assert (r0["is_master"], r0["is_local_master"]) == (True, True)
    assert (r1["is_master"], r1["is_local_master"]) == (False, False)
    assert (r0["master_only"], r1["master_only"]) == ("from master", None)
    assert r0["wrapped_name"] == "helpers"
    assert r0["first_rand"] == r1["first_rand"]  # same seed on every rank
    assert (tmp_path / "master_first.log").read_text().split() == ["0", "1"]


def test_helpers_on_two_simulated_nodes(tmp_path):
    port = str(free_port())
    procs = [
        subprocess.Popen(
            torchrun_cmd(
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                PROBE,
                str(tmp_path),
                "helpers",
            ),
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = run_all(procs, timeout=90)
    assert [p.returncode for p in procs] == [0, 0], outputs
    r0, r1 = read_ranks(tmp_path, 2)
    assert (r0["rank"], r0["local_rank"]) == (0, 0)
    assert (r1["rank"], r1["local_rank"], r1["world_size"]) == (1, 0, 2)
    # On node 1 the process is its node's master but not the global one.
    assert (r1["is_master"], r1["is_local_master"]) == (False, True)
    assert (r0["is_master"], r0["is_local_master"]) == (True, True)


def test_sync_model_values_by_hand(tmp_path):
    # tiny buckets and a tiny in-place threshold: packed buckets and in-place tensors both used
    r0, r1 = torchrun_one_node(tmp_path, "sync", ENOT_NB_SYNC_BUCKET_MB="0.01", ENOT_NB_SYNC_DIRECT_MB="0.01")
    for r in (r0, r1):
        assert r["avg_weight"] == [[1.5, 1.5], [1.5, 1.5]]  # (1 + 2) / 2
        assert r["avg_running_mean"] == [15.0, 15.0]  # (10 + 20) / 2
        assert r["counter"] == 100  # integer buffer: rank 0's value, never averaged
        assert r["bcast_weight"] == [[1.0, 1.0], [1.0, 1.0]]  # rank 0's
        assert r["bcast_running_mean"] == [10.0, 10.0]
        assert r["buffers_only_weight"] == [[float(r is r1) + 1.0] * 2] * 2  # untouched
        assert r["tied_weight"] == [[1.5] * 3] * 3 and r["still_tied"]
        assert r["buf_mean"] == [1.5] * 4
        assert r["buf_flag"] == [True, False]  # bool buffer: rank 0's
        assert r["bucketed_exact"]


def test_sync_model_mismatch_raises_on_every_rank(tmp_path):
    for r in torchrun_one_node(tmp_path, "mismatch"):
        assert r["error"] is not None
        assert "1.weight" in r["error"] and "rank 1" in r["error"]
        assert "'1.weight:(3, 4):torch.float32:cpu:reduce'" in r["error"]  # rank 0's, decoded
        assert "'1.weight:(5, 4):torch.float32:cpu:reduce'" in r["error"]  # rank 1's
