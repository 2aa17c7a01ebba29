"""A session on the Ray engine beside a local session and Ray's own floor (``run_all.py --only ray``).

A Ray cluster of two nodes on this machine (as tests/ray_engine: loopback, token authentication, a
``RAY_TMPDIR`` of its own), a real kernel attached to it:

* a trivial cell on a 2-rank Ray session (``--engine ray --placement spread``: one rank per
  node), on a 2-rank local session, run locally (the reference), and a bare Ray actor call from
  the same kernel (``ray.get(actor.f.remote())``: the floor of anything relayed through Ray);
  ipyparallel's ``view.execute`` on 2 engines where it is installed (bench_session's row);
* a 50-step DDP cell (gloo) on the Ray session against the same cell on the local session, and
  against the same 50 steps in a torchrun script already running (bench_session.ddp_steps);
* the time a Ray session takes to start on a running cluster, against a local session's;
* the memory each session holds (the summed PSS of every process on the machine, after its
  trivial cells, over before it started), against a local session's plus two bare actors'.

Each session is measured in turn in the same kernel (one session per process), medians of the
repeats; the figures of one run are comparable with each other only.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.bench_session import SETUP, TRIVIAL, _apart, _ipyparallel, ddp_steps
from benchmarks.harness import Row, kernel_json
from tests.kernel import Kernel
from tests.ray_engine.loopback import ray_variables

BENCH = "Ray session: a trivial cell, 2 ranks"
DDP = "Ray session: 50 DDP steps (gloo), 2 ranks"
START = "Ray session: start, 2 ranks"
MEMORY = "Ray session: memory over the idle nodes (summed PSS of every process), 2 ranks"

DDP_SETUP = (
    "%%enot_distributed\\nimport torch, torch.distributed as dist\\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\\n"
    "torch.manual_seed(0)\\nnet = DDP(torch.nn.Linear(64, 64))\\nopt = torch.optim.SGD(net.parameters(), lr=0.01)"
)
DDP_CELL = (
    "%%enot_distributed --no-return\\nfor _ in range(50):\\n"
    "    loss = net(torch.randn(32, 64)).pow(2).mean()\\n    opt.zero_grad()\\n    loss.backward()\\n    opt.step()"
)

MEASURE = r"""
import glob, gc, ray
def pss_mib():
    total = 0
    for path in glob.glob("/proc/[0-9]*/smaps_rollup"):
        try:
            with open(path) as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        except OSError:
            pass
    return total / 1024
def session_rows(start_line):
    gc.collect(); before = pss_mib()
    t0 = time.perf_counter()
    run(start_line)
    started = time.perf_counter() - t0
    cell = statistics.median(clock("%%enot_distributed\n{trivial}", {n}))
    memory = pss_mib() - before
    run("{ddp_setup}")
    ddp = statistics.median(clock("{ddp_cell}", {repeats}, warmup=1))
    run("%enot_session stop")
    return started, cell, ddp, memory
local_cell = statistics.median(clock({trivial!r}, {n}))
run("%enot_session start -n 2 --engine ray --placement spread")  # the code's first upload to the nodes
run("%enot_session stop")
on_ray = session_rows("%enot_session start -n 2 --engine ray --placement spread")
local = session_rows("%enot_session start -n 2 --backend gloo --start-method spawn")
@ray.remote(num_cpus=0)
class Floor:
    def f(self):
        return None
t0 = time.perf_counter()
ray.get(Floor.remote().f.remote())  # connected, and the first actor's worker started, before
actor_start = time.perf_counter() - t0
t0 = time.perf_counter()
group = ray.util.placement_group([{{"CPU": 1}}] * 2, strategy="SPREAD")
ray.get(group.ready())
group_wait = time.perf_counter() - t0
ray.util.remove_placement_group(group)
gc.collect(); before = pss_mib()
floor_actors = [Floor.options(scheduling_strategy="SPREAD").remote() for _ in range(2)]
ray.get([a.f.remote() for a in floor_actors])
actor_memory = (pss_mib() - before) / 2
floor_actor = floor_actors[0]
floor = []
for _ in range({n}):
    t0 = time.perf_counter()
    ray.get(floor_actor.f.remote())
    floor.append(time.perf_counter() - t0)
for actor in floor_actors:
    ray.kill(actor)
results = [local_cell, on_ray, local, statistics.median(floor), actor_memory, actor_start, group_wait]
print("RESULT", json.dumps(results))
"""
"""Memory: the summed proportional set size (PSS) of every process on this machine, before a
session starts and after its trivial cells (the difference is what the session holds, all of
its processes counted, shared pages once); a bare actor's, two of them on the two nodes."""


