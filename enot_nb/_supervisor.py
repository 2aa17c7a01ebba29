"""Supervising one attempt of a launch: start -> supervise -> collect -> close.

The launcher (enot_nb.launcher) validates and plans; this module runs the plan once. Workers
are watched through their pipes (output, messages) and their exits (a pidfd per forked worker,
or the fork server's "exit" messages); the first failure stops every other worker's process
group (SIGTERM, then SIGKILL after STOP_GRACE); an interrupt first asks each rank for its stack.
Whatever happens, ``close`` kills and reaps every worker before the attempt returns or raises.
"""

from __future__ import annotations

import os
import pickle
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from enot_nb import _channel, _pickling, _spawn, _worker
from enot_nb._output import StreamSink
from enot_nb.errors import LaunchError, LaunchInterrupted, WorkerFailure

if TYPE_CHECKING:
    from enot_nb.launcher import LaunchPlan

# Seconds a signal gets to stop the workers before the next, harsher one (SIGINT, SIGTERM, SIGKILL).
STOP_GRACE = float(os.environ.get("ENOT_NB_STOP_GRACE", "1.0"))
# Seconds the workers get to print their stacks after an interrupt.
STACK_DUMP_WAIT = float(os.environ.get("ENOT_NB_STACK_DUMP_WAIT", "1.0"))
# Seconds an interrupted master gets, alone, to send the state it reached (a stopped cell keeps
# it, as a local cell would); with the stack dump and the stop of the others, within 5 s.
INTERRUPT_SAVE_WAIT = float(os.environ.get("ENOT_NB_INTERRUPT_SAVE_WAIT", "2.0"))
# Rendezvous of a one-node launch: "file" (a FileStore in a private temporary folder) or "tcp"
# (torchrun's env://). Measured here on torch 2.13: with the TCP store, init_process_group stalls
# for 5 s in about 2% of launches (a hand-rolled os.fork launcher too: 4 of 150); with the file
# store, none in 150. Multi-node launches and an explicit master_port always use TCP.
RENDEZVOUS = os.environ.get("ENOT_NB_RENDEZVOUS", "file")

# Errors that a rank raises *because* a peer died: never the root cause when another exists.
_PEER_LOSS_WORDS = ("Connection closed by peer", "Connection reset", "Broken pipe", "remote process",
                    "communicator was aborted", "Socket Timeout", "ECONNRESET", "Connection refused",
                    "closed by peer", "unexpected EOF")


