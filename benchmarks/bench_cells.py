"""In a real kernel: state return, output throughput and latency, and training speed.

* State return: a cell that creates a ResNet-50-sized model, with and without bringing it
  back, run alternately (the median of the pairs' differences) against a local cloudpickle
  round trip of the same object.
* A spawned cell reading a 2 GiB notebook tensor, against one local copy of that tensor.
* State parity: a cell that changes nothing in a notebook holding 2 GiB of tensors, against the
  same trivial cell in a notebook holding none; a cell that updates a ResNet-50-sized model in
  place (with and without the return, alternately), against a local cloudpickle round trip;
  the peak host memory (PSS of kernel and workers) against the kernel's before the cell.
* Output: 100,000 printed lines from the master against the same cell run locally; and the
  delay from a worker's print to its arrival at the notebook client.
* Widgets: an IntProgress updated 1,000 times from the master, against a local cell: the
  updates' pace and the delay from each update to its arrival at the client.
* Training: DDP steps per second in a cell against the same code under torchrun.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks.harness import Row, kernel_json, median, start_kernel, torchrun_json

SETUP = r"""
import json, os, time, torch, cloudpickle
%load_ext enot_nb
NPROCS = torch.cuda.device_count() or 2
from benchmarks.shapes import resnet50_like
from benchmarks.harness import timed as times, paired_cost
def cell(options, body):
    return lambda: get_ipython().run_cell_magic("enot_distributed", f"-n {NPROCS} {options}", body)
MAKE = "from benchmarks.shapes import resnet50_like\ntorch.manual_seed(0)\nnet = resnet50_like()"
local_net = resnet50_like()
"""


def state_return(kernel, repeats: int) -> list[Row]:
    found = kernel_json(
        kernel,
        f"""
cost = paired_cost(cell("--no-return", MAKE), cell("", MAKE), {repeats})
local = times(lambda: cloudpickle.loads(cloudpickle.dumps(local_net)), {repeats})
print("RESULT", json.dumps([cost, local]))""",
    )
    cost, local = (median(v) for v in found)
    return [
        Row(
            "state return (ResNet-50-sized model, 102 MB)",
            "local cloudpickle round trip (reference)",
            local,
            "s",
            "local round trip",
            1.0,
            "",
            repeats,
        ),
        Row(
            "state return (ResNet-50-sized model, 102 MB)",
            "bringing it back from the master",
            cost,
            "s",
            "local round trip",
            cost / local,
            "<= 2x",
            repeats,
        ),
    ]


MEMORY = r'''
def tree_pss_kb():
    """PSS of the kernel and every process below it: shared pages counted once in all."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):
            continue
    tree, grew = {os.getpid()}, True
    while grew:
        below = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    total = 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(l.split()[1]) for l in f if l.startswith("Pss:"))
        except OSError:
            pass  # ended meanwhile
    return total
def peak_gib(body):
    """The kernel's memory before the cell, and the most host memory the kernel and its workers
    held together while the cell ran (PSS, sampled every 10 ms), in GiB."""
    import threading
    before = tree_pss_kb()
    done, peak = threading.Event(), [before]
    def sample():
        while not done.wait(0.01):
            peak[0] = max(peak[0], tree_pss_kb())
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        get_ipython().run_cell_magic("enot_distributed", f"-n {NPROCS}", body)
    finally:
        done.set()
        sampler.join()
    return before / 2**20, max(peak[0], tree_pss_kb()) / 2**20
