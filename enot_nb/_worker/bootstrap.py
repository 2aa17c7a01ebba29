"""What runs inside each worker process, from the fork until ``os._exit``.

Life of a worker::

    become_worker: own process group, die with the parent, default signal handlers,
                   fds 1/2 -> the launcher's pipes, the rank's environment, its CPU threads
    load the job   (already in memory when forked from the caller; unpickled when from the server)
    init_torch(...) -> job.fn(*args, **kwargs) -> message Result/Done or ErrorReport
    flush, os._exit: the interpreter's own teardown is skipped on purpose, it aborts in gloo +
    DistributedDataParallel processes (6 of 20 runs on torch 2.13); so is destroy_process_group
    (see _leave).
"""

from __future__ import annotations

import ctypes
import datetime
import faulthandler
import io
import os
import shutil
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from enot_nb._processes import framing
from enot_nb._processes.protocol import (
    OUTPUT_FENCE,
    Connected,
    Done,
    ErrorReport,
    Inline,
    InMemfd,
    Partial,
    Payload,
    Result,
    WorkerMessage,
)
from enot_nb._runtime import ray_rank
from enot_nb._serialize import result_file, shm
from enot_nb._worker import collectives, stacks, streams

WORKER_MARKER = "ENOT_NB_WORKER"  # set in every worker: a launch from inside a worker is refused
_PR_SET_PDEATHSIG = 1


@dataclass
class Job:
    """The user's function and its arguments."""

    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    gather_shards: bool = True
    """Make the sharded modules of the result whole on the master (a cell does it itself)."""


@dataclass
class WorkerSpec:
    """Everything one worker needs besides the job; plain data, so it pickles anywhere."""

    rank: int
    env: dict[str, str]
    """The complete environment of the worker (the caller's, plus the rank's variables)."""
    cwd: str
    sys_path: list[str]
    threads: int
    init_kwargs: dict[str, Any]
    parent_pid: int
    stdout_fd: int
    stderr_fd: int
    message_fd: int
    close_fds: list[int] = field(default_factory=list)
    """Launcher descriptors of other ranks, closed in this worker."""
    result_fd: int | None = None
    """A memfd for rank 0's result (see result_file.write_result); None: through the pipe."""
    inline_results_up_to: int = 0
    """Bytes of a result that travel in its message even where the memfd exists: a Ray rank's
    answer then needs no call of its own to fetch the result (see _launch/ray_agent)."""
    shared_memory_fd: int | None = None
    """The memfd of a spawned job's tensors (see shm), mapped when the job is unpickled."""
    front_end: bool = False
    """Launched from IPython: display data and widgets go to the launcher (see frontend)."""
    kernel_parent: dict | None = None
    """The message the launching Jupyter kernel answers; None outside a kernel."""
    output_setup: bytes | None = None
    """The launcher's logging and warning set-up (streams.capture), for a worker that does not
    inherit it (spawn)."""
    multiprocessing_folder: str | None = None
    """The launch's folder for multiprocessing's sockets (see claim_multiprocessing_folder)."""


def become_worker(spec: WorkerSpec) -> None:
    """Turn a freshly forked process into an isolated worker for ``spec.rank``."""
    claim_multiprocessing_folder(spec.multiprocessing_folder)
    os.setpgid(0, 0)  # own group: the launcher stops the whole tree (DataLoader workers too)
    _die_with_parent(spec.parent_pid)
    for fd in spec.close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(spec.stdout_fd, 1)
    os.dup2(spec.stderr_fd, 2)
    for fd in (spec.stdout_fd, spec.stderr_fd):
        if fd > 2:
            os.close(fd)
    global _fence_fds
    _fence_fds = (os.dup(1), os.dup(2))  # the pipes themselves, even if the user redirects fd 1/2
    inherited = sys.stdout, sys.stderr
    # line_buffering flushes on "\n" and "\r": lines and progress bars arrive live.
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    sys.stdin = open(os.devnull)  # lives as long as the process
    streams.redirect_inherited(*inherited)
    for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # A crash prints the Python stack into this rank's stderr, which the failure report shows.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # On interrupt the launcher asks every rank where it is: a hang is diagnosable (see stacks:
    # not faulthandler.register, whose dump of all threads could crash a rank).
    stacks.install()
    os.environ.clear()
    os.environ.update(spec.env)
    os.environ[WORKER_MARKER] = "1"
    collectives.record()  # before the process group is made: torch reads it then
    ray_rank.install()  # on Ray: the rank never connects to Ray itself
    os.chdir(spec.cwd)
    sys.path[:] = spec.sys_path
    import torch

    torch.set_num_threads(spec.threads)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the launching process dies, however it dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


