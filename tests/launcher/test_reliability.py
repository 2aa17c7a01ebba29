"""Fault injection and soak (marker ``reliability``; the long soak runs with --soak).

Every fault must give WorkerFailedError within 2 s naming the right rank and cause, leave no
process behind, and leave the next launch working; in plain Python and in a real kernel.
Set ENOT_NB_RELIABILITY_FIGURES=path.json to record the measured figures (RELIABILITY.md).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import enot_nb
from enot_nb import WorkerFailedError
from tests._util import METHODS, descendants, is_fork_server_of, record_figure
from tests.helpers import faults
from tests.kernel import running_kernel

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(120), pytest.mark.slow]


def workers_of(pid: int) -> list[int]:
    return [p for p in descendants(pid) if not is_fork_server_of(p, {pid})]


def check_fault(err: WorkerFailedError, fault: str, victim: int) -> None:
    exitcode, signal_name, error_type = faults.EXPECTED[fault]
    assert (err.rank, err.exitcode, err.signal_name) == (victim, exitcode, signal_name), str(err)
    assert err.failures[0].error_type == error_type
    if fault == "raise":
        assert "injected fault" in err.traceback


@pytest.mark.parametrize("activity", ["compute", "collective"])
@pytest.mark.parametrize("fault", faults.FAULTS)
@pytest.mark.parametrize("method", METHODS)
def test_fault_in_plain_python(tmp_path, method, fault, activity):
    rng = random.Random(f"{method}{fault}{activity}")
    victim, delay = rng.randrange(2), rng.uniform(0.0, 0.5)
    stamp = tmp_path / "stamp"
    with pytest.raises(WorkerFailedError) as info:
        enot_nb.notebook_launcher(
            faults.fault_job,
            args=(fault, victim, delay, str(stamp), activity),
            nprocs=2,
            backend="gloo",
            start_method=method,
        )
    detected = time.monotonic() - float(stamp.read_text())
    left = workers_of(os.getpid())
    check_fault(info.value, fault, victim)
    assert left == []  # every worker is gone by the time the error is raised
    record_figure("detection_plain_s", detected)
    assert (
        enot_nb.notebook_launcher(faults.big_tensor, args=(0,), nprocs=2, backend="gloo", start_method=method).numel()
        == 0
    )  # the next launch works


@pytest.fixture(scope="module")
def kernel():
    with running_kernel("import enot_nb, json, time, os\nfrom tests.helpers import faults") as k:
        yield k


@pytest.mark.parametrize("fault", faults.FAULTS)
@pytest.mark.parametrize("method", METHODS)
def test_fault_in_a_kernel(kernel, tmp_path, method, fault):
    rng = random.Random(f"kernel{method}{fault}")
    victim, delay, activity = rng.randrange(2), rng.uniform(0.0, 0.5), rng.choice(["compute", "collective"])
    stamp = tmp_path / "stamp"
    run = kernel.run(
        "try:\n"
        f"    enot_nb.notebook_launcher(faults.fault_job, args=({fault!r}, {victim}, {delay}, "
        f"{str(stamp)!r}, {activity!r}), nprocs=2, backend='gloo', start_method={method!r})\n"
        "except enot_nb.WorkerFailedError as err:\n"
        "    caught = time.monotonic()\n"
        f"    started = float(open({str(stamp)!r}).read())\n"
        "    print(json.dumps([err.rank, err.exitcode, err.signal_name, caught - started]))\n"
    )
    rank, exitcode, signal_name, detected = json.loads(run.stdout.strip().splitlines()[-1])
    assert (rank, exitcode, signal_name) == (victim, *faults.EXPECTED[fault][:2])
    assert workers_of(kernel.pid) == []
    record_figure("detection_kernel_s", detected)
    assert (
        kernel.ok(
            "enot_nb.notebook_launcher(faults.big_tensor, args=(1,), nprocs=2, "
            f"backend='gloo', start_method={method!r}).numel()"
        ).result["text/plain"]
        == "262144"
    )


@pytest.mark.parametrize("method", METHODS)
def test_ten_megabytes_of_output_and_no_trailing_newline(capfd, method):
    count = enot_nb.notebook_launcher(faults.print_megabytes, args=(10,), nprocs=2, backend="gloo", start_method=method)
    out, _ = capfd.readouterr()
    assert out.count("x" * 99 + "\n") == count
    assert out.endswith("no newline at the end")


def test_output_and_large_result_in_a_kernel(kernel):
    run = kernel.ok("enot_nb.notebook_launcher(faults.print_megabytes, args=(10,), nprocs=2, backend='gloo')")
    assert run.stdout.count("x" * 99 + "\n") == int(run.result["text/plain"])
    assert run.stdout.endswith("no newline at the end")
    run = kernel.ok(
        "r = enot_nb.notebook_launcher(faults.big_tensor, args=(300,), nprocs=2, backend='gloo')\n"
        "bool((r == __import__('torch').arange(300 * 2**18, dtype=r.dtype)).all())"
    )
    assert run.result["text/plain"] == "True"


# ----------------------------------------------------------------------------- bad input


OPTION_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 70000), st.floats(allow_nan=True), st.text(max_size=6), st.just(object())
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    options=st.dictionaries(
        st.sampled_from(
            [
                "nprocs",
                "backend",
                "seed",
                "start_method",
                "output",
                "master_port",
                "nnodes",
                "node_rank",
                "max_restarts",
                "timeout",
                "cuda_optimize_for_speed",
                "cuda_reproducible",
            ]
        ),
        OPTION_VALUES,
        min_size=1,
    )
)
# The boundaries, always tried (random draws rarely make every other option valid at once).
@example(options={"nprocs": 2, "timeout": -3})
@example(options={"nprocs": 2, "timeout": 0})
@example(options={"nprocs": 2, "timeout": 365 * 24 * 3600 + 1})
@example(options={"nprocs": 0})
@example(options={"nprocs": 2, "seed": 2**32})
@example(options={"nprocs": 2, "node_rank": 1})
@example(options={"nprocs": 2, "timeout": 30, "seed": 0, "output": "all", "start_method": "spawn"})
def test_bad_launcher_arguments_fail_fast_and_clearly(options):
    before = set(descendants())
    wrong = _wrong_options(options)
    try:
        plan = enot_nb.launcher.plan_launch(enot_nb.launcher.LaunchOptions(**options))
    except enot_nb.EnotNbError as err:
        assert isinstance(err, (ValueError, RuntimeError))
        assert str(err) and "Traceback" not in str(err)
        # The error names an option that the rules below find wrong; only a port may be refused
        # for what this machine does (another process listens there).
        assert err.parameter in wrong or (err.parameter == "master_port" and "master_port" in options), (
            err,
            options,
            wrong,
        )
    else:
        assert not wrong, f"accepted {options}, though {wrong} break the documented rules"
        # What was given is what is planned (nprocs must be given: this machine has no GPU).
        assert plan.nprocs == options["nprocs"]
        assert plan.backend == "gloo"
        assert plan.nnodes == options.get("nnodes", 1) and plan.node_rank == options.get("node_rank", 0)
        assert plan.output == options.get("output", "master")
        assert plan.max_restarts == options.get("max_restarts", 0)
        assert plan.init_kwargs["timeout"] == _expected_timeout(options.get("timeout", 1800))
    assert set(descendants()) - before == set()  # nothing started either way


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _expected_timeout(value) -> datetime.timedelta:
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)
    return datetime.timedelta(seconds=seconds)


def _wrong_options(options: dict) -> set[str]:
    """The options that break the rules the docstrings state, computed here independently of
    enot_nb's own checks, for this machine (no GPU; gloo is the only backend)."""
    wrong = set()
    get = options.get
    if "nprocs" not in options or not (_is_int(get("nprocs")) and get("nprocs") >= 1):
        wrong.add("nprocs")  # no GPU: nprocs has no default here
    if get("backend") not in (None, "gloo"):
        wrong |= {"backend", "nprocs"}  # nccl is refused for want of GPUs, as nprocs > GPUs
    nnodes = get("nnodes", 1)
    if not (_is_int(nnodes) and nnodes >= 1):
        wrong.add("nnodes")
    node_rank = get("node_rank", 0)
    if not (_is_int(node_rank) and node_rank >= 0 and (not _is_int(nnodes) or node_rank < nnodes)):
        wrong.add("node_rank")
    if not (_is_int(get("max_restarts", 0)) and get("max_restarts", 0) >= 0):
        wrong.add("max_restarts")
    seed = get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**32):
        wrong.add("seed")
    if get("output", "master") not in ("master", "all", "none"):
        wrong.add("output")
    if get("start_method") not in (None, "fork", "spawn"):
        wrong.add("start_method")
    timeout = get("timeout", 1800)
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif _is_int(timeout) or isinstance(timeout, float):
        seconds = float(timeout)
    else:
        seconds = math.nan
    if not (0 < seconds <= 365 * 24 * 3600):  # positive, finite, at most a year; NaN fails too
        wrong.add("timeout")
    port = get("master_port")
    if port is None:
        if _is_int(nnodes) and nnodes > 1:
            wrong.add("master_port")  # every node must be told node 0's port
    elif not (_is_int(port) and 1 <= port <= 65535):
        wrong.add("master_port")
    if get("cuda_optimize_for_speed") and get("cuda_reproducible"):
        wrong |= {"cuda_reproducible", "cuda_optimize_for_speed"}
    return wrong