def bind_port(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
    sock.bind((address, port))
    return sock


def free_port(address: str) -> int:
    """A port on ``address`` that nothing listens on now."""
    with bind_port(address, 0) as sock:
        return sock.getsockname()[1]


def rank_environment(plan: LaunchPlan, local_rank: int, port: int, attempt: int) -> dict[str, str]:
    """The caller's environment plus torchrun's variables for one rank."""
    env = dict(os.environ)
    env.update(
        WORLD_SIZE=str(plan.world_size), RANK=str(plan.node_rank * plan.nprocs + local_rank),
        LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(plan.nprocs),
        NODE_RANK=str(plan.node_rank), GROUP_RANK=str(plan.node_rank),
        MASTER_ADDR=plan.master_addr, MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT=str(attempt), OMP_NUM_THREADS=str(plan.threads),
    )
    return env


@dataclass
class _Rank:
    """The launcher's view of one worker."""

    rank: int
    local_rank: int
    pipes: dict[str, tuple[int, int]]  # "out"/"err"/"msg" -> (read end, write end)
    sinks: dict[str, StreamSink]
    messages: _channel.MessageReader = field(default_factory=_channel.MessageReader)
    pid: int | None = None
    exitcode: int | None = None
    outcome: str | None = None  # "result", "done" or "error"
    payload: Any = None
    partial: Any = None  # rank 0's state at an interrupt or failure ("partial" message)
    stack_text: str = ""
    open_reads: set[str] = field(default_factory=lambda: {"out", "err", "msg"})

    @property
    def running(self) -> bool:
        return self.pid is not None and self.exitcode is None


def _make_ranks(plan: LaunchPlan) -> list[_Rank]:
    ranks = []
    for local_rank in range(plan.nprocs):
        rank = plan.node_rank * plan.nprocs + local_rank
        show = plan.output == "all" or (plan.output == "master" and rank == 0)
        prefix = f"[rank {rank}] " if plan.output == "all" else ""
        ranks.append(_Rank(
            rank=rank, local_rank=local_rank,
            pipes={name: os.pipe() for name in ("out", "err", "msg")},
            sinks={"out": StreamSink("stdout", show, prefix), "err": StreamSink("stderr", show, prefix)},
        ))
    return ranks


class _ForkedGroup:
    """Workers forked from this process (from the clean thread); exits seen through pidfds."""

    def __init__(self, ranks: list[_Rank], specs: list[_worker.WorkerSpec], job: _worker.Job):
        self.pidfds: dict[int, int] = {}
        self._pid_to_rank: dict[int, _Rank] = {}
        for r, spec in zip(ranks, specs):
            r.pid = _spawn.fork(lambda spec=spec: _worker.run(spec, lambda: job))
            self._pid_to_rank[r.pid] = r
            try:
                os.setpgid(r.pid, r.pid)  # also done by the child; whoever runs first wins
            except OSError:
                pass
            if hasattr(os, "pidfd_open"):
                self.pidfds[os.pidfd_open(r.pid)] = r.pid

    def sources(self) -> list[int]:
        return list(self.pidfds)

    def pending(self) -> bool:
        return False

    poll_interval = None if hasattr(os, "pidfd_open") else 0.05

    def exits(self, ready: int | None) -> list[tuple[int, int]]:
        """(rank, exitcode) of workers that ended; ``ready`` is the pidfd that fired, if any."""
        pids = [self.pidfds.pop(ready)] if ready in self.pidfds else list(self._pid_to_rank)
        if ready is not None:
            os.close(ready)
        ended = []
        for pid in pids:
            waited, status = os.waitpid(pid, 0 if ready is not None else os.WNOHANG)
            if waited:
                ended.append((self._pid_to_rank.pop(pid).rank, os.waitstatus_to_exitcode(status)))
        return ended

    def close(self) -> None:
        for pidfd in self.pidfds:
            os.close(pidfd)
        for pid in self._pid_to_rank:
            os.waitpid(pid, 0)  # every worker was SIGKILLed: this returns at once


class _ServerGroup:
    """Workers forked by the fork server; exits arrive as its messages."""

    poll_interval = None

    def __init__(self, ranks: list[_Rank], specs: list[_worker.WorkerSpec],
                 shipped: tuple[bytes, list[int]], result_fd: int | None):
        self.server = _spawn.fork_server()
        job_bytes, shared_memory = shipped
        result = [result_fd] if result_fd is not None else []
        fds = [r.pipes[name][1] for r in ranks for name in ("out", "err", "msg")] + result + shared_memory
        self.launch_id, pids = self.server.launch(specs, fds, job_bytes, len(result))
        self._pending = {r.rank for r in ranks}
        for r in ranks:
            r.pid = pids[r.rank]

    def sources(self) -> list[socket.socket]:
        return [self.server.sock]

    def pending(self) -> bool:
        """Messages already read off the socket (behind "started", say) that select cannot see."""
        return bool(self.server.reader.pending)

    def exits(self, ready: Any) -> list[tuple[int, int]]:
        """The buffered messages, or else the server's next one (blocking)."""
        messages = [] if self.server.reader.pending else [self.server.next_message()]
        while self.server.reader.pending:
            messages.append(self.server.reader.pending.popleft())
        ended = []
        for message in messages:
            if message[0] == "exit" and message[1] == self.launch_id:
                self._pending.discard(message[2])
                ended.append((message[2], message[3]))
        return ended

    def close(self) -> None:
        try:
            while self._pending:  # keep the protocol in step for the next launch
                self.exits(None)
        except LaunchError:
            _spawn.shutdown_server()


# ----------------------------------------------------------------------------- supervise


@dataclass
class _Outcome:
    ok: bool
    result: Any = None
    failures: list[WorkerFailure] = field(default_factory=list)
    partial: Any = None


class Attempt:
    """One start of the whole group: start -> supervise -> collect -> close."""

    def __init__(self, plan: LaunchPlan, job: _worker.Job, shipped: tuple[bytes, list[int]] | None,
                 attempt: int):
        self.plan, self.job, self.shipped, self.attempt = plan, job, shipped, attempt
        self.ranks: list[_Rank] = []
        self.group: _ForkedGroup | _ServerGroup | None = None
        self.failures: list[WorkerFailure] = []
        self.result_fd: int | None = None
        self.rendezvous_dir: str | None = None
        self.stopping_since: float | None = None
        self.capturing_stacks = False
        self.selector = selectors.DefaultSelector()

    def run(self) -> _Outcome:
        try:
            self._start()
            self._supervise()
            return self._collect()
        except KeyboardInterrupt:
            self._interrupt()
            raise LaunchInterrupted(self._partial()) from None
        finally:
            self._close()

    def _start(self) -> None:
        plan = self.plan
        port = plan.master_port or free_port(plan.master_addr)
        self.ranks = _make_ranks(plan)
        for r in self.ranks:  # from here on, _close closes every read end through the selector
            for name in ("out", "err", "msg"):
                os.set_blocking(r.pipes[name][0], False)
                self.selector.register(r.pipes[name][0], selectors.EVENT_READ, (r, name))
        try:
            self._start_group(plan, port)
        finally:
            for r in self.ranks:  # our copies of the workers' ends: EOF comes when they exit
                for name in ("out", "err", "msg"):
                    os.close(r.pipes[name][1])
        assert self.group is not None
        for source in self.group.sources():
            self.selector.register(source, selectors.EVENT_READ, None)

    def _start_group(self, plan: LaunchPlan, port: int) -> None:
        """Describe each rank (environment, descriptors) and start the group."""
        if plan.node_rank == 0:  # global rank 0 runs here
            self.result_fd = _pickling.result_fd()
        fork = plan.start_method == "fork"
        init_kwargs = dict(plan.init_kwargs)
        if RENDEZVOUS == "file" and plan.nnodes == 1 and plan.master_port is None:
            self.rendezvous_dir = tempfile.mkdtemp(prefix="enot_nb-rendezvous-")  # mode 0700
            init_kwargs["init_method"] = f"file://{self.rendezvous_dir}/store"
        read_ends = [p[0] for r in self.ranks for p in r.pipes.values()]
        specs = []
        for r in self.ranks:
            others = read_ends + [p[1] for o in self.ranks if o is not r for p in o.pipes.values()]
            specs.append(_worker.WorkerSpec(
                rank=r.rank, env=rank_environment(plan, r.local_rank, port, self.attempt),
                cwd=os.getcwd(), sys_path=[p for p in sys.path if isinstance(p, str)],
                threads=plan.threads, init_kwargs=init_kwargs, parent_pid=os.getpid(),
                stdout_fd=r.pipes["out"][1], stderr_fd=r.pipes["err"][1],
                message_fd=r.pipes["msg"][1], close_fds=others if fork else [],
                result_fd=self.result_fd,
            ))
        if fork:
            self.group = _ForkedGroup(self.ranks, specs, self.job)
        else:
            self.group = _ServerGroup(self.ranks, specs, self.shipped, self.result_fd)

    def _supervise(self) -> None:
        assert self.group is not None
        while any(r.exitcode is None for r in self.ranks):
            timeout = self.group.poll_interval
            if self.stopping_since is not None:
                left = self.stopping_since + STOP_GRACE - time.monotonic()
                if left <= 0:
                    self._signal_running(signal.SIGKILL)
                    left = STOP_GRACE
                timeout = left if timeout is None else min(timeout, left)
            events = self._select(timeout)
            self._handle(events)
            if not events and self.group.poll_interval is not None:
                self._on_exits(self.group.exits(None))
            if self.failures and self.stopping_since is None:
                self.stopping_since = time.monotonic()
                self._signal_running(signal.SIGTERM)

    def _select(self, timeout: float | None) -> list:
        """Wait for events; exits the group already holds are handled first, without waiting."""
        assert self.group is not None
        if self.group.pending():
            self._on_exits(self.group.exits(None))
            timeout = 0
        return self.selector.select(timeout)

    def _handle(self, events: list, force_show: bool = False) -> None:
        assert self.group is not None
        for key, _ in events:
            if key.data is None:
                pidfd = key.fd if isinstance(key.fileobj, int) else None
                if pidfd is not None:  # fires once; the group closes it
                    self.selector.unregister(pidfd)
                self._on_exits(self.group.exits(pidfd))
            elif key.fd in self.selector.get_map():  # not closed by an exit handled just before
                r, name = key.data
                self._read(r, name, force_show=force_show and name == "err")

    def _read(self, r: _Rank, name: str, force_show: bool = False) -> bool:
        """Read what is available from one pipe; False once it is closed or empty."""
        fd = r.pipes[name][0]
        try:
            data = os.read(fd, 1 << 20)
        except BlockingIOError:
            return False
        if not data:
            self.selector.unregister(fd)
            os.close(fd)
            r.open_reads.discard(name)
            if name != "msg":
                r.sinks[name].feed(b"", final=True, force_show=force_show)
            return False
        if name == "msg":
            for kind, payload in r.messages.feed(data):
                if kind in ("result", "done", "error"):
                    r.outcome, r.payload = kind, payload
                if kind == "partial":
                    r.partial = payload
                elif kind == "error":
                    self._record_error(r, payload)
                elif kind not in ("result", "done") and self.plan.on_message and r.sinks["out"].show:
                    self._drain(r, ("out", "err"))  # what the worker printed before comes first
                    self.plan.on_message(kind, payload)
        elif self.capturing_stacks and name == "err":
            r.stack_text += data.decode("utf-8", "backslashreplace")
        else:
            r.sinks[name].feed(data, force_show=force_show)
        return True

    def _drain(self, r: _Rank, names: tuple[str, ...] = ("msg", "out", "err")) -> None:
        for name in names:
            while name in r.open_reads and self._read(r, name):
                pass

    def _on_exits(self, ended: list[tuple[int, int]]) -> None:
        for rank, exitcode in ended:
            r = next(x for x in self.ranks if x.rank == rank)
            r.exitcode = exitcode
            _signal_tree(r.pid, signal.SIGKILL)  # its own children, if it left any
            self._drain(r)
            if r.outcome is not None:
                continue  # finished (a crash in teardown does not matter), or already recorded
            if self.stopping_since is not None and exitcode != 0:
                continue  # stopped by us after another rank failed
            self._record_death(r, exitcode)

    def _record_error(self, r: _Rank, info: dict[str, Any]) -> None:
        self.failures.append(WorkerFailure(
            rank=r.rank, exitcode=info["exitcode"], signal_name=None, error_type=info["type"],
            message=info["message"], traceback=info["traceback"], attempt=self.attempt,
            output_tail=r.sinks["err"].tail()))

    def _record_death(self, r: _Rank, exitcode: int) -> None:
        signal_name = None
        if exitcode < 0:
            try:
                signal_name = signal.Signals(-exitcode).name
            except ValueError:
                signal_name = f"signal {-exitcode}"
            message = ""
        elif exitcode == 0:
            message = "exited with code 0 before its function returned (os._exit?)"
        else:
            message = f"exited with code {exitcode} without a Python traceback"
        self.failures.append(WorkerFailure(
            rank=r.rank, exitcode=exitcode, signal_name=signal_name, error_type=None,
            message=message, traceback=None, attempt=self.attempt,
            output_tail=r.sinks["err"].tail()))

    def _signal_running(self, signum: int) -> None:
        for r in self.ranks:
            if r.running:
                _signal_tree(r.pid, signum)

    # ------------------------------------------------------------------------- interrupt

    def _interrupt(self) -> None:
        """Show where every rank is; let the master, alone, send the state it reached; then stop
        everyone: SIGINT, SIGTERM, SIGKILL."""
        self.stopping_since = time.monotonic()  # deaths from here on are our doing
        running = [r for r in self.ranks if r.running]
        if running:
            print(f"\nenot_nb: interrupted; where each of the {len(running)} running rank(s) is:",
                  file=sys.stderr, flush=True)
            for r in running:
                _signal_tree(r.pid, signal.SIGUSR1, group=False)
            self.capturing_stacks = True
            self._pump(STACK_DUMP_WAIT, force_show=True)
            self.capturing_stacks = False
            for r in running:
                print(stack_report(r.rank, r.stack_text), file=sys.stderr, flush=True)
        master = next((r for r in self.ranks if r.rank == 0 and r.running), None)
        if master is not None:
            _signal_tree(master.pid, signal.SIGINT, group=False)
            self._pump(INTERRUPT_SAVE_WAIT, force_show=False,
                       until=lambda: master.partial is not None or not master.running)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if not any(r.running for r in self.ranks):
                break
            self._signal_running(signum)
            self._pump(STOP_GRACE, force_show=False)

    def _partial(self) -> Any:
        """Rank 0's state at an interrupt or failure, loaded; None if it sent none."""
        master = next((r for r in self.ranks if r.rank == 0), None)
        if master is None or master.partial is None:
            return None
        try:
            return self._load(master.partial)
        except LaunchError as err:
            print(f"enot_nb: {err}", file=sys.stderr)
            return None

    def _load(self, payload: tuple[str, Any]) -> Any:
        kind, data = payload
        try:
            if kind == "memfd":
                return _pickling.read_result(self.result_fd, data)
            return pickle.loads(data)
        except Exception as err:
            raise LaunchError(f"rank 0's result could not be loaded in this process "
                              f"({type(err).__name__}: {err}); return plain data, tensors or "
                              "state dicts") from err

    def _pump(self, seconds: float, force_show: bool, until: Any = None) -> None:
        """Read output and exits for up to ``seconds``, or until all is quiet (``force_show``),
        or until ``until()`` holds."""
        deadline = time.monotonic() + seconds
        quiet_after_output = 0.2
        while self.group is not None and any(r.running for r in self.ranks):
            if until is not None and until():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            events = self._select(min(left, quiet_after_output) if force_show else left)
            if not events and force_show:
                return
            self._handle(events, force_show)

    # ------------------------------------------------------------------------- collect, close

    def _collect(self) -> _Outcome:
        if self.failures:
            self.failures.sort(key=_root_cause_order)
            return _Outcome(ok=False, failures=self.failures, partial=self._partial())
        master = next((r for r in self.ranks if r.rank == 0), None)
        if master is None:
            return _Outcome(ok=True, result=None)  # not node 0: rank 0 runs elsewhere
        return _Outcome(ok=True, result=self._load(master.payload))

    def _close(self) -> None:
        for r in self.ranks:
            if r.pid is not None:
                _signal_tree(r.pid, signal.SIGKILL)
        if self.group is not None:
            self.group.close()
        for key in list(self.selector.get_map().values()):
            self.selector.unregister(key.fileobj)
            if key.data is not None:
                os.close(key.fd)
        self.selector.close()
        if self.result_fd is not None:
            os.close(self.result_fd)  # a result already loaded keeps its pages mapped
        if self.rendezvous_dir is not None:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)


