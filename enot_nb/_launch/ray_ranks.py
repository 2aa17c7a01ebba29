"""A session's ranks on a Ray cluster: the ``RankHost`` of ``engine="ray"`` (see rank_host for the
interface, ray_agent for the node's side, docs/guide/ray.md for the user's).

Ray places one actor per rank (``RankAgent``), one bundle each in a placement group (``pack``:
Ray's PACK, nodes filled in order; ``spread``: SPREAD, one rank per node where it can). Each
agent starts the rank's session worker as a local child on its node and relays its traffic::

    put_task   the task file's bytes: in the command itself up to INLINE_TASK, else ray.put
               once; each agent writes them into its own task memfd before it passes the
               RunTask on (the object store moves big state, each node fetching it once)
    send       command.remote(bytes, task) to each agent, in its one-thread ``command`` group
               (in order, not waited for: the rank's answer comes through its reads)
    poll       one read.remote(READ_POLL) outstanding per agent; ray.wait on them; each Batch
               fed to a RelayIO: output, display data, messages and outcomes are read exactly
               as a local rank's pipes are (fences, sinks, on_message), and shown live
    signals    signal.remote(SIGINT | SIGUSR1 | SIGTERM | SIGKILL): the agent signals its own
               worker by pidfd (``control`` concurrency group: it runs while a read waits)
    load       rank 0's result memfd -> result.remote(size) through the object store
    deaths     an agent's RayActorError (actor killed, node lost) ends its rank: WorkerFailure
               naming the rank, its node and Ray's cause; the worker dies with its agent

Every wait on Ray is bounded (RAY_CALL_WAIT, the placement's wait, READ_POLL): a cluster that
stops answering is an error, never a hang. Ray Client (``ray://``) is refused: it has no local
object store, and every batch of output would cross the client's proxy.

``ray`` is imported here and in ray_agent only (tests/unit/test_structure.py checks it); this
module itself is imported only when a session asks for the Ray engine.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from enot_nb._launch import attempt as _attempt
from enot_nb._launch import relay
from enot_nb._launch.attempt import load_payload
from enot_nb._launch.output import StreamSink
from enot_nb._launch.plan import LaunchPlan
from enot_nb._launch.ranks import STREAMS, Rank, RankIO
from enot_nb._launch.ray_agent import CONCURRENCY_GROUPS, AgentLaunch, Batch, RankAgent
from enot_nb._launch.ray_layout import Landing, RankPlace, place_ranks, torchrun_variables
from enot_nb._launch.tracebacks import as_in_the_notebook
from enot_nb._processes import framing
from enot_nb._processes import rendezvous as _rendezvous
from enot_nb._processes.interrupts import interrupts_deferred
from enot_nb._processes.protocol import ErrorReport, InMemfd, Payload, RunTask, SessionCommand, StopWorker
from enot_nb._processes.sockets import End
from enot_nb._runtime.ray_rank import RayContext
from enot_nb._serialize import picklers, result_file
from enot_nb._serialize.shm import pwrite_all
from enot_nb._worker import bootstrap, streams
from enot_nb.errors import LaunchError, WorkerFailedError, WorkerFailure, signal_name_of

READ_POLL = float(os.environ.get("ENOT_NB_RAY_READ_POLL", "1.0"))
"""Seconds an agent's read waits for output before it answers empty (the kernel asks again)."""
RAY_CALL_WAIT = float(os.environ.get("ENOT_NB_RAY_CALL_WAIT", "60"))
"""Seconds any one call to an agent may take (a start: its worker importing torch)."""
PLACE_NOTICE = 2.0
"""Seconds the placement group gets before one line says what the session waits for."""
INLINE_TASK = 64 * 1024
"""Bytes of a task that travel in the commands themselves; a bigger one goes by the object store."""
CPUS_PER_RANK = float(os.environ.get("ENOT_NB_RAY_CPUS_PER_RANK", "1"))
"""The CPU share of each rank's bundle (its OMP_NUM_THREADS, rounded down, at least 1)."""
PLACEMENTS = {"pack": "PACK", "spread": "SPREAD"}
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""enot_nb itself (the folder), shipped to the nodes in the job's runtime_env."""