_message_fd: int | None = None
_result_fd: int | None = None
_inline_up_to = 0
_fence_fds: tuple[int, int] | None = None


def in_launch() -> bool:
    """Whether this process is a launched worker (it has a launcher to send messages to)."""
    return _message_fd is not None


def send(message: WorkerMessage) -> None:
    """Send a message to the launcher, after the output written so far: the streams are fenced
    first (see output.Fenced), unless they are not set up yet (a failure in become_worker)."""
    assert _message_fd is not None, "send() is for worker processes"
    if _fence_fds is not None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a broken stream must not stop the message
                pass
        for fd in _fence_fds:
            os.write(fd, OUTPUT_FENCE)  # atomic: far below PIPE_BUF
    framing.write_message(_message_fd, message)


def run(spec: WorkerSpec, load_job: Callable[[], Job]) -> NoReturn:
    """Run the job as rank ``spec.rank`` and exit the process; never returns."""
    global _message_fd, _result_fd, _inline_up_to
    _message_fd, _result_fd, _inline_up_to = spec.message_fd, spec.result_fd, spec.inline_results_up_to
    exitcode, connecting = 1, False
    try:
        become_worker(spec)
        from enot_nb._worker import frameworks

        frameworks.adapt()
        if spec.front_end:
            from enot_nb._worker import frontend

            frontend.install(spec.kernel_parent, send)
        shm.SHARED_FD[:] = [] if spec.shared_memory_fd is None else [spec.shared_memory_fd]
        job = load_job()
        if spec.output_setup is not None:  # after the job's imports, as in the kernel (see streams)
            streams.recreate(spec.output_setup)
        from enot_nb._processes import rendezvous
        from enot_nb.distributed import init_torch

        rendezvous.register()
        connecting = True
        init_torch(**spec.init_kwargs)
        _injected_connect_fault()
        _check_connected()
        connecting = False
        send(Connected())
        result = job.fn(*job.args, **job.kwargs)
        if job.gather_shards:
            from enot_nb._worker import sharded

            result = sharded.whole_result(result)
        send_outcome(spec.rank, result)
        exitcode = 0
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, SystemExit included
        exitcode = report_failure(exc, connecting and _is_transient_connect_error(exc))
    finally:
        _leave(exitcode)


def send_outcome(rank: int, result: Any) -> None:
    """A finished job's (or session task's) outcome: rank 0's result, Done elsewhere."""
    if rank != 0:
        send(Done())
        return
    try:
        payload = _result_payload(_result_fd, result)
    except Exception as err:
        raise TypeError(
            f"the function returned a {type(result).__name__} that cannot be pickled ({err}); "
            "return plain data, tensors or state dicts instead"
        ) from err
    send(Result(payload))


def _result_payload(result_fd: int | None, result: Any) -> Payload:
    """Pickled once: in band where no memfd exists, else with tensor data out of band, in the
    memfd or (no bigger than ``_inline_up_to``) in the message beside the pickle."""
    if result_fd is None:
        return Inline(result_file.dump_inline(result))
    main, buffers = result_file.dump_result(result)
    if result_file.size_of(main, buffers) <= _inline_up_to:
        return Inline(main, tuple(bytes(b.raw()) for b in buffers))
    return InMemfd(result_file.write_result(result_fd, main, buffers))


def send_partial(result: Any) -> None:
    """The master's state at an interrupt or failure, sent before the error is reported; the
    launcher may apply it (a stopped cell keeps what it reached)."""
    send(Partial(_result_payload(_result_fd, result)))


class _MeshBroken(RuntimeError):
    """The first collective after init_process_group failed: the ranks are not all connected."""


