"""A session on the Ray engine (``%enot_session start --engine ray``), in a real kernel attached to
a real two-node Ray cluster on this machine (conftest): placement, DDP across the nodes against a
local session, faults through the engine, the stop button, live output."""

from __future__ import annotations

import json

import pytest

from tests.ray_engine.conftest import NEEDS_RAY, actor_name, kill_actor
from tests.session.test_session_parity import CASES, _run_case
from tests.session.test_work_kept import BN_MODEL, EPOCH, REPLICAS_EQUAL

pytest.importorskip("ray", reason=NEEDS_RAY)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

START = "%enot_session start -n 2 --engine ray --placement spread"
START_WAIT = 400  # seconds a start may take: a cluster's first actors, each rank's worker importing torch (loaded)

ENVIRONMENT = (
    "%%enot_distributed\n"
    "import os, torch.distributed as dist, enot_nb as _enot\n"
    "envs = [None, None]\n"
    "names = ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'NODE_RANK', 'GROUP_RANK', 'WORLD_SIZE', 'MASTER_ADDR')\n"
    "dist.all_gather_object(envs, {k: os.environ[k] for k in names})\n"
    "shipped_from = _enot.__file__"
)
TRAINING = [
    "%%enot_distributed\n"
    "import torch, torch.distributed as dist\n"
    "from torch.nn.parallel import DistributedDataParallel as DDP\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))\n"
    "ddp = DDP(model)\n"
    "opt = torch.optim.SGD(ddp.parameters(), lr=0.1)",
    # Each rank its own batches: DDP's averaged gradients differ from either rank's own.
    "%%enot_distributed\n"
    "g = torch.Generator().manual_seed(dist.get_rank())\n"
    "for _ in range(5):\n"
    "    loss = ddp(torch.randn(8, 4, generator=g)).pow(2).mean()\n"
    "    opt.zero_grad()\n"
    "    loss.backward()\n"
    "    opt.step()",
]
WEIGHTS = "print(json.dumps([p.detach().flatten().tolist() for p in model.parameters()]))"


def _rows(kernel) -> list[dict]:
    code = (
        "import dataclasses, json\nprint(json.dumps([dataclasses.asdict(r) for r in enot_nb.session().status().rows]))"
    )
    return json.loads(kernel.ok(code, timeout=300).stdout)


def test_ranks_on_two_nodes_train_ddp_as_a_local_session_does(kernel):
    started = kernel.ok(START, timeout=START_WAIT)
    assert "on Ray: 2 node(s), --placement spread" in started.stdout
    rows = _rows(kernel)
    assert len({r["node"] for r in rows}) == 2 and [r["state"] for r in rows] == ["idle", "idle"]
    kernel.ok(ENVIRONMENT)
    envs = json.loads(kernel.ok("print(json.dumps(envs))").stdout)
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["NODE_RANK"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0", "1", "0", "0"),
        ("1", "0", "1", "1", "1"),
    ]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs} == {("2", "127.0.0.1")}
    # enot_nb reached the nodes in the job's runtime_env (py_modules), not from this checkout.
    assert "runtime_resources" in kernel.ok("print(shipped_from)").stdout
    for cell in TRAINING:
        kernel.ok(cell, timeout=120)
    on_ray = json.loads(kernel.ok("import json\n" + WEIGHTS).stdout)
    kernel.ok("%enot_session stop")

    kernel.ok("%reset -f\nimport torch, enot_nb, json")
    kernel.ok("%enot_session start -n 2 --backend gloo --start-method spawn", timeout=START_WAIT)
    try:
        for cell in TRAINING:
            kernel.ok(cell, timeout=120)
        local = json.loads(kernel.ok(WEIGHTS).stdout)
    finally:
        kernel.ok("%enot_session stop")
    assert on_ray == local


SUBSET = [
    "model-trained-in-place-lr-changed-in-a-plain-cell",
    "a-failed-cell-keeps-the-masters-state",
    "ddp-and-its-optimizer-train-on-after-a-failed-cell",
    "a-dataclass-defined-in-a-session-cell-over-a-notebook-class",  # a rank's __main__ on its node
]


