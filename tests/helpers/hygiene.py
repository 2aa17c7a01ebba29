"""Plain Python launchers for the process-hygiene tests; each scenario prints what it saw.

Usage: python -m tests.helpers.hygiene SCENARIO START_METHOD [ARG]
"""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import enot_nb
from enot_nb import distributed as ed
from enot_nb._processes import forkserver_client, starts
from tests._util import LEAK_GRACE, descendants, ended_within, is_fork_server_of, press_before_line


def say(*words: object) -> None:
    print(*words, flush=True)


def leftovers(grace: float = LEAK_GRACE) -> list[int]:
    """Our descendants other than the fork server and the watchdog that outlive ``grace``
    seconds: each one's end is waited for on its pidfd (an event), and only a process that is
    still there after the grace, far beyond any stop's own waits, counts as left behind."""
    return ended_within(lambda: [p for p in descendants() if not is_fork_server_of(p, {os.getpid()})], grace)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ----------------------------------------------------------------------------- jobs (top level)


def early_return_then_fail(flag: str) -> None:
    """Rank 1 returns at once (and is reaped); rank 0 waits for ``flag``, then fails."""
    say(f"rank {ed.get_rank()} pid {os.getpid()}")
    if ed.get_rank() == 0:
        while not os.path.exists(flag):
            time.sleep(0.01)
        raise RuntimeError("rank 0 fails after rank 1 returned")


def with_descendants() -> None:
    """Each worker starts a child and a grandchild (in its own process group), then blocks."""
    child = subprocess.Popen(["sleep", "300"])
    grand = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    grandchild = int(grand.stdout.readline())
    say(f"tree {os.getpid()} {child.pid} {grand.pid} {grandchild}")
    time.sleep(3600)


def trivial() -> int:
    return ed.get_rank() + 41


def ranks_total(tensors: list) -> float:
    return float(sum(t.sum().item() for t in tensors))


def sockets_used() -> dict:
    """The local addresses of every TCP socket this worker has, and the store's listeners."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    mine, listening = [], []
    port = int(os.environ["MASTER_PORT"])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                address, state, inode = fields[1], fields[3], fields[9]
                host, port_hex = address.rsplit(":", 1)
                if inode in inodes:
                    mine.append(host)
                if state == "0A" and int(port_hex, 16) == port:
                    listening.append(host)
    return {"mine": mine, "listening": listening}


def big_result() -> object:
    import torch

    # 2 MiB of values that a wrong result (zeros, another rank's, stale pages) cannot match.
    return torch.arange(2**18, dtype=torch.float64) * 3 + 1 + 1000 * ed.get_rank()


# ----------------------------------------------------------------------------- scenarios


def pid_reuse(method: str, flag: str) -> None:
    try:
        enot_nb.notebook_launcher(
            early_return_then_fail, args=(flag,), nprocs=2, backend="gloo", start_method=method, output="all"
        )
    except enot_nb.WorkerFailedError as err:
        say("failed", err.rank)


def interrupt_at(method: str, step: str) -> None:
    """SIGINT delivered at a named step of the start; then a normal launch must work."""

    def interrupt(*_: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    starts.TEST_HOOKS[step] = interrupt
    if step == "server_starting":
        forkserver_client.shutdown_server()  # the hook fires while a new one starts
    try:
        enot_nb.notebook_launcher(trivial, nprocs=2, backend="gloo", start_method=method)
        say("not interrupted")
    except KeyboardInterrupt:
        say("interrupted")
    starts.TEST_HOOKS.clear()
    left = leftovers()
    say("left", json.dumps(left))
    start = time.monotonic()
    say(
        "next",
        enot_nb.notebook_launcher(trivial, nprocs=2, backend="gloo", start_method=method),
        round(time.monotonic() - start, 2),
    )


def interrupt_sweep(method: str, tries: str) -> None:
    """Wait for "go" on stdin, launch; the test sends SIGINT at a random moment."""
    for _ in range(int(tries)):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        say("ready")
        sys.stdin.readline()
        outcome = "finished"
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            enot_nb.notebook_launcher(trivial, nprocs=2, backend="gloo", start_method=method)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a SIGINT after the launch: not ours
        except KeyboardInterrupt:
            outcome = "interrupted"
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        say(outcome)
        say("left", json.dumps(leftovers()))
    say("ready")
    sys.stdin.readline()  # the last SIGINT is sent before this: the next launch is not its target
    signal.signal(signal.SIGINT, signal.default_int_handler)
    say("next", enot_nb.notebook_launcher(trivial, nprocs=2, backend="gloo", start_method=method))


def rendezvous_folders() -> set[str]:
    """The launch folders in the temporary folder: the rendezvous and the ranks' multiprocessing
    folder (both made, recorded and removed by the attempt)."""
    import glob
    import tempfile

    folder = tempfile.gettempdir()
    patterns = ("enot_nb-rendezvous-*", "pymp-enot_nb-*")
    return {path for pattern in patterns for path in glob.glob(os.path.join(folder, pattern))}


def own_fds() -> int:
    """Open descriptors once the shipped memfds are closed (a thread closes them after the
    launch), less the fork server's socket (a press may replace the server)."""
    import threading

    for thread in threading.enumerate():
        if thread.name == "enot_nb-release":
            thread.join()
    return open_fds() - (forkserver_client._servers.current is not None)