'''


BEFORE = "host memory before the cell (kernel PSS, reference)"
PEAK = "peak host memory during the cell (PSS of kernel + workers, sampled every 10 ms)"


def state_parity(kernel, repeats: int) -> list[Row]:
    """What tracking the notebook's objects costs: nothing changed, and a model changed in place."""
    found = kernel_json(
        kernel,
        MEMORY
        + f"""
for name in ("net", "local_net"):  # left by the state-return rows: this notebook holds only...
    globals().pop(name, None)
TRIVIAL = "x = 1"
empty = times(cell("", TRIVIAL), {repeats})
held = {{i: torch.zeros(2**26) for i in range(8)}}  # ...8 x 256 MiB = 2 GiB of float32
untracked = times(cell("--no-return", TRIVIAL), {repeats})
heavy = times(cell("", TRIVIAL), {repeats})
heavy_before, heavy_peak = peak_gib(TRIVIAL)
del held
net = resnet50_like()
UPDATE = "for p in net.parameters():\\n    p.data.add_(0.01)"
update_cost = paired_cost(cell("--no-return", UPDATE), cell("", UPDATE), {repeats})
update_before, update_peak = peak_gib(UPDATE)
local = times(lambda: cloudpickle.loads(cloudpickle.dumps(net)), {repeats})
del net
print("RESULT", json.dumps([empty, untracked, heavy, heavy_before, heavy_peak, update_cost,
                            update_before, update_peak, local]))""",
    )
    (empty, untracked, heavy, heavy_before, heavy_peak, cost, update_before, update_peak, local) = found
    empty, untracked, heavy, cost, local = map(median, (empty, untracked, heavy, cost, local))
    name = "state parity: a cell that changes nothing, 2 GiB of tensors in the notebook"
    update = "state parity: a ResNet-50-sized model (102 MB) updated in place in a cell"
    return [
        Row(
            name,
            "the same cell with --no-return: nothing tracked (reference)",
            untracked,
            "s",
            "untracked cell",
            1.0,
            "",
            repeats,
        ),
        Row(
            name,
            "the cell, every object tracked (pagemap)",
            heavy,
            "s",
            "untracked cell",
            heavy / untracked,
            "<= 1.2x",
            repeats,
        ),
        Row(
            name, "the cell in a notebook holding nothing", empty, "s", "untracked cell", empty / untracked, "", repeats
        ),
        Row(name, BEFORE, heavy_before, "GiB", "kernel before", 1.0, "", 1),
        Row(name, PEAK, heavy_peak, "GiB", "kernel before", heavy_peak / heavy_before, "", 1),
        Row(update, "local cloudpickle round trip (reference)", local, "s", "local round trip", 1.0, "", repeats),
        Row(
            update,
            "bringing the changes back from the master",
            cost,
            "s",
            "local round trip",
            cost / local,
            "<= 0.68x",
            repeats,
        ),
        Row(update, BEFORE, update_before, "GiB", "kernel before", 1.0, "", 1),
        Row(update, PEAK, update_peak, "GiB", "kernel before", update_peak / update_before, "", 1),
    ]


COST = r"""
def cleared():
    for name in [n for n in globals() if n.startswith("held_")]:
        del globals()[name]
    import gc
    gc.collect()
"""


def state_cost(kernel, repeats: int) -> list[Row]:
    """A cell costs what it reaches and changes: a trivial fork cell beside a 500,000-sample
    dataset or a million small dicts it does not use, a cell that reads the dataset, one element
    written into 1 GiB (with and without a live forked child of the master), and the memory a
    kernel keeps after three cells that each keep a small tensor of a 256 MiB result."""
    found = kernel_json(
        kernel,
        COST
        + MEMORY
        + f"""
import pickle, zlib
for name in ("net", "local_net"):
    globals().pop(name, None)
TRIVIAL = "x = 1"
empty = times(cell("", TRIVIAL), {repeats})
held_samples = [(f"/data/train/class{{i % 1000}}/img{{i}}.jpg", i % 1000) for i in range(500_000)]
with_samples = times(cell("", TRIVIAL), {repeats})
reads = paired_cost(cell("", TRIVIAL), cell("", "n = len(held_samples)"), {repeats})
digest = times(lambda: zlib.crc32(pickle.dumps(held_samples, 5)), {repeats})
cleared()
held_dicts = [{{"id": i, "label": i % 10}} for i in range(1_000_000)]
with_dicts = times(cell("", TRIVIAL), {repeats})
dicts_untracked = times(cell("--no-return", TRIVIAL), {repeats})
cleared()
held_big = torch.zeros(2**28)  # 1 GiB of float32
WRITE = "held_big[12345] = 1.0"
write_cost = paired_cost(cell("--no-return", WRITE), cell("", WRITE), {repeats})
CHILD = ("import multiprocessing as _mp, time as _t\\n_c = _mp.get_context('fork').Process(target=_t.sleep, "
         "args=(60,), daemon=True)\\n_c.start()\\n" + WRITE + "\\ndel _c")
child_cost = paired_cost(cell("--no-return", CHILD), cell("", CHILD), {repeats})
whole = times(lambda: held_big.clone(), {repeats})
cleared()
before = tree_pss_kb()
history = []
for _ in range(3):
    cell("", "step = torch.ones(2**26)\\nhistory.append(step[:4].clone())")()
    globals().pop("step", None)
import gc; gc.collect()
retained = (tree_pss_kb() - before) / 2**10
peak_before, peak = peak_gib("step = torch.ones(2**26)\\nhistory.append(step[:4].clone())")
globals().pop("step", None)
history.clear()
print("RESULT", json.dumps([empty, with_samples, reads, digest, with_dicts, dicts_untracked, write_cost,
                            child_cost, whole, retained, peak_before, peak]))""",
        timeout=1800,
    )
    (empty, with_samples, reads, digest, with_dicts, dicts_untracked, write_cost, child_cost, whole) = map(
        median, found[:9]
    )
    retained, peak_before, peak = found[9:]
    trivial = "state cost: a trivial fork cell (x = 1) beside data it does not use"
    read = "state cost: a fork cell that reads the 500,000 samples (n = len(samples))"
    write = "state cost: one element written into a 1 GiB notebook tensor (fork)"
    memory = "state cost: 3 cells, each making 256 MiB and keeping 16 bytes of it"
    return [
        Row(trivial, "an empty notebook (reference)", empty, "s", "empty notebook", 1.0, "", repeats),
        Row(
            trivial,
            "500,000 (path, label) samples in the notebook",
            with_samples,
            "s",
            "empty notebook",
            with_samples / empty,
            "<= 1.2x",
            repeats,
        ),
        Row(
            trivial,
            "1,000,000 small dicts in the notebook",
            with_dicts,
            "s",
            "empty notebook",
            with_dicts / empty,
            "<= 1.2x",
            repeats,
        ),
        Row(
            trivial,
            "1,000,000 small dicts, --no-return (nothing walked: the fork alone)",
            dicts_untracked,
            "s",
            "empty notebook",
            dicts_untracked / empty,
            "",
            repeats,
        ),
        Row(read, "one digest of the samples, pickle + crc32 (reference)", digest, "s", "one digest", 1.0, "", repeats),
        Row(read, "extra time over the trivial cell", reads, "s", "one digest", reads / digest, "<= 1 digest", repeats),
        Row(
            write,
            "one copy of the 1 GiB tensor: what sending it whole costs at least (reference)",
            whole,
            "s",
            "one copy",
            1.0,
            "",
            repeats,
        ),
        Row(
            write,
            "bringing it back, over --no-return",
            write_cost,
            "s",
            "one copy",
            write_cost / whole,
            "a few pages + a constant",
            repeats,
        ),
        Row(
            write,
            "the same, with a live forked child of the master",
            child_cost,
            "s",
            "one copy",
            child_cost / whole,
            "a few pages + a constant",
            repeats,
        ),
        Row(
            memory,
            "kernel PSS kept after the 3 cells (the kept slices: 48 bytes)",
            retained,
            "MiB",
            "",
            None,
            "a few MiB",
            1,
        ),
        Row(
            memory,
            "one such cell: host memory before it (kernel PSS, reference)",
            peak_before,
            "GiB",
            "kernel before",
            1.0,
            "",
            1,
        ),
        Row(
            memory,
            "one such cell: peak (PSS of kernel + workers, sampled every 10 ms)",
            peak,
            "GiB",
            "kernel before",
            peak / peak_before,
            "",
            1,
        ),
    ]


DDP_CELL = (
    "from torch.nn.parallel import DistributedDataParallel\nddp = DistributedDataParallel(model)\n"
    "optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)\nfor step in range(10):\n"
    "    loss = ddp(torch.randn(32, 16)).pow(2).mean()\n    optimizer.zero_grad()\n"
    "    loss.backward()\n    optimizer.step()\n"
)


def ddp_cell(kernel, repeats: int, method: str) -> list[Row]:
    """The README's DDP cell, second and later runs in one kernel: what the first run's workers
    imported (torch._dynamo, 822 modules) is kept in the kernel and the fork server (preload).
    A fresh kernel per start method: its first run must be the first import of torch._dynamo."""
    found = kernel_json(
        kernel,
        f"""
model = torch.nn.Linear(16, 4)
from enot_nb._worker import preload
out = {{}}
run = cell("--seed 0 --start-method {method}", {DDP_CELL!r})
out["trivial"] = times(cell("--start-method {method}", "x = 1"), {repeats})
start = time.perf_counter(); run(); out["first"] = [time.perf_counter() - start]
preload.PRELOADER.wait()
out["later"] = times(run, {repeats}, warmup=0)
print("RESULT", json.dumps(out))""",
    )
    trivial, first, later = (median(found[k]) for k in ("trivial", "first", "later"))
    name = "the README's DDP cell in one kernel"
    return [
        Row(name, f"{method}: a trivial cell (x = 1, reference)", trivial, "s", "trivial cell", 1.0, "", repeats),
        Row(name, f"{method}: first run (imports torch._dynamo)", first, "s", "trivial cell", first / trivial, "", 1),
        Row(name, f"{method}: second and later runs", later, "s", "trivial cell", later / trivial, "<= 0.5 s", repeats),
    ]


def big_tensor(kernel, repeats: int) -> list[Row]:
    """A spawned cell (as when CUDA is initialized in the kernel) that reads a 2 GB tensor."""
    found = kernel_json(
        kernel,
        f"""
big = torch.zeros(2**29)  # 2 GiB of float32
reads = times(cell("--start-method spawn --no-return", "first = big[0].item()"), {repeats})
skips = times(cell("--start-method spawn --no-return", "first = 0.0"), {repeats})
copy = times(lambda: big.clone(), {repeats})
del big
print("RESULT", json.dumps([reads, skips, copy]))""",
    )
    reads, skips, copy = (median(v) for v in found)
    return [
        Row(
            "a spawned cell reading a 2 GiB notebook tensor",
            "one local copy of it (reference)",
            copy,
            "s",
            "one copy",
            1.0,
            "",
            repeats,
        ),
        Row(
            "a spawned cell reading a 2 GiB notebook tensor",
            "extra time over a cell that does not",
            reads - skips,
            "s",
            "one copy",
            (reads - skips) / copy,
            "<= 1 copy",
            repeats,
        ),
    ]


def output(kernel, repeats: int) -> list[Row]:
    body = "for i in range(100_000):\n    print(i)"

    def cell_seconds(code: str) -> float:
        start = time.perf_counter()
        run = kernel.run(code, timeout=300)
        assert run.error is None and run.stdout.count("\n") >= 100_000, run.stderr[-500:]
        return time.perf_counter() - start

    local = median([cell_seconds(body) for _ in range(repeats)])
    ours = median([cell_seconds(f"%%enot_distributed -n 2 --no-return\n{body}") for _ in range(repeats)])
    rows = [
        Row(
            "output: 100,000 lines from the master",
            "local cell (reference)",
            100_000 / local,
            "lines/s",
            "local cell",
            1.0,
            "",
            repeats,
        ),
        Row(
            "output: 100,000 lines from the master",
            "%%enot_distributed",
            100_000 / ours,
            "lines/s",
            "local cell",
            local / ours,
            ">= 0.5x throughput",
            repeats,
        ),
    ]
    for label, prefix in (("local cell", ""), ("%%enot_distributed", "%%enot_distributed -n 2 --no-return\n")):
        delays: list[float] = []

        def on_output(run, delays=delays):
            now = time.time()
            for line in run.stdout.splitlines()[len(delays) :]:
                if line.startswith("stamp "):
                    delays.append(now - float(line.split()[1]))

        kernel.run(
            prefix + "import time\nfor _ in range(20):\n    print('stamp', time.time(), flush=True)\n"
            "    time.sleep(0.05)",
            timeout=120,
            on_output=on_output,
        )
        rows.append(
            Row(
                "output: print-to-notebook delay",
                label,
                median(delays),
                "s",
                "",
                None,
                "<= 0.05 s" if prefix else "",
                len(delays),
            )
        )
    return rows


WIDGET_UPDATES = """
import ipywidgets, time
bar = ipywidgets.IntProgress(max=UPDATES)
display(bar)
for i in range(UPDATES):
    bar.description = f"{i} {time.time()!r}"  # the client reads the send time back
    bar.value = i + 1
    time.sleep(PAUSE)
del bar
"""


def _widget_stamps(kernel, code: str) -> list[tuple[float, float]]:
    """(sent, received) of each description update of the cell's IntProgress."""
    run = kernel.run(code, timeout=300)
    assert run.error is None, run.traceback
    return [
        (float(m["content"]["data"]["state"]["description"].split()[1]), m["received"])
        for m in run.comms
        if m["msg_type"] == "comm_msg" and "description" in m["content"]["data"].get("state", {})
    ]


def widgets(kernel, repeats: int, updates: int = 1000) -> list[Row]:
    """A widget updated in a loop, in a local cell and from the master of a distributed one (fork
    and spawn): the pace of 1,000 updates as fast as they go, and the delay from an update to
    the client when they come 50 ms apart (a burst measures the client's queue, not the delay)."""
    variants = [
        ("local cell (reference)", ""),
        ("%%enot_distributed, fork", "%%enot_distributed -n 2 --no-return --start-method fork\n"),
        ("%%enot_distributed, spawn", "%%enot_distributed -n 2 --no-return --start-method spawn\n"),
    ]
    burst = WIDGET_UPDATES.replace("UPDATES", str(updates)).replace("PAUSE", "0")
    paced = WIDGET_UPDATES.replace("UPDATES", "20").replace("PAUSE", "0.05")
    rates: dict[str, float] = {}
    delays: dict[str, list[float]] = {}
    for label, prefix in variants:
        per_run = []
        for _ in range(repeats):
            stamps = _widget_stamps(kernel, prefix + burst)
            assert len(stamps) == updates, len(stamps)
            per_run.append(updates / (stamps[-1][1] - stamps[0][0]))  # first sent to last received
        rates[label] = median(per_run)
        delays[label] = [received - sent for sent, received in _widget_stamps(kernel, prefix + paced)]
    reference = variants[0][0]
    rows = [
        Row(
            f"widgets: {updates} updates of an IntProgress, to the client",
            label,
            rates[label],
            "updates/s",
            "local cell",
            rates[label] / rates[reference],
            ">= 0.5x" if prefix else "",
            repeats,
        )
        for label, prefix in variants
    ]
    rows += [
        Row(
            "widgets: update-to-client delay",
            label,
            median(delays[label]),
            "s",
            "local cell",
            median(delays[label]) / median(delays[reference]),
            "<= 0.05 s" if prefix else "",
            len(delays[label]),
        )
        for label, prefix in variants
    ]
    return rows


def training(kernel, rounds: int = 3) -> list[Row]:
    """Alternate the two, ``rounds`` times each: the machine's noise hits both alike."""
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(
            kernel_json(
                kernel,
                """
from benchmarks import train_job
get_ipython().run_cell_magic("enot_distributed", f"-n {NPROCS} --return rate",
                             "from benchmarks import train_job\\nrate = train_job.steps_per_second()")
print("RESULT", json.dumps(rate))""",
            )
        )
        theirs.append(torchrun_json("train_job.py"))
    return [
        Row(
            "training: DDP steps/s after start-up",
            "torchrun script (reference)",
            median(theirs),
            "steps/s",
            "torchrun",
            1.0,
            "",
            rounds,
        ),
        Row(
            "training: DDP steps/s after start-up",
            "%%enot_distributed",
            median(ours),
            "steps/s",
            "torchrun",
            median(ours) / median(theirs),
            ">= 0.97x",
            rounds,
        ),
    ]


@contextmanager
def _kernel() -> Iterator[Any]:
    """A real kernel with SETUP run; shut down on the way out."""
    kernel = start_kernel()
    try:
        kernel.ok(SETUP)
        yield kernel
    finally:
        kernel.shutdown()


def run(repeats: int = 5) -> list[Row]:
    return run_ddp_cell(repeats) + _run_shared(repeats)


def _run_shared(repeats: int) -> list[Row]:
    with _kernel() as kernel:
        return (
            state_return(kernel, repeats)
            + state_parity(kernel, repeats)
            + state_cost(kernel, repeats)
            + big_tensor(kernel, max(3, repeats // 2))
            + output(kernel, max(3, repeats // 2))
            + widgets(kernel, max(3, repeats // 2))
            + training(kernel)
        )


def run_widgets(repeats: int = 5) -> list[Row]:
    """Only the widget rows (``run_all.py --only widgets``)."""
    with _kernel() as kernel:
        return widgets(kernel, repeats)


def run_state(repeats: int = 5) -> list[Row]:
    """Only the state-return and state-parity rows (``run_all.py --only state``)."""
    with _kernel() as kernel:
        return state_return(kernel, repeats) + state_parity(kernel, repeats) + state_cost(kernel, repeats)


def run_ddp_cell(repeats: int = 5) -> list[Row]:
    """The README DDP cell rows (``run_all.py --only ddp``), a fresh kernel per start method."""
    rows = []
    for method in ("fork", "spawn"):
        with _kernel() as kernel:
            rows += ddp_cell(kernel, repeats, method)
    return rows


def run_state_cost(repeats: int = 5) -> list[Row]:
    """Only the state-cost rows (``run_all.py --only state-cost``)."""
    with _kernel() as kernel:
        return state_cost(kernel, repeats)