@contextmanager
def loopback_cluster() -> Iterator[tuple[str, str]]:
    """Two Ray nodes on this machine, as tests/ray_engine's (loopback, token authentication, a
    ``RAY_TMPDIR`` of its own, 2 CPUs each): its address, and its folder, where a kernel attached
    to it works (Ray puts a driver's folder on its workers' sys.path). The environment and the
    working folder are restored after."""
    import os

    from ray._private.authentication_test_utils import reset_auth_token_state
    from ray.cluster_utils import Cluster

    folder = tempfile.mkdtemp(prefix="ray-")
    env = ray_variables(folder)
    saved, cwd = {k: os.environ.get(k) for k in env}, os.getcwd()
    os.environ.update(env)
    reset_auth_token_state()
    os.chdir(folder)  # Ray's workers put their folder on sys.path (see tests/ray_engine/conftest.py)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        yield cluster.address, folder
    finally:
        cluster.shutdown()
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reset_auth_token_state()
        shutil.rmtree(folder, ignore_errors=True)


def run(repeats: int) -> list[Row]:
    try:
        import ray  # noqa: F401 - only whether it is there
    except ImportError:
        return [Row(BENCH, "not measured (Ray is not installed: pip install -e '.[ray]')", 0.0, "s", "local")]
    with loopback_cluster() as (address, folder):
        kernel = Kernel(extra_env={"RAY_ADDRESS": address}, cwd=Path(folder))
        try:
            kernel.ok(SETUP)
            n = max(20, repeats * 5)
            code = MEASURE.format(trivial=TRIVIAL, n=n, repeats=repeats, ddp_setup=DDP_SETUP, ddp_cell=DDP_CELL)
            local_cell, on_ray, local, floor, actor_memory, actor_start, group_wait = kernel_json(
                kernel, code, timeout=1200
            )
            over_torchrun = ddp_steps(
                kernel,
                repeats,
                start="%enot_session start -n 2 --engine ray --placement spread",
                bench="Ray session: 50 DDP steps over a running torchrun script, 2 ranks",
            )
        finally:
            kernel.shutdown()
    (ray_start, ray_cell, ray_ddp, ray_memory), (local_start, session_cell, local_ddp, local_memory) = on_ray, local
    allowed = (local_memory + 2 * actor_memory) * 1.1
    rows = [
        Row(BENCH, "the cell run locally (reference)", local_cell, "s", "local", 1.0, "", n),
        Row(BENCH, "bare Ray actor call (the floor)", floor, "s", "local", floor / local_cell, "", n),
        Row(BENCH, "local session cell", session_cell, "s", "local", session_cell / local_cell, "", n),
        Row(BENCH, "Ray session cell (one rank per node)", ray_cell, "s", "local", ray_cell / local_cell, "", n),
        Row(BENCH, "Ray session cell: over the local session cell", ray_cell - session_cell, "s", "local", None),
        Row(DDP, "local session cell (reference)", local_ddp, "s", "local", 1.0, "", repeats),
        Row(DDP, "Ray session cell", ray_ddp, "s", "local", ray_ddp / local_ddp, "", repeats),
        Row(START, "local session, spawn (reference)", local_start, "s", "local", 1.0, "", 1),
        Row(START, "a bare actor's start (its first call answered)", actor_start, "s", "local", None, "", 1),
        Row(START, "a placement group of 2 bundles, ready", group_wait, "s", "local", None, "", 1),
        Row(
            START,
            "Ray session, on a running cluster",
            ray_start,
            "s",
            "local",
            ray_start / local_start,
            f"<= local + an actor's start + a group's wait ({local_start + actor_start + group_wait:.2f} s)",
            1,
        ),
        Row(MEMORY, "local session (reference)", local_memory, "MiB", "local", 1.0, "", 1),
        Row(MEMORY, "a bare Ray actor", actor_memory, "MiB", "local", actor_memory / local_memory, "", 1),
        Row(
            MEMORY,
            "Ray session, one rank per node",
            ray_memory,
            "MiB",
            "local",
            ray_memory / local_memory,
            f"<= local + 2 actors + 10% ({allowed:.0f} MiB)",
            1,
        ),
    ]
    return (
        rows
        + over_torchrun
        + [
            Row(BENCH, r.variant, r.median, r.unit, r.reference, r.ratio, r.target, r.runs)
            for r in _apart(_ipyparallel, n, local_cell)
        ]
    )
