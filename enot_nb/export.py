"""Scale out: export a distributed cell as a torchrun script, and load what it produced.

``%%enot_distributed --export PATH`` (or [export_cell][enot_nb.export_cell]) writes, without running anything:

* ``PATH``: a small script that runs the cell exactly as the magic would (``init_torch`` with
  the same options, ``sync_model`` on the models it uses, the cell's code) on every process
  torchrun starts, on any number of nodes;
* ``<PATH stem>.namespace.pkl`` beside it: the notebook variables the cell uses (cloudpickle).

The master (global rank 0) saves what the magic would have brought back into
``<PATH stem>.results.pkl``; [load_results][enot_nb.load_results] reads it back into a notebook.
"""

from __future__ import annotations

import errno
import os
import platform
import shlex
import stat
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

import cloudpickle

from enot_nb._defaults import DEFAULT_TIMEOUT

SCRIPT_TEMPLATE = '''#!/usr/bin/env python3
"""A notebook cell exported by enot_nb: run it with torchrun, on one node or many.

    {command}

Requirements: Python >= 3.10 and enot_nb (which brings torch>=2.1, numpy, ipython, cloudpickle),
plus whatever the cell imports. Exported with Python {python}, torch {torch}, enot_nb {enot_nb}.
Reads {namespace_name} (the notebook variables the cell uses) and, on the master, writes
{results_name} (what the notebook would have got back; enot_nb.load_results({script_name!r})).
"""

from enot_nb.export import run_exported

CELL = {cell!r}

OPTIONS = {options!r}

if __name__ == "__main__":
    run_exported(__file__, CELL, OPTIONS)
'''


@dataclass
class ExportedCell:
    """Where an export wrote, and how to run it."""

    script: Path
    namespace: Path
    results: Path
    command: str

    def describe(self) -> str:
        return (
            f"enot_nb: wrote {self.script} and {self.namespace.name} beside it (nothing ran).\n"
            f"Run it with:\n    {self.command}\n"
            f"then load what the master saved with enot_nb.load_results({str(self.script)!r})"
        )


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(f"{path.stem}.{suffix}")


def torchrun_command(script: Path, nprocs: int | None, nnodes: int, master_addr: str, master_port: int | None) -> str:
    """The torchrun command line that runs ``script`` (on every node when nnodes > 1)."""
    per_node = str(nprocs) if nprocs else "gpu"
    parts = ["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", per_node]
    if nnodes > 1:
        parts += [
            "--node-rank",
            "<this node's rank>",
            "--master-addr",
            master_addr,
            "--master-port",
            str(master_port or 29500),
        ]
    else:
        parts.append("--standalone")
    return " ".join(shlex.quote(p) if not p.startswith("<") else p for p in parts + [str(script)])