@pytest.fixture
def kernels(kernel):
    """The differential pair: a plain kernel, and one attached to the cluster."""
    from tests.kernel import running_kernel

    with running_kernel() as plain:
        yield plain, kernel


@pytest.mark.parametrize("case_id, setup, steps, probes", [c for c in CASES if c[0] in SUBSET], ids=SUBSET)
def test_a_ray_session_cell_is_a_local_cell(kernels, case_id, setup, steps, probes):
    _run_case(kernels, "spawn", steps, setup, probes, start=START)


LONG_CELL = "%%enot_distributed\nimport time\nprint('running', flush=True)\nwhile True:\n    time.sleep(0.01)"


def _the_cell_failed_then_the_session_restarted(kernel, run, rank: int, node: str, cause: str) -> None:
    assert run.error is not None, run.stdout + run.stderr
    text = run.traceback + run.stderr + run.stdout
    assert f"rank {rank}" in text and f"node {node}" in text and cause in text, text
    assert "session restarted" in run.stdout, run.stdout
    assert kernel.ok("%%enot_distributed\nkept + 1").result["text/plain"] == "42"
    rows = _rows(kernel)
    assert [r["state"] for r in rows] == ["idle", "idle"]


def test_an_actor_killed_mid_cell_fails_the_cell_naming_its_rank_and_node(cluster, kernel):
    kernel.ok(START, timeout=START_WAIT)
    kernel.ok("%%enot_distributed\nkept = 41")
    node = _rows(kernel)[1]["node"]
    victim = actor_name(kernel, 1)
    killed: list[bool] = []

    def kill_once_running(run):
        if "running" in run.stdout and not killed:
            killed.append(True)
            kill_actor(cluster, victim)

    run = kernel.run(LONG_CELL, timeout=120, on_output=kill_once_running)
    assert killed
    _the_cell_failed_then_the_session_restarted(kernel, run, 1, node, "ray.kill")
    kernel.ok("%enot_session stop")


def test_a_node_removed_mid_cell_fails_the_cell_naming_its_rank_and_node(cluster, kernel):
    kernel.ok(START, timeout=START_WAIT)
    kernel.ok("%%enot_distributed\nkept = 41")
    rows = _rows(kernel)
    worker = next(iter(cluster.worker_nodes))
    lost = next(r for r in rows if worker.node_id.startswith(r["node"]))  # the head keeps the cluster
    removed: list[bool] = []

    def remove_once_running(run):
        if "running" in run.stdout and not removed:
            removed.append(True)
            cluster.remove_node(worker, allow_graceful=False)

    run = kernel.run(LONG_CELL, timeout=120, on_output=remove_once_running)
    assert removed
    # The head alone now holds both ranks' bundles (SPREAD places where it can).
    _the_cell_failed_then_the_session_restarted(kernel, run, lost["rank"], lost["node"], "died")
    kernel.ok("%enot_session stop")


def _press_once_said(kernel, word: str, pressed: list[bool]):
    """An ``on_output`` that presses the stop button (interrupts the kernel) the first time the
    cell's output says ``word``, and records it in ``pressed``."""

    def press(run) -> None:
        if word in run.stdout and not pressed:
            pressed.append(True)
            kernel.manager.interrupt_kernel()

    return press


def test_the_stop_button_interrupts_every_rank_which_stay_idle_after(kernel):
    kernel.ok(START, timeout=START_WAIT)
    kernel.ok("%%enot_distributed\nimport torch, torch.distributed as dist\nmarks = []")
    pids = [r["pid"] for r in _rows(kernel)]
    pressed: list[bool] = []
    press_once_training = _press_once_said(kernel, "training", pressed)

    run = kernel.run(
        "%%enot_distributed\nmarks.append(dist.get_rank())\nprint('training', flush=True)\n"
        "while True:\n    t = torch.ones(4)\n    dist.all_reduce(t)",
        timeout=120,
        on_output=press_once_training,
    )
    assert pressed and run.error is not None and run.error["ename"] == "KeyboardInterrupt", run.traceback
    assert "where each of the 2 running rank(s) is" in run.stderr
    assert "[rank 0] where it was" in run.stderr and "[rank 1] where it was" in run.stderr, run.stderr
    rows = _rows(kernel)
    assert [r["state"] for r in rows] == ["idle", "idle"], run.stdout + run.stderr
    assert [r["pid"] for r in rows] == pids, run.stdout + run.stderr  # the same ranks, not a restart
    assert kernel.ok("%%enot_distributed\nmarks + [len(marks)]").result["text/plain"] == "[0, 1]"
    kernel.ok("%enot_session stop")


