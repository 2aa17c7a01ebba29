"""A real Ray cluster of two nodes on this machine for the Ray engine's tests, and a kernel
attached to it.

Every node and driver stays on loopback (``node_ip_address="127.0.0.1"`` and Ray's single-machine
mode, else Ray turns 127.0.0.1 into the machine's outward address); each test gets its own
``RAY_TMPDIR`` (``address="auto"`` reads a shared file otherwise) and token authentication, on
explicitly (a local ``ray.init()`` would turn it on and leave a token file for later clusters).
The head's health checks are fast, so that a node removed is seen within a few seconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests._util import LEAK_GRACE, ended_within
from tests.kernel import Kernel
from tests.ray_engine.loopback import ray_variables

NODE_CPUS = 2
FAST_HEALTH_CHECKS = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
}
SETUP = "%load_ext enot_nb\nimport torch, enot_nb\n"


NEEDS_RAY = "the Ray engine's tests need Ray: pip install -e '.[ray]'"
"""Each module that needs Ray skips with this (``pytest.importorskip``); this file imports Ray only
inside its fixtures, so that collecting the folder without Ray skips instead of failing."""


@pytest.fixture
def ray_env(monkeypatch):
    """The variables every process of the test's cluster, its drivers and kernels share."""
    from ray._private.authentication_test_utils import reset_auth_token_state

    folder = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths live under it
    env = ray_variables(folder)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    reset_auth_token_state()  # Ray read the mode and token when it was imported: again, now
    yield env
    monkeypatch.undo()
    reset_auth_token_state()
    # Ray's processes end after the cluster's shutdown returns, and a worker whose raylet went
    # first is no descendant of ours any more: every process working in the test's folder (the
    # cluster's and the kernel's) must end, each waited on by its pidfd, before it is removed.
    left = ended_within(lambda: _working_in(folder), LEAK_GRACE)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(folder, ignore_errors=True)
    assert not left, f"Ray processes left behind: {left}"


def _working_in(folder: str) -> list[int]:
    """The processes (not this one) whose working folder is ``folder`` or below it."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{entry}/cwd").startswith(folder) and int(entry) != os.getpid():
                found.append(int(entry))
        except OSError:  # gone, or a zombie
            pass
    return found


@pytest.fixture
def cluster(ray_env, monkeypatch):
    """Two nodes (a head and a worker), NODE_CPUS each, dashboard off; shut down after the test.
    Started in a folder of their own: Ray's workers put theirs on sys.path, and this checkout's
    would hide the enot_nb the engine ships (as on a real cluster, nodes have none)."""
    import ray
    from ray.cluster_utils import Cluster

    monkeypatch.chdir(ray_env["RAY_TMPDIR"])
    nodes = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": NODE_CPUS,
            "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
            "_system_config": FAST_HEALTH_CHECKS,
        },
    )
    try:
        nodes.add_node(num_cpus=NODE_CPUS, node_ip_address="127.0.0.1")
        yield nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        nodes.shutdown()


@pytest.fixture
def kernel(cluster, ray_env):
    """A Jupyter kernel whose Ray address is the cluster's (RAY_ADDRESS), enot_nb loaded; in a
    folder of its own (Ray puts a driver's folder on its workers' sys.path too)."""
    k = Kernel(extra_env={"RAY_ADDRESS": cluster.address}, cwd=Path(ray_env["RAY_TMPDIR"]))
    try:
        k.ok(SETUP)
        yield k
    finally:
        k.shutdown()


KILL = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)
found = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == sys.argv[2]]
ray.kill(ray.get_actor(sys.argv[2], namespace=found[0]["namespace"]))
ray.shutdown()
"""


def kill_actor(cluster, name: str) -> None:
    """``ray.kill`` of the named actor, from a driver of its own, as a user at a terminal would."""
    subprocess.run([sys.executable, "-c", KILL, cluster.address, name], check=True, timeout=120)


def actor_name(kernel, rank: int) -> str:
    """The name of the Ray actor that runs ``rank`` of the kernel's session."""
    return kernel.ok(f"print(enot_nb.session().workers.host.names[{rank}])").stdout.strip()