def export_cell(
    code: str,
    path: str | os.PathLike,
    namespace: dict[str, Any] | None = None,
    *,
    nprocs: int | None = None,
    nnodes: int = 1,
    backend: str | None = None,
    seed: int | None = None,
    cuda_optimize_for_speed: bool = False,
    cuda_reproducible: bool = False,
    output: str = "master",
    sync: list[str] | None = None,
    no_sync: bool = False,
    returns: list[str] | None = None,
    no_return: bool = False,
    check_replicas: bool = False,
    timeout: float = DEFAULT_TIMEOUT.total_seconds(),
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> ExportedCell:
    """Write ``code`` as a torchrun script at ``path``, with the variables it uses beside it.

    Args:
        code: the cell's Python code (IPython syntax already transformed).
        path: where the script goes; the namespace and results files go beside it.
        namespace: the variables the cell may use (a notebook's ``globals()``); only the
            names the code mentions are saved. Names that cannot be pickled are left out and
            named in the returned object's description.
        nprocs: processes per node the command line asks torchrun for; the script itself
            runs on any number of processes, but refuses to run as one plain process when
            exported for several.
        nnodes: nodes the command line asks torchrun for.
        backend: as init_torch's; None picks nccl when every process has its own GPU, else gloo.
        seed: as init_torch's.
        cuda_optimize_for_speed: as init_torch's.
        cuda_reproducible: as init_torch's.
        timeout: the process group's timeout, as init_torch's.
        output: as the magic's ``--output``.
        sync: as the magic's ``--sync``.
        no_sync: as the magic's ``--no-sync``.
        returns: as the magic's ``--return``.
        no_return: as the magic's ``--no-return``.
        check_replicas: as the magic's ``--check-replicas``: rank 0 prints the report.

    Returns:
        The paths written and the torchrun command line.

    Raises:
        LaunchConfigError: a bad option (a ValueError).
        SyntaxError: the code does not parse.
        ValueError: ``path`` is a link planted where the script goes.

    Example:
        ```python
        exported = enot_nb.export_cell("model = train(model)", "run/train.py", globals(), nprocs=8)
        print(exported.command)
        ```
    """
    from enot_nb._launch.options import LaunchOptions
    from enot_nb._state import reach
    from enot_nb._worker import cell as _cell

    # Checked as a launch checks them; the GPUs and backends of the cluster are not known here.
    LaunchOptions(
        nprocs=nprocs,
        nnodes=nnodes,
        backend=backend,
        seed=seed,
        cuda_optimize_for_speed=cuda_optimize_for_speed,
        cuda_reproducible=cuda_reproducible,
        output=output,
        timeout=timeout,
        master_addr=master_addr,
        master_port=master_port,
    )
    compile(code, _cell.CELL_FILENAME, "exec")  # a syntax error is reported now, not on the cluster
    script = Path(os.path.abspath(path))  # not resolve(): a link must be refused, not followed
    namespace_file = _beside(script, "namespace.pkl")
    for target in (script, namespace_file, _beside(script, "results.pkl")):
        refuse_links(target)
    script.parent.mkdir(parents=True, exist_ok=True)
    values, left_out, _ = reach.shippable_namespace(namespace or {}, code)
    write_atomically(namespace_file, cloudpickle.dumps({"values": values, "left_out": left_out}, protocol=5))
    import torch

    from enot_nb._version import __version__

    command = torchrun_command(script, nprocs, nnodes, master_addr, master_port)
    options = {
        "world_size": (nprocs or 0) * nnodes,
        "backend": backend,
        "seed": seed,
        "speed": cuda_optimize_for_speed,
        "reproducible": cuda_reproducible,
        "timeout": timeout,
        "output": output,
        "sync": sync,
        "no_sync": no_sync,
        "returns": returns,
        "no_return": no_return,
        "check_replicas": check_replicas,
        "command": command,
    }
    write_atomically(
        script,
        SCRIPT_TEMPLATE.format(
            command=command,
            python=platform.python_version(),
            torch=torch.__version__,
            enot_nb=__version__,
            namespace_name=namespace_file.name,
            results_name=_beside(script, "results.pkl").name,
            script_name=script.name,
            cell=code,
            options=options,
        ).encode(),
        mode=0o755,
    )
    exported = ExportedCell(script, namespace_file, _beside(script, "results.pkl"), command)
    for name, reason in left_out.items():
        print(f"enot_nb: {name!r} was not exported: {reason}", file=sys.stderr)
    return exported


def refuse_links(path: Path) -> None:
    """A planted symbolic link would make an export overwrite another file: refuse it."""
    if path.is_symlink():
        raise ValueError(
            f"{path} is a symbolic link; enot_nb does not write through links (it "
            "would overwrite the file it points to). Remove it or export elsewhere"
        )


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write a temporary file beside ``path``, then rename it over ``path``: readers never see
    half a file, and a link planted meanwhile is replaced, never followed."""
    import tempfile

    refuse_links(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """What the master of an exported run saved.

    Args:
        path: the exported script's path, as given to export_cell or ``--export``.

    Returns:
        Each returned name to its value (tensors on the CPU).

    Raises:
        FileNotFoundError: the script has not run (its master writes the results at the end).
        PermissionError: the results file is another user's, anyone may write it, or it is a
            link: unpickling runs code, so it is refused before any byte is read.

    Example:
        ```python
        enot_nb.export_cell("model = train(model)", "run/train.py", globals(), nprocs=8)
        # torchrun --nproc-per-node 8 run/train.py, then:
        model = enot_nb.load_results("run/train.py")["model"]
        ```
    """
    results = _beside(Path(path).resolve(), "results.pkl")
    if not results.exists():
        raise FileNotFoundError(
            f"{results} does not exist: run the exported script with torchrun "
            "first (the master writes it when the cell succeeds)"
        )
    from enot_nb._serialize import renamed

    with open_trusted(results) as f:
        return renamed.load(f)  # saved by an older enot_nb too


def open_trusted(path: Path) -> BinaryIO:
    """Open a pickle this user may load: unpickling runs code, so a file that another user owns,
    that anyone may write, or that is a symbolic link is refused (PermissionError), before any
    byte is read. Checked on the open file itself, so it cannot be swapped after the check. (A
    group-writable file of one's own passes: a umask of 002 with a group per user makes them.)"""
    try:  # not blocking: a FIFO planted there would otherwise hang the open itself
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise PermissionError(f"{path} is a symbolic link: refusing to unpickle what it points to") from err
        raise
    os.set_blocking(fd, True)
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = "is not a regular file"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by user id {info.st_uid}, not by you ({os.geteuid()})"
    elif info.st_mode & stat.S_IWOTH:
        problem = f"may be written by anyone (mode {info.st_mode & 0o777:o})"
    if problem is not None:
        os.close(fd)
        raise PermissionError(
            f"{path} {problem}: refusing to unpickle it (loading a pickle runs its code). If you trust "
            f"it, make it yours and private: chown $USER {path}; chmod o-w {path}"
        )
    return os.fdopen(fd, "rb")


# ----------------------------------------------------------------------------- in the script


def run_exported(script: str, code: str, options: dict[str, Any]) -> NoReturn:
    """Run an exported cell as this torchrun process, then leave as enot_nb's workers do."""
    from enot_nb._serialize import renamed
    from enot_nb._worker import bootstrap
    from enot_nb._worker import cell as _cell
    from enot_nb.distributed import get_rank, init_torch

    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size == 1 and options["world_size"] > 1:
        message = (
            f"enot_nb: this cell was exported for {options['world_size']} processes, but runs as "
            f"one plain process, where it would wait forever for the others; run it with: {options['command']}"
        )
        print(message, file=sys.stderr)
        _tell_torchrun(message)
        sys.exit(2)
    exitcode = 1
    bootstrap.claim_multiprocessing_folder()  # removed when it leaves, as a worker's is
    try:
        path = Path(script).resolve()
        with open_trusted(_beside(path, "namespace.pkl")) as f:
            shipped = renamed.load(f)
        backend = options["backend"] or _default_backend()
        init_torch(
            seed=options["seed"],
            cuda_optimize_for_speed=options["speed"],
            cuda_reproducible=options["reproducible"],
            backend=backend,
            timeout=__import__("datetime").timedelta(seconds=options["timeout"]),
        )
        rank = get_rank()
        if options["output"] == "none" or (options["output"] == "master" and rank != 0):
            _silence_stdout()
        cell_options = _cell.CellOptions(
            sync=options["sync"],
            no_sync=options["no_sync"],
            returns=options["returns"],
            no_return=options["no_return"],
            check_replicas=options.get("check_replicas", False),  # (a script exported before it existed)
            shown=rank == 0 and options["output"] != "none",
            source_header="%%enot_distributed\n",
            figure_dir=str(path.parent),
            figure_prefix=path.stem,
        )
        namespace = {"__name__": "__main__", "__builtins__": __builtins__, **shipped["values"]}
        outcome = _cell.run_cell(code, namespace, cell_options)
        if outcome is not None and outcome.replicas is not None:
            print(outcome.replicas, file=sys.stderr)  # shown under --output none too, as in a notebook
        if outcome is not None:
            _save_results(path, outcome, namespace)
        exitcode = 0
    except BaseException as exc:  # noqa: BLE001 - reported, then the process leaves
        traceback.print_exception(type(exc), exc, bootstrap._user_frames(exc.__traceback__))
        exitcode = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    bootstrap._leave(exitcode)


def _tell_torchrun(message: str) -> None:
    """Under torchrun, make this line the root cause of its failure report (torchrun reads the
    error file it gave this process, TORCHELASTIC_ERROR_FILE, and shows its message in place of
    a bare ChildFailedError dump)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    try:
        raise RuntimeError(message)
    except RuntimeError as err:
        ErrorHandler().record_exception(err)


def _default_backend() -> str:
    import torch

    from enot_nb._runtime.devices import default_backend

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return default_backend(local, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _silence_stdout() -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    sys.stdout.flush()
    os.dup2(null, 1)
    os.close(null)


def _save_results(script: Path, outcome: Any, namespace: dict[str, Any]) -> None:
    from enot_nb._serialize import result_file

    values = {n: namespace[n] for n in outcome.changed_names if n in namespace and n not in outcome.not_returned}
    for name, reason in outcome.not_returned.items():
        print(f"enot_nb: {name!r} was not saved: {reason}", file=sys.stderr)
    target = _beside(script, "results.pkl")
    write_atomically(target, result_file.dump_inline(values))
    print(f"enot_nb: saved {', '.join(sorted(values)) or 'nothing'} to {target}", file=sys.stderr)