def test_output_and_display_data_reach_the_cell_while_it_runs(kernel, tmp_path):
    kernel.ok(START, timeout=START_WAIT)
    seen = tmp_path / "seen"
    shown: list[bool] = []

    def answer_the_first_line(run):
        if "first line" in run.stdout and not shown:
            shown.append(True)
            seen.touch()  # the cell ends only once its first line reached the notebook

    run = kernel.run(
        "%%enot_distributed\nimport os, time\nfrom IPython.display import display\n"
        "print('first line', flush=True)\ndisplay({'text/plain': 'a display'}, raw=True)\n"
        f"while not os.path.exists({str(seen)!r}):\n    time.sleep(0.01)\nprint('last line')",
        timeout=120,
        on_output=answer_the_first_line,
    )
    assert run.error is None, run.traceback
    assert shown and run.stdout.splitlines() == ["first line", "last line"]
    assert [d["data"]["text/plain"] for d in run.displays] == ["a display"]
    kernel.ok("%enot_session stop")


def test_a_placement_the_cluster_cannot_hold_says_what_it_waits_for_then_fails_clearly(kernel):
    """Five one-CPU ranks on two nodes of two CPUs: the session says what it waits for, and
    fails once its timeout passes, leaving no actor or placement group behind."""
    run = kernel.run("%enot_session start -n 5 --engine ray --timeout 5", timeout=120)
    assert run.error is not None and run.error["ename"] == "LaunchError", run.traceback
    assert "waiting for Ray to place 5 rank(s) (1 CPU each, pack)" in run.stderr, run.stderr
    assert "the cluster has 4 CPU free" in run.stderr, run.stderr
    assert "Ray could not place 5 rank(s) (1 CPU each) within 5 s" in run.traceback, run.traceback
    assert "no session is running" in kernel.ok("%enot_session").stdout
    assert kernel.ok("%enot_session start -n 2 --engine ray", timeout=START_WAIT).error is None  # all freed
    kernel.ok("%enot_session stop")


SPY_CALLS = (
    "from enot_nb._launch.ray_ranks import RayRanks\n_calls, _call = [], RayRanks._call\n"
    "RayRanks._call = lambda self, rank, method, *a, **k: (\n"
    "    _calls.append(method), _call(self, rank, method, *a, **k))[1]"
)
"""Each call the kernel makes to an agent, by method name, kept in ``_calls``."""


def test_big_state_goes_both_ways_through_the_object_store(kernel):
    """A 32 MiB tensor made on the ranks comes back (rank 0's result file, through the store),
    is changed in a plain cell, and reaches every rank with the next cell (a task far above
    what travels in a command: ray.put once). A small result comes in rank 0's answer itself:
    no call to fetch it."""
    kernel.ok(START, timeout=START_WAIT)
    kernel.ok(SPY_CALLS)
    kernel.ok("%%enot_distributed\nimport torch, torch.distributed as dist\nsmall = torch.arange(1000.)")
    assert "'result'" not in kernel.ok("print(_calls)").stdout
    assert kernel.ok("print(float(small.sum()))").stdout == "499500.0\n"
    kernel.ok("%%enot_distributed\nbig = torch.arange(4e6).double()")
    assert "'result'" in kernel.ok("print(_calls)").stdout
    assert kernel.ok("print(float(big.sum()), big.dtype)").stdout == f"{float(sum(range(4_000_000)))} torch.float64\n"
    kernel.ok("big[::2] = -1.0")
    run = kernel.ok(
        "%%enot_distributed\nsums = [None, None]\ndist.all_gather_object(sums, float(big.sum()))\nsums",
        timeout=120,
    )
    expected = float(sum(range(1, 4_000_000, 2)) - 2_000_000)
    assert run.result["text/plain"] == repr([expected, expected])
    kernel.ok("%enot_session stop")