def connect(address: str | None) -> None:
    """This process connected to the Ray cluster at ``address`` (None: Ray's own default:
    ``RAY_ADDRESS``, else a cluster running on this machine, else a new local one), with Ray's
    forwarding of the actors' output off: the ranks' output comes through the relay. A
    connection made before (``ray.init`` in the notebook) is used as it is: enot_nb must then
    be in its runtime_env or installed on the nodes. (Ray Client's ``ray://`` is refused by
    EngineOptions.)"""
    global _connected_here
    if ray.is_initialized():
        return
    # enot_nb travels with the job (Ray uploads local modules only at the job's level); torch
    # and the rest are the nodes' own.
    ray.init(
        address=address,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"py_modules": [PACKAGE_DIR]},
    )
    _connected_here = True


def disconnect() -> None:
    """The connection ``connect`` made, ended (a session's close): a kernel whose cluster is
    stopped later then shuts down cleanly. A connection the user made first is left alone."""
    global _connected_here
    if _connected_here:
        _connected_here = False
        ray.shutdown()


_connected_here = False
"""Whether this process's Ray connection is the one ``connect`` made (not the user's own)."""


class RayRanks:
    """A session's ranks as Ray actors (see the module's docstring)."""

    def __init__(
        self,
        plan: LaunchPlan,
        on_message: Any = None,
        address: str | None = None,
        gpus_per_rank: int = 0,
        placement: str = "pack",
        place_timeout: float | None = None,
    ) -> None:
        self.plan, self.on_message = plan, on_message
        self.address, self.gpus_per_rank, self.placement = address, gpus_per_rank, placement
        self.place_timeout = place_timeout if place_timeout is not None else plan.init_kwargs["timeout"].total_seconds()
        self._ranks: list[Rank] = []
        self.failures: list[WorkerFailure] = []
        self.io: RelayIO | None = None
        self.group: PlacementGroup | None = None
        self.agents: dict[int, Any] = {}  # rank -> its actor handle
        self.places: dict[int, RankPlace] = {}
        self.names: dict[int, str] = {}  # rank -> its actor's name (``ray.get_actor``, ray.kill)
        self.reads: dict[int, Any] = {}  # rank -> its outstanding read
        self.read_since: dict[int, float] = {}  # rank -> when that read was sent
        self.task: Any = None  # the last task's ObjectRef
        self.ray_causes: dict[int, str] = {}  # rank -> why Ray says its actor died
        self.got_output = False

    @property
    def ranks(self) -> list[Rank]:
        return self._ranks

    # ------------------------------------------------------------------------- start, close

    def start(self, serve: Callable[..., Any]) -> None:
        """Place the ranks, start each one's worker through its agent, and wait until every
        rank is connected; WorkerFailedError if one fails first, LaunchError where Ray cannot
        place them in time."""
        nprocs = self.plan.nprocs
        print(
            f"enot_nb: starting {nprocs} rank(s) on Ray: connecting, placing them, then an actor and a worker each",
            file=sys.stderr,
            flush=True,
        )
        connect(self.address)
        self.group = self._placement_group(nprocs)
        decorate: Any = ray.remote  # its stubs lack concurrency_groups, which Ray takes
        agent_class = decorate(concurrency_groups=CONCURRENCY_GROUPS, max_restarts=0)(RankAgent)
        actors = [
            agent_class.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
                num_cpus=CPUS_PER_RANK,
                num_gpus=self.gpus_per_rank,
                name=f"enot_nb-{self.plan.run_id}-bundle{i}",
            ).remote()
            for i in range(nprocs)
        ]
        self.agents = dict(enumerate(actors))  # by bundle until placed
        # An actor answers once Ray started its process (and the job's runtime_env on its node):
        # slow on a loaded machine, so bounded by the session's timeout, as the placement is.
        arrived = self._get([a.where.remote(i) for i, a in enumerate(actors)], wait=self.place_timeout)
        landings = [Landing(*where) for where in arrived]
        places = place_ranks(landings)
        self.agents = {p.rank: actors[p.landing.bundle] for p in places}
        self.places = {p.rank: p for p in places}
        self.names = {p.rank: f"enot_nb-{self.plan.run_id}-bundle{p.landing.bundle}" for p in places}
        master = self.places[0].landing.node_ip
        port = self._get(self.agents[0].free_port.options(concurrency_group="control").remote(master))
        self._start_workers(serve, master, port)

    def _placement_group(self, nprocs: int) -> PlacementGroup:
        bundle: dict[str, float] = {"CPU": CPUS_PER_RANK}
        if self.gpus_per_rank:
            bundle["GPU"] = self.gpus_per_rank
        group = placement_group([dict(bundle)] * nprocs, strategy=PLACEMENTS[self.placement])
        ready = group.ready()
        if not ray.wait([ready], timeout=PLACE_NOTICE)[0]:
            print(
                f"enot_nb: waiting for Ray to place {nprocs} rank(s) ({_resources(bundle)} each, "
                f"{self.placement}); the cluster has {_resources(ray.available_resources())} free "
                f"(up to {self.place_timeout:g} s, the session's timeout)",
                file=sys.stderr,
                flush=True,
            )
            if not ray.wait([ready], timeout=max(0.0, self.place_timeout - PLACE_NOTICE))[0]:
                remove_placement_group(group)
                raise LaunchError(
                    f"Ray could not place {nprocs} rank(s) ({_resources(bundle)} each) within "
                    f"{self.place_timeout:g} s; the cluster has {_resources(ray.available_resources())} free. "
                    "Add nodes, lower nprocs or gpus_per_rank, or raise the session's timeout"
                )
        return group

    def _start_workers(self, serve: Callable[..., Any], master: str, port: int) -> None:
        plan = self.plan
        job = bootstrap.Job(
            serve, (None, plan.init_kwargs["backend"], plan.init_kwargs["timeout"]), gather_shards=False
        )
        job_bytes = picklers.dumps(job, [])
        init_kwargs = dict(plan.init_kwargs, init_method=_rendezvous.url(master, port))
        threads = max(1, int(CPUS_PER_RANK))
        defaults = {}
        if _rendezvous.is_loopback(master):  # every rank on this machine: collectives on loopback too
            defaults = {"GLOO_SOCKET_IFNAME": _rendezvous.LOOPBACK_INTERFACE, "NCCL_SOCKET_IFNAME": "lo"}
        front_end, parent, setup = relay.in_ipython(), relay.kernel_parent(), streams.capture()
        self._ranks = [_relay_rank(rank, self.places[rank].local_rank, plan.output) for rank in sorted(self.places)]
        self.io = RelayIO(self._ranks, self.on_message, self._record_error)
        launches = {
            rank: AgentLaunch(
                rank=rank,
                env=torchrun_variables(place, plan.nprocs, master, port, plan.run_id, threads)
                | self._context(place).variables(),
                env_defaults=defaults,
                init_kwargs=init_kwargs,
                threads=threads,
                job_bytes=job_bytes,
                front_end=front_end,
                kernel_parent=parent,
                output_setup=setup,
            )
            for rank, place in self.places.items()
        }
        starts = [self._call(rank, "start", launches[rank]) for rank in sorted(self.places)]
        pids = self._get(starts, wait=max(RAY_CALL_WAIT, self.place_timeout))
        for r, pid in zip(self._ranks, pids):
            r.pid = pid
            self._read_next(r)
        deadline = time.monotonic() + self.place_timeout
        while not all(r.connected for r in self._ranks):
            if self.failures or any(not r.running for r in self._ranks) or time.monotonic() > deadline:
                self.wait(2.0, until=lambda: False)  # the others' ends, for the report
                failures = self.failures or [self._died(r, r.exitcode or -9) for r in self._ranks if not r.running]
                if not failures:
                    raise LaunchError(f"the ranks did not connect within {self.place_timeout:g} s")
                failures.sort(key=WorkerFailure.caused_by_a_lost_peer)
                raise WorkerFailedError(failures)
            self.poll(READ_POLL)

    def _context(self, place: RankPlace) -> RayContext:
        """What the rank's ``ray_context()`` answers (see _runtime/ray_rank)."""
        assert self.group is not None
        landing = place.landing
        return RayContext(
            node_id=landing.node_id,
            node_ip=landing.node_ip,
            actor_id=landing.actor_id,
            actor_name=self.names[place.rank],
            placement_group_id=self.group.id.hex(),
            bundle_index=landing.bundle,
            gpu_ids=landing.gpu_ids,
        )

    def close(self) -> None:
        """Stop every rank (StopWorker, then SIGTERM, SIGKILL through its agent), end the agents
        and remove the placement group."""
        try:
            live = [r for r in self._ranks if r.running]
            if live:
                try:
                    self.send(StopWorker(), live)
                    self.wait(_attempt.STOP_GRACE, until=lambda: not any(r.running for r in live))
                    self.stop([r for r in self._ranks if r.running])
                except LaunchError:
                    pass  # an agent that does not answer is killed below
        finally:
            with interrupts_deferred():
                agents, self.agents = self.agents, {}
                closes = [a.close.options(concurrency_group="control").remote() for a in agents.values()]
                try:
                    if closes:
                        ray.wait(closes, num_returns=len(closes), timeout=RAY_CALL_WAIT)
                finally:
                    for agent in agents.values():
                        ray.kill(agent)
                    group, self.group = self.group, None
                    if group is not None:
                        remove_placement_group(group)
                    self.reads = {}

    # ------------------------------------------------------------------------- commands

    def put_task(self, main: bytes, buffers: Sequence[Any]) -> int:
        """The task as its pickle and its buffers (tensor bytes, out of band, not copied here):
        in the commands themselves up to INLINE_TASK, else put in the object store once (one
        copy, from the tensors; each node fetches it once). Each agent lays it out in its task
        file as a local session's (result_file); its size, as that layout gives it."""
        import numpy

        arrays = [numpy.frombuffer(b.raw(), dtype=numpy.uint8) for b in buffers]
        size = result_file.size_of(main, list(buffers))
        self.task = (main, arrays) if size <= INLINE_TASK else ray.put((main, arrays))
        return size

    def send(self, command: SessionCommand, ranks: list[Rank]) -> None:
        """The command to each running rank (a RunTask with its task), as one step. Not waited
        for: each agent runs its commands one at a time in the order sent (the ``command``
        concurrency group), and what a rank does with one comes back through its reads."""
        data = framing.encode(command)
        task = self.task if isinstance(command, RunTask) else None
        with interrupts_deferred():
            for r in ranks:
                if r.running:
                    self._call(r.rank, "command", data, task, group="command")

    def interrupt(self, ranks: list[Rank]) -> None:
        self._signal([r for r in ranks if r.running], signal.SIGINT)

    def stop(self, ranks: list[Rank]) -> None:
        """SIGTERM, then SIGKILL, each followed by STOP_GRACE seconds at most."""
        for signum in (signal.SIGTERM, signal.SIGKILL):
            running = [r for r in ranks if r.running]
            if not running:
                return
            for r in running:
                r.stop_signals.add(signum)
            self._signal(running, signum)
            self.wait(_attempt.STOP_GRACE, until=lambda: not any(r.running for r in ranks))

    def dump_stacks(self, ranks: list[Rank]) -> dict[int, str]:
        """Each rank's stack (SIGUSR1 through its agent: printed between fences on its stderr),
        read until quiet, STACK_DUMP_WAIT seconds at most."""
        assert self.io is not None
        for r in ranks:
            r.stack_text = ""
        self._signal(ranks, signal.SIGUSR1)
        self.io.capturing_stacks = True
        try:
            deadline = time.monotonic() + _attempt.STACK_DUMP_WAIT
            waiting = {r.rank for r in ranks if r.running}
            while waiting and time.monotonic() < deadline:
                self.poll(min(0.3, max(0.0, deadline - time.monotonic())))
                waiting = {r.rank for r in ranks if r.running and not r.stack_text}
            self.got_output = True
            while self.got_output and time.monotonic() < deadline:  # the rest of each dump
                self.got_output = False
                self.poll(0.2)
        finally:
            self.io.capturing_stacks = False
        return {r.rank: self._as_here(r, r.stack_text) for r in ranks}

    def _as_here(self, r: Rank, text: str) -> str:
        """A rank's stack with enot_nb's frames under this process's enot_nb folder (the node
        runs the runtime_env's copy): the report leaves them out as it does a local rank's."""
        place = self.places.get(r.rank)
        if place is None or not place.landing.package_dir:
            return text
        return text.replace(place.landing.package_dir, bootstrap.PACKAGE_DIR)

    def _signal(self, ranks: list[Rank], signum: int) -> None:
        with interrupts_deferred():
            self._settle({r.rank: self._call(r.rank, "signal", int(signum)) for r in ranks if r.rank in self.agents})

    # ------------------------------------------------------------------------- poll

    def poll(self, timeout: float | None) -> None:
        """What the agents read, taken in: each batch fed to the ranks' records; a dead agent's
        rank ended, and one whose read has not come back within READ_POLL + RAY_CALL_WAIT
        seconds too (Ray may take longer to call a lost node dead). Waits ``timeout`` seconds
        at most for the first batch (None: a few READ_POLLs, each read answers within one)."""
        pending = {ref: rank for rank, ref in self.reads.items()}
        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout if timeout is not None else 3 * READ_POLL)
        if not ready:
            self._unanswered()
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        with interrupts_deferred():  # a batch taken off Ray is fed whole
            for ref in ready:
                r = self._rank(pending[ref])
                del self.reads[r.rank]
                try:
                    batch = ray.get(ref, timeout=RAY_CALL_WAIT)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
                    self._agent_died(r, err)
                    continue
                self._feed(r, batch)
            self._unanswered()

    def _feed(self, r: Rank, batch: Batch) -> None:
        assert self.io is not None
        if batch.out or batch.err or batch.msg:
            self.got_output = True
        self.io.take(r, batch)
        self.io.drain(r)
        if batch.exitcode is None:
            self._read_next(r)
        else:
            self._exited(r, batch.exitcode)

    def _read_next(self, r: Rank) -> None:
        self.reads[r.rank] = self._call(r.rank, "read", READ_POLL, group="io")
        self.read_since[r.rank] = time.monotonic()

    def _unanswered(self) -> None:
        """Ranks whose agent's read is overdue: ended as their agent's death."""
        now = time.monotonic()
        for rank in [rank for rank in self.reads if now - self.read_since[rank] > READ_POLL + RAY_CALL_WAIT]:
            del self.reads[rank]
            silent = LaunchError(f"it did not answer for {READ_POLL + RAY_CALL_WAIT:g} s (its node unreachable?)")
            self._agent_died(self._rank(rank), silent)

    def _exited(self, r: Rank, exitcode: int) -> None:
        """The rank's end, as a local attempt records it (see Attempt._on_exits)."""
        assert self.io is not None
        r.exitcode = exitcode
        self.io.drain(r)
        if r.outcome is not None or (exitcode != 0 and r.stopped_by_us(exitcode)):
            return
        self.failures.append(self._died(r, exitcode))

    def _died(self, r: Rank, exitcode: int) -> WorkerFailure:
        died = WorkerFailure.died(r.rank, exitcode, 0, r.err_tail(), self._cause(r))
        return dataclasses.replace(died, node=self._node(r))

    def _agent_died(self, r: Rank, err: Exception) -> None:
        """Ray says the rank's actor is gone (killed, its node lost): its worker died with it."""
        assert self.io is not None
        self.ray_causes[r.rank] = _ray_cause(err)
        for name in STREAMS:
            self.io.ended.add((r.rank, name))
        r.signal_cause = self._cause(r)
        self._exited(r, -signal.SIGKILL)

    def _node(self, r: Rank) -> str | None:
        """The rank's node in words: its id (as the table shows it) and IP."""
        where = self.location(r)
        return f"{where[0]} ({where[1]})" if where else None

    def _cause(self, r: Rank) -> str | None:
        cause = self.ray_causes.get(r.rank)
        return f"its Ray actor died: {cause}" if cause else None

    def _record_error(self, r: Rank, info: ErrorReport) -> None:
        info = info._replace(traceback=as_in_the_notebook(info.traceback))
        failure = WorkerFailure.raised(r.rank, info, 0, r.err_tail())
        self.failures.append(dataclasses.replace(failure, node=self._node(r)))

    def wait(self, seconds: float, until: Callable[[], bool]) -> None:
        deadline = time.monotonic() + seconds
        while any(r.running for r in self._ranks) and not until():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self.poll(left)

    # ------------------------------------------------------------------------- the rest

    def peers(self) -> tuple[End, ...]:
        """The ends of the ranks' TCP sockets, each read on its node by its agent (a rank's pid
        means nothing on another node; its sockets' addresses do)."""
        live = [r.rank for r in self._ranks if r.running and r.rank in self.agents]
        calls = [self._call(rank, "tcp_ends") for rank in live]
        found: set[End] = set()
        for call in calls:
            try:
                found.update(self._get(call))
            except LaunchError:
                pass  # its agent is gone: so are its connections
        return tuple(sorted(found))

    def meeting_point(self) -> str:
        """A fresh store on rank 0's node, at a port its agent found free."""
        master = self.places[0].landing.node_ip
        port = self._get(self._call(0, "free_port", master))
        return _rendezvous.url(master, port)

    def load(self, payload: Payload) -> Any:
        """Rank 0's result: from its agent's result file through the object store, or inline."""
        if not isinstance(payload, InMemfd):
            return load_payload(None, payload)
        data = self._get(self._call(0, "result", payload.size))
        fd = result_file.result_fd()
        assert fd is not None
        try:
            os.ftruncate(fd, len(data))
            pwrite_all(fd, data, 0)
            del data
            return load_payload(fd, payload)
        finally:
            os.close(fd)  # what was loaded keeps its pages mapped

    def resident_mib(self, rank: Rank) -> float | None:
        try:
            return self._get(self._call(rank.rank, "memory"))
        except LaunchError:
            return None

    def cpu_seconds(self, rank: Rank) -> float | None:
        """The rank's CPU time so far, read on its node by its agent."""
        if not rank.running or rank.rank not in self.agents:
            return None
        try:
            return self._get(self._call(rank.rank, "cpu_seconds"))
        except LaunchError:
            return None

    def why_ended(self, rank: Rank) -> str:
        exitcode = rank.exitcode
        ended = self._cause(rank) or (
            signal_name_of(exitcode) if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
        )
        node = self._node(rank)
        return f"{ended}, on node {node}" if node else ended

    def location(self, rank: Rank) -> tuple[str, str] | None:
        """(node id, node IP) of the rank, for the session's table."""
        place = self.places.get(rank.rank)
        return (place.landing.node_id[:12], place.landing.node_ip) if place else None

    def device(self, rank: Rank) -> str | None:
        place = self.places.get(rank.rank)
        if place is None or not place.landing.gpu_ids:
            return "cpu"
        return f"cuda:{place.local_rank} (GPU {place.landing.gpu_ids[0]})"

    def show(self, output: str) -> None:
        for r in self._ranks:
            shown = output == "all" or (output == "master" and r.rank == 0)
            for sink in r.sinks.values():
                sink.show, sink.prefix = shown, f"[rank {r.rank}] " if output == "all" else ""

    # ------------------------------------------------------------------------- Ray calls

    def _rank(self, rank: int) -> Rank:
        return next(r for r in self._ranks if r.rank == rank)

    def _call(self, rank: int, method: str, *args: Any, group: str = "control") -> Any:
        return getattr(self.agents[rank], method).options(concurrency_group=group).remote(*args)

    def _get(self, refs: Any, wait: float = RAY_CALL_WAIT) -> Any:
        """Ray's answer within ``wait`` seconds; LaunchError naming the cause if none comes."""
        try:
            return ray.get(refs, timeout=wait)
        except ray.exceptions.GetTimeoutError as err:
            raise LaunchError(f"a Ray actor of the session did not answer within {wait:g} s") from err
        except ray.exceptions.RayActorError as err:
            raise LaunchError(f"a Ray actor of the session died: {_ray_cause(err)}") from err

    def _settle(self, calls: dict[int, Any]) -> None:
        """Wait for each call (bounded); a rank whose agent died is seen ending by the next poll."""
        if calls:
            ray.wait(list(calls.values()), num_returns=len(calls), timeout=RAY_CALL_WAIT)