def _check_connected() -> None:
    """gloo's connectFullMesh can succeed on one rank and fail on its peer; one barrier makes
    every rank see it before any user code runs (a broken mesh fails here, not in the job)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        try:
            dist.barrier()
        except RuntimeError as err:
            raise _MeshBroken(f"the ranks are not all connected: the first barrier failed ({err})") from err


def _is_transient_connect_error(exc: BaseException | None) -> bool:
    """gloo's connectFullMesh sometimes fails between two healthy ranks on loopback ("Connection
    closed by peer"; 3 launches in 1,400 here, torch 2.13, the same before and after enot_nb's own
    start-up changes). Only gloo's text says so: it raises a plain RuntimeError."""
    while exc is not None:
        if isinstance(exc, _MeshBroken) or (
            isinstance(exc, RuntimeError) and "Gloo connectFullMesh failed" in str(exc)
        ):
            return True
        exc = exc.__cause__
    return False


def _injected_connect_fault() -> None:
    """Tests: with ENOT_NB_TEST_CONNECT_FAULT=PATH, the rank that creates PATH first fails as
    gloo's connectFullMesh does on one side only, after its peer connected (the real failure is
    too rare to wait for)."""
    path = os.environ.get("ENOT_NB_TEST_CONNECT_FAULT")
    if not path:
        return
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    raise RuntimeError("Gloo connectFullMesh failed with [ENOT_NB_TEST_CONNECT_FAULT] Connection closed by peer")


def report_failure(exc: BaseException, connecting: bool = False) -> int:
    """Send the ErrorReport of ``exc``; the exit code it stands for."""
    if isinstance(exc, SystemExit):
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code == 0:
            code = 1  # leaving early is a failure even with status 0: no result came back
        message = f"called sys.exit({exc.code!r})"
        error_type = None
    else:
        code, message, error_type = 1, str(exc), type(exc).__name__
    text = "".join(traceback.format_exception(type(exc), exc, _user_frames(exc.__traceback__))) if error_type else None
    try:
        timed_out = collectives.encoded(collectives.timed_out(exc))
    except Exception:  # noqa: BLE001 - the error matters more than the collectives
        timed_out = ""
    try:
        send(ErrorReport(error_type, message, text, code, connecting, timed_out))
    except OSError:
        pass
    return code


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # enot_nb/


def _user_frames(tb: Any) -> Any:
    """Skip enot_nb's own frames at the top: the user wants to see their code."""
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR):
        tb = tb.tb_next
    return tb


_multiprocessing_folder: list[str] = []
"""The multiprocessing folder this process made itself, removed as it leaves."""


def claim_multiprocessing_folder(folder: str | None = None) -> None:
    """Give this process a multiprocessing temporary folder (``pymp-*``: where the sockets that
    pass DataLoader workers' tensors back live) that the children it forks (DataLoader workers)
    share, instead of making one each, which nobody would remove: multiprocessing removes its
    folder in an exit finalizer, which a worker's os._exit skips, and a child killed with its
    process group never runs its own. ``folder``: the launch's, which the launcher made and
    removes however the worker ends (even killed); None (an exported script under torchrun):
    one made now, removed when this process leaves. The launcher's own folder, whose name a
    forked worker inherits, is never used (nor removed) by a worker."""
    import multiprocessing.process
    import multiprocessing.util

    process: Any = multiprocessing.process.current_process()  # _config: multiprocessing's own
    process._config.pop("tempdir", None)
    if folder is not None:
        process._config["tempdir"] = folder
    else:
        _multiprocessing_folder[:] = [multiprocessing.util.get_temp_dir()]


def _remove_own_multiprocessing_folder() -> None:
    for folder in _multiprocessing_folder:
        shutil.rmtree(folder, ignore_errors=True)
    _multiprocessing_folder.clear()


def leave(exitcode: int) -> NoReturn:
    """Leave the process as a finished worker does, sending nothing more (a session's worker:
    its last outcome is its last task's, whose result the notebook may still be reading)."""
    _leave(exitcode)


def _leave(exitcode: int) -> NoReturn:
    _remove_own_multiprocessing_folder()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - nothing useful to do this late
            pass
    # No destroy_process_group() first: torch 2.3.1's gloo blocked in it for good, holding the
    # GIL, in about one launch in ten once a peer had left (the launch never ended); exiting
    # releases what it would.
    os._exit(exitcode)


def init_kwargs(
    seed: int | None, speed: bool, reproducible: bool, backend: str, timeout: datetime.timedelta
) -> dict[str, Any]:
    """The keyword arguments of init_torch for every worker."""
    return {
        "seed": seed,
        "cuda_optimize_for_speed": speed,
        "cuda_reproducible": reproducible,
        "backend": backend,
        "timeout": timeout,
    }