def test_the_independent_rules_find_what_they_should():
    assert _wrong_options({"nprocs": 2}) == set()
    assert _wrong_options({"nprocs": 2, "timeout": -3}) == {"timeout"}
    assert _wrong_options({"nprocs": True}) == {"nprocs"}
    assert _wrong_options({"nprocs": 2, "nnodes": 2}) == {"master_port"}
    assert _wrong_options({"nprocs": 2, "timeout": math.inf, "seed": 2**32}) == {"timeout", "seed"}


LINE_PARTS = st.sampled_from(
    [
        "-n",
        "--nprocs",
        "--backend",
        "--seed",
        "--speed",
        "--reproducible",
        "--start-method",
        "--output",
        "--sync",
        "--no-sync",
        "--return",
        "--no-return",
        "--timeout",
        "--master-port",
        "--nnodes",
        "--node-rank",
        "--max-restarts",
        "--bogus",
        "0",
        "-3",
        "2",
        "x",
        "fork",
        "spawn",
        "all",
        "a,b",
        "1x",
        "''",
        "nccl",
        "gloo",
        "1e9",
        "-",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(parts=st.lists(LINE_PARTS, min_size=1, max_size=6))
@example(parts=["-n", "2", "--timeout", "-3"])
@example(parts=["-n", "2", "--timeout", "0"])
@example(parts=["-n", "0"])
@example(parts=["-n", "2", "--timeout", "2", "--output", "all"])
def test_bad_magic_options_are_usage_errors(parts):
    from IPython.core.error import UsageError

    from enot_nb.magic import parse_options

    line = " ".join(parts)
    try:
        args, plan = parse_options(line)
    except UsageError as err:
        assert str(err).strip()
    else:
        # A valid line: it would launch what it says, read here from the words themselves
        # (the last value given for each flag), not from what the parser made of them.
        assert plan is not None  # no --export among the words
        assert plan.nprocs == int(_last_value(parts, "-n", "--nprocs"))
        assert plan.output == (_last_value(parts, "--output") or "master")
        timeout = float(_last_value(parts, "--timeout") or 1800)
        assert 0 < timeout <= 365 * 24 * 3600 and math.isfinite(timeout)
        assert plan.init_kwargs["timeout"].total_seconds() == timeout


def _last_value(parts: list[str], *flags: str) -> str | None:
    """The word after the last of ``flags`` in a line the magic accepted."""
    at = [i for i, part in enumerate(parts) if part in flags]
    return parts[at[-1] + 1] if at else None


# ----------------------------------------------------------------------------- soak


def _process_figures() -> dict[str, int]:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "children": len(workers_of(os.getpid())),
        "rss_kb": int(status["VmRSS"].split()[0]),
    }


@pytest.mark.timeout(1800)
def test_soak_launches_stay_flat(request):
    launches = 200 if request.config.getoption("--soak") else 20
    for method in METHODS:  # warm-up: clean thread, fork server, lazy imports, allocator pools
        for _ in range(5):
            enot_nb.notebook_launcher(faults.big_tensor, args=(1,), nprocs=2, backend="gloo", start_method=method)
    start = _process_figures()
    begin = time.monotonic()
    for i in range(launches):
        method = METHODS[i % 2]
        if i % 10 == 9:
            with pytest.raises(WorkerFailedError):
                enot_nb.notebook_launcher(
                    faults.fault_job,
                    args=("raise", 1, 0.0, os.devnull, "collective"),
                    nprocs=2,
                    backend="gloo",
                    start_method=method,
                )
        else:
            enot_nb.notebook_launcher(faults.big_tensor, args=(1,), nprocs=2, backend="gloo", start_method=method)
    end = _process_figures()
    record_figure("soak", {"launches": launches, "seconds": time.monotonic() - begin, "start": start, "end": end})
    assert end["fds"] == start["fds"] and end["threads"] == start["threads"]
    assert end["children"] == start["children"]  # (a test kernel may be running)
    assert end["rss_kb"] - start["rss_kb"] < 30 * 1024, (start, end)