class RelayIO(RankIO):
    """A RankIO over the bytes an agent relayed instead of pipes: a rank's output, display data,
    messages and outcomes are read with the one reader local ranks use (ranks.RankIO)."""

    def __init__(self, ranks: list[Rank], on_message: Any, on_error: Callable[[Rank, ErrorReport], None]) -> None:
        self.ranks, self.on_message, self.on_error = ranks, on_message, on_error
        self.capturing_stacks = False
        self.pending: dict[tuple[int, str], bytearray] = {(r.rank, n): bytearray() for r in ranks for n in STREAMS}
        self.ended: set[tuple[int, str]] = set()

    def take(self, r: Rank, batch: Batch) -> None:
        for name, data in (("out", batch.out), ("err", batch.err), ("msg", batch.msg)):
            self.pending[(r.rank, name)] += data
        self.ended |= {(r.rank, name) for name in batch.ended}

    def read(self, r: Rank, name: str, force_show: bool = False) -> bool:
        buffer = self.pending[(r.rank, name)]
        if not buffer:
            if (r.rank, name) in self.ended and name in r.open_reads:
                self.received(r, name, b"", force_show)
            return False
        data = bytes(buffer)
        buffer.clear()
        return self.received(r, name, data, force_show)

    def close_write_ends(self) -> None:
        pass

    def close(self) -> None:
        pass


def _relay_rank(rank: int, local_rank: int, output: str) -> Rank:
    show = output == "all" or (output == "master" and rank == 0)
    prefix = f"[rank {rank}] " if output == "all" else ""
    sinks = {"out": StreamSink("stdout", show, prefix), "err": StreamSink("stderr", show, prefix)}
    return Rank(rank=rank, local_rank=local_rank, pipes={}, sinks=sinks)


def _ray_cause(err: BaseException) -> str:
    """Ray's own words for an actor's death: the line that says why, else its first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    because = [line for line in lines if "because" in line or "died" in line.lower()]
    return (because[-1] if because else lines[0] if lines else type(err).__name__)[:300]


def _resources(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU") and v}
    return ", ".join(f"{v:g} {k}" for k, v in sorted(shown.items())) or "nothing"