def test_an_uneven_pack_numbers_ranks_node_by_node_as_torchrun(kernel):
    """Three one-CPU ranks packed on two nodes of two CPUs: two on one node, one on the other;
    the variables each rank sees follow where it landed, and the table agrees."""
    kernel.ok("%enot_session start -n 3 --engine ray --placement pack", timeout=START_WAIT)
    kernel.ok(
        "%%enot_distributed\nimport os, torch.distributed as dist\nenvs = [None] * 3\n"
        "names = ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'NODE_RANK', 'GROUP_WORLD_SIZE')\n"
        "dist.all_gather_object(envs, {k: int(os.environ[k]) for k in names})"
    )
    envs = json.loads(kernel.ok("import json\nprint(json.dumps(envs))").stdout)
    rows = _rows(kernel)
    kernel.ok("%enot_session stop")
    seen = [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["NODE_RANK"], e["GROUP_WORLD_SIZE"]) for e in envs]
    assert seen == [(0, 0, 2, 0, 2), (1, 1, 2, 0, 2), (2, 0, 1, 1, 2)]
    nodes = [r["node"] for r in rows]
    assert nodes[0] == nodes[1] != nodes[2]


LOADED_WAIT = 300
"""Seconds a cell of the fault cases may take beside busy processes (its ranks get a third of a core)."""
RESTART_WAIT = 900
"""Seconds a cell that restarts the session may take beside busy processes: new actors and their
workers importing torch on a third of a core (311 s measured with a fork server each, 2026-12-07)."""
TRAIN = (
    "%%enot_distributed\nfor epoch in range(100000):\n    train_epoch(ddp, opt, 3)\n"
    "    if epoch == 1 and dist.get_rank() == 0:\n        print('training', flush=True)\n"
)


def _equal_replicas(kernel) -> bool:
    return kernel.ok("%%enot_distributed\n" + REPLICAS_EQUAL, timeout=LOADED_WAIT).result["text/plain"] == "True"


@pytest.mark.timeout(900)
def test_a_stop_press_and_an_exception_keep_ddp_in_the_same_ranks_idle_or_loaded(kernel, cpu_load):
    """As a local session (test_work_kept), across two nodes, idle and beside busy processes: a
    press during DDP training releases the ranks waiting in the DDP wrapper's gloo group (the
    idle rank cuts its connections with them, found by their sockets' ends on each node), then
    one rank's exception mid-epoch; nothing restarts, the same ``ddp`` and ``opt`` train on."""
    kernel.ok(START, timeout=START_WAIT)
    kernel.ok("%%enot_distributed\n" + BN_MODEL + EPOCH, timeout=LOADED_WAIT)
    pids = [r["pid"] for r in _rows(kernel)]
    pressed: list[bool] = []
    press_once_training = _press_once_said(kernel, "training", pressed)

    said = ""
    run = kernel.run(TRAIN, timeout=LOADED_WAIT, on_output=press_once_training)
    said += run.stdout + run.stderr
    assert pressed and run.error is not None and run.error["ename"] == "KeyboardInterrupt", said + run.traceback
    run = kernel.run("%%enot_distributed\ntrain_epoch(ddp, opt, 10, fail_at=4)", timeout=LOADED_WAIT)
    said += run.stdout + run.stderr
    assert run.error is not None and "rank 1 fails mid-epoch" in run.traceback + run.stderr, said
    assert "session restarted" not in said, said
    assert [r["pid"] for r in _rows(kernel)] == pids  # the same ranks
    assert _equal_replicas(kernel)
    kernel.ok("%%enot_distributed\ntrain_epoch(ddp, opt, 3)", timeout=LOADED_WAIT)
    assert _equal_replicas(kernel)
    kernel.ok("%enot_session stop", timeout=LOADED_WAIT)