def press_before_every_line(method: str, stride: str) -> None:
    """Launch once per k in 1, 1 + stride, ... with a press before the k-th line enot_nb runs
    in this thread; after each, nothing may be left: no process, descriptor or folder, and the
    launch ended by the press or finished, never with another error. The job takes a 2 MiB
    tensor, which spawned workers get through shared memory (a memfd that must not leak)."""
    import tempfile

    import torch

    tempfile.tempdir = tempfile.mkdtemp(prefix="enot_nb-press-")  # only our folders are counted
    tensors = [torch.ones(2**19)]

    def launch() -> float:
        return enot_nb.notebook_launcher(ranks_total, args=(tensors,), nprocs=2, backend="gloo", start_method=method)

    signal.signal(signal.SIGINT, signal.default_int_handler)
    launch()  # warm
    package = os.path.dirname(enot_nb.__file__)

    def in_scope(code) -> bool:
        return code.co_filename.startswith(package)

    lines, tracer = press_before_line(None, in_scope)
    sys.settrace(tracer)
    launch()
    sys.settrace(None)
    say("lines", lines[0])
    fds, folders = own_fds(), rendezvous_folders()
    pressed = 0
    for k in range(1, lines[0] + 1, int(stride)):
        where: list[str] = []
        _, tracer = press_before_line(k, in_scope, where)
        outcome = "finished"
        faulthandler.dump_traceback_later(30, exit=True)  # a hang fails in seconds, with stacks
        sys.settrace(tracer)
        try:
            launch()
        except KeyboardInterrupt:
            outcome = "interrupted"
            pressed += 1
        except BaseException as err:  # noqa: BLE001 - reported
            outcome = f"{type(err).__name__}: {err}"
        finally:
            sys.settrace(None)
            faulthandler.cancel_dump_traceback_later()
        left = leftovers()
        new_folders = sorted(rendezvous_folders() - folders)
        if outcome not in ("finished", "interrupted") or left or new_folders or own_fds() != fds:
            say(
                "bad",
                json.dumps(
                    {
                        "line": k,
                        "where": where,
                        "outcome": outcome,
                        "left": left,
                        "folders": new_folders,
                        "fds": [fds, own_fds()],
                    }
                ),
            )
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            fds, folders = own_fds(), rendezvous_folders()
    say("pressed", pressed)
    say("next", launch())
    os.rmdir(tempfile.tempdir)


def descendants_then_block(method: str) -> None:
    enot_nb.notebook_launcher(with_descendants, nprocs=2, backend="gloo", start_method=method, output="all")


def fd_limit(method: str) -> None:
    import resource

    enot_nb.notebook_launcher(trivial, nprocs=2, backend="gloo", start_method=method)  # warm
    before = open_fds()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (before + 40, hard))
    try:
        enot_nb.notebook_launcher(trivial, nprocs=30, backend="gloo", start_method=method)
        say("started anyway")
    except enot_nb.LaunchError as err:
        say("error", json.dumps(str(err)))
    say("fds", before, open_fds())
    say("left", json.dumps(leftovers()))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    say("next", enot_nb.notebook_launcher(trivial, nprocs=2, backend="gloo", start_method=method))


def launch_refused(method: str, fault: str, refuse: Callable[..., None], nprocs: int = 2) -> None:
    """One launch with ``refuse`` called at the named fault point: say its error, the
    descriptors before and after, the processes left, and what the next launch returns."""
    before = open_fds()
    starts.TEST_HOOKS[fault] = refuse
    try:
        enot_nb.notebook_launcher(trivial, nprocs=nprocs, backend="gloo", start_method=method)
        say("started anyway")
    except enot_nb.LaunchError as err:
        say("error", json.dumps(str(err)))
    starts.TEST_HOOKS.clear()
    say("fds", before, open_fds())
    say("left", json.dumps(leftovers()))
    say("next", enot_nb.notebook_launcher(trivial, nprocs=2, backend="gloo", start_method=method))


def fork_fails(method: str) -> None:
    def refuse(rank: int) -> None:
        if rank == 1:
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    enot_nb.notebook_launcher(trivial, nprocs=2, backend="gloo", start_method=method)  # warm
    launch_refused(method, "fork", refuse, nprocs=3)


def watchdog_fails(method: str) -> None:
    """The first launch of this process, whose watchdog cannot start: one clear error, and no
    rendezvous folder, descriptor or process left (then the next launch works)."""
    import tempfile

    tempfile.tempdir = tempfile.mkdtemp(prefix="watchdog-fails-")  # where the folders would be

    def refuse() -> None:
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    launch_refused(method, "watchdog_starting", refuse)
    say("folders", json.dumps(os.listdir(tempfile.tempdir)))  # the next launch's is gone too
    os.rmdir(tempfile.tempdir)


def sockets(method: str, port: str) -> None:
    kwargs = {"master_port": int(port)} if port != "none" else {}
    result = enot_nb.notebook_launcher(sockets_used, nprocs=2, backend="gloo", start_method=method, **kwargs)
    say("sockets", json.dumps(result))


def kept_results(method: str) -> None:
    kept = [enot_nb.notebook_launcher(big_result, nprocs=2, backend="gloo", start_method=method)]
    before = open_fds()
    for _ in range(49):
        kept.append(enot_nb.notebook_launcher(big_result, nprocs=2, backend="gloo", start_method=method))
    say("fds", before, open_fds(), len(kept), float(sum(t.sum() for t in kept)))


def many_tensors(method: str) -> None:
    import torch

    tensors = [torch.full((2**18,), float(i)) for i in range(300)]  # 300 x 1 MiB
    total = enot_nb.notebook_launcher(ranks_total, args=(tensors,), nprocs=2, backend="gloo", start_method=method)
    say("total", total, float(sum(t.sum().item() for t in tensors)))


if __name__ == "__main__":
    scenario, *arguments = sys.argv[1:]
    globals()[scenario](*arguments)