def _root_cause_order(failure: WorkerFailure) -> bool:
    """Real causes first, errors caused by a lost peer last; otherwise in observed order."""
    text = f"{failure.message} {failure.traceback or ''}"
    return failure.error_type is not None and any(w in text for w in _PEER_LOSS_WORDS)


def stack_report(rank: int, text: str) -> str:
    """A rank's faulthandler dump, labelled with the rank, without enot_nb's own frames or idle
    threads (what the user needs is where their code is)."""
    threads: list[list[str]] = []
    other = []
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            threads.append([])
        elif line.startswith('  File "'):
            path = line.split('"')[1]
            if not threads:
                threads.append([])
            if not path.startswith(_worker.PACKAGE_DIR) and not path.endswith(
                    ("/threading.py", "/selectors.py")):
                threads[-1].append(line)
        elif line.strip():
            other.append(line)
    frames = [line for thread in threads if thread for line in thread]
    label = f"[rank {rank}]"
    lines = [f"{label} where it was (most recent call first):"]
    lines += [f"{label} {line}" for line in frames] or [f"{label}   (no Python frame: in native code)"]
    return "\n".join(other + lines)


def _signal_tree(pid: int | None, signum: int, group: bool = True) -> None:
    """Signal a worker's whole process group (or the worker alone); ignore what is already
    gone."""
    if pid is None:
        return
    if not group:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
        return
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