@pytest.mark.timeout(1500)
def test_a_rank_killed_mid_training_is_named_with_its_node_before_the_restart(kernel, cpu_load):
    """The rank's own process SIGKILLed (its actor lives on): a line names the rank, the signal
    and its node before the session restarts, and the master's progress is kept."""
    import os
    import signal

    kernel.ok(START, timeout=START_WAIT)
    kernel.ok("%%enot_distributed\n" + BN_MODEL + EPOCH, timeout=LOADED_WAIT)
    rows = _rows(kernel)
    killed: list[bool] = []

    def kill_once_training(run):
        if "training" in run.stdout and not killed:
            killed.append(True)
            os.kill(rows[1]["pid"], signal.SIGKILL)  # a loopback cluster: the rank runs here

    run = kernel.run(TRAIN, timeout=RESTART_WAIT, on_output=kill_once_training)
    assert killed and run.error is not None, run.stdout + run.stderr
    streams = [c["text"] for kind, c in run.arrived if kind == "stream"]
    died = next(i for i, text in enumerate(streams) if "enot_nb: rank 1 died (SIGKILL" in text)
    restarted = next(i for i, text in enumerate(streams) if "session restarted" in text)
    assert died < restarted, streams
    assert f"on node {rows[1]['node']}" in streams[died], streams[died]
    assert "rank 1" in run.traceback and f"node {rows[1]['node']}" in run.traceback, run.traceback
    steps = kernel.ok("print(steps)", timeout=LOADED_WAIT).stdout.strip()
    assert int(steps) >= 6 and kernel.ok("%%enot_distributed\nsteps", timeout=LOADED_WAIT).result["text/plain"] == steps
    kernel.ok("%enot_session stop", timeout=LOADED_WAIT)


def test_a_rank_knows_its_place_from_ray_context_and_never_joins_ray_itself(kernel):
    """``ray_context()`` names each rank's node as the table does; Ray's own API refuses to run in
    a rank (it would connect it as a new driver); the session's stop ends the kernel's
    connection to Ray, and leaves alone one the user made first."""
    kernel.ok(START, timeout=START_WAIT)
    rows = _rows(kernel)
    kernel.ok(
        "%%enot_distributed\nimport torch.distributed as dist\nfrom enot_nb.distributed import ray_context\n"
        "places = [None, None]\ndist.all_gather_object(places, ray_context().node_id)"
    )
    places = json.loads(kernel.ok("print(json.dumps(places))").stdout)
    assert [p[:12] for p in places] == [r["node"] for r in rows]
    run = kernel.run("%%enot_distributed\nimport ray\nray.get_runtime_context().get_node_id()", timeout=60)
    assert run.error is not None and "enot_nb.distributed.ray_context()" in run.traceback, run.traceback
    assert "Connected to Ray" not in run.stdout + run.stderr
    assert kernel.ok("import ray\nprint(ray.is_initialized())").stdout.strip() == "True"
    kernel.ok("%enot_session stop")
    assert kernel.ok("print(ray.is_initialized())").stdout.strip() == "False"
    kernel.ok(
        "import os\nray.init(log_to_driver=False, runtime_env={'py_modules': [os.path.dirname(enot_nb.__file__)]})"
    )
    kernel.ok(START, timeout=START_WAIT)
    kernel.ok("%enot_session stop")
    assert kernel.ok("print(ray.is_initialized())").stdout.strip() == "True"  # the user's own
    kernel.ok("ray.shutdown()")


def test_each_rank_is_two_processes_its_agent_and_itself(kernel):
    """A rank's worker is its agent's only child, and the agent is the Ray actor: no fork server
    between them (a fresh interpreter exec'd once; the stop button still reaches it:
    test_the_stop_button_interrupts_every_rank_which_stay_idle_after)."""
    kernel.ok(START, timeout=START_WAIT)
    kernel.ok(
        "%%enot_distributed\nimport glob, os, torch.distributed as dist\n"
        "agent = os.getppid()\n"
        "children = [c for f in glob.glob(f'/proc/{agent}/task/*/children') for c in open(f).read().split()]\n"
        "line = open(f'/proc/{agent}/cmdline').read().replace(chr(0), ' ')\n"
        "found = [None, None]\ndist.all_gather_object(found, (line, children, os.getpid()))"
    )
    found = json.loads(kernel.ok("import json\nprint(json.dumps(found))").stdout)
    for line, children, pid in found:
        assert line.startswith("ray::") and "forkserver" not in line, line
        assert children == [str(pid)], (line, children, pid)
    kernel.ok("%enot_session stop")
