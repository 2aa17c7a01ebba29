"""A worker's Jupyter front end: display data and widgets reach the notebook through the launcher.

A worker started from a kernel must look like that kernel to display libraries (IPython.display,
matplotlib, tqdm.auto, ipywidgets), yet never touch the kernel's ZMQ sockets: they are not
fork-safe, and under fork a worker inherits the kernel's shell, publisher, comm functions and
output streams, all of which write to them. Under spawn it inherits nothing, and tqdm.auto would
fall back to a text bar. ``install`` gives a worker the same front end under both:

- an IPython shell (the inherited one, or under spawn a new one of the kernel's class) whose
  display publisher sends DISPLAY messages;
- comms (``comm.create_comm``'s, and under fork the kernel's own, e.g. a widget displayed before
  the cell) whose messages (comm_open/msg/close) travel as COMM messages; the kernel publishes
  them on iopub under the cell (see ``enot_nb._launch.relay``);
- ``shell.kernel`` replaced by a stand-in that knows only the message the kernel is answering
  (ipywidgets' Output widget reads it to capture output);
- ``input()``, ``getpass()`` and the debugger asking the notebook through the kernel (a session;
  in a one-off cell, a clear error: see rank_input), ``sys.displayhook`` showing values as
  display data;
- a comm that comes back with the cell's state is adopted by the kernel (same id, no new open;
  see adopt_comm, the one function here that runs in the kernel).

Messages from the front end back to a worker's widget are not delivered (one-way widgets only).
Every rank installs it; the kernel shows what the ranks whose output is shown send.
"""

from __future__ import annotations

import base64
import os
import sys
from collections.abc import Callable
from typing import Any

from enot_nb._processes.protocol import ClearOutput, CommMessage, Display, FrontEndMessage
from enot_nb._worker import figures, rank_input

Send = Callable[[FrontEndMessage], None]

MPL_BACKEND = "module://enot_nb._worker.mpl_backend"


class PipePublisher:
    """Stands in for IPython's display publisher: display data goes to the notebook (or, in an
    exported script, text to stdout and images to ``figure_dir``)."""

    def __init__(
        self, send: Send | None, shown: bool = True, figure_dir: str | None = None, figure_prefix: str = "cell"
    ):
        self.send, self.shown = send, shown
        self.figure_dir, self.figure_prefix = figure_dir, figure_prefix
        self.is_publishing = False
        self._saved = 0

    def publish(
        self,
        data: dict,
        metadata: dict | None = None,
        source: Any = None,
        *,
        transient: dict | None = None,
        update: bool = False,
        **_: Any,
    ) -> None:
        if not self.shown:
            return
        if self.figure_dir is None and self.send is not None:
            self.send(Display(data, metadata or {}, transient or {}, update))
        elif "image/png" in data:
            assert self.figure_dir is not None, "no launcher to send images to, and no folder for them"
            self._saved += 1
            path = os.path.join(self.figure_dir, f"{self.figure_prefix}.figure-{self._saved}.png")
            with open(path, "wb") as f:
                f.write(base64.b64decode(data["image/png"]))
            print(f"[figure saved to {path}]")
        elif "text/plain" in data:
            print(data["text/plain"])

    def set_parent(self, parent: dict) -> None:
        """The kernel stamps each message with its cell; here the launching kernel does that."""

    def clear_output(self, wait: bool = False) -> None:
        if self.shown and self.figure_dir is None and self.send is not None:
            self.send(ClearOutput(wait))


def _publisher(send: Send) -> Callable[..., None]:
    """A comm's ``publish_msg`` that sends to the launching kernel, which publishes on iopub."""

    def publish_msg(
        self: Any,
        msg_type: str,
        data: dict | None = None,
        metadata: dict | None = None,
        buffers: list | None = None,
        **keys: Any,
    ) -> None:
        content = dict(data=data or {}, comm_id=self.comm_id, **keys)
        send(CommMessage(msg_type, content, metadata or {}, [bytes(b) for b in buffers or []], self.topic))

    return publish_msg


def _install_comms(send: Send) -> Any:
    """New comms (``comm.create_comm``) and the kernel's own (widgets made before the cell, under
    fork) publish through ``send``; returns the worker's comm manager, or None without ``comm``."""
    try:
        import comm
        from comm.base_comm import BaseComm, CommManager
    except ImportError:  # no comm package: no widget library can be imported either
        return None
    publish = _publisher(send)
    pipe_comm = type(
        "PipeComm",
        (BaseComm,),
        {"publish_msg": publish, "__reduce__": _adopted_in_kernel, "__doc__": _publisher.__doc__},
    )
    manager = CommManager()
    comm.create_comm = pipe_comm
    comm.get_comm_manager = lambda: manager
    try:  # the kernel's own comm class (its Comm subclasses it), used directly by older code
        from ipykernel.comm.comm import BaseComm as KernelComm
    except ImportError:
        pass
    else:
        # Patched on the class, as the point is: every instance, made before the cell or in it.
        KernelComm.publish_msg = publish  # type: ignore[method-assign]
        KernelComm.__reduce__ = _adopted_in_kernel  # type: ignore[method-assign]
    return manager


def _adopted_in_kernel(self: Any) -> tuple:
    """A comm (a widget's) that comes back with the cell's state becomes the kernel's comm of the
    same id: later cells update the same front-end model (see adopt_comm)."""
    return (adopt_comm, (self.comm_id, self.target_name))


def adopt_comm(comm_id: str, target_name: str) -> Any:
    """The kernel's comm for one a worker opened (its model exists in the front end already):
    registered without a new comm_open, so the object that came back keeps working, both ways.

    Runs in the kernel, not in a worker: the pickle of a worker's comm names it (see
    _adopted_in_kernel). It lives here, next to that reduce, rather than with the kernel's other
    half of the front end (relay), so that the worker side never imports the launcher's layer;
    the kernel imports this module when it unpickles the first comm."""
    import comm

    adopted = comm.create_comm(comm_id=comm_id, target_name=target_name, primary=False)
    comm.get_comm_manager().register_comm(adopted)
    kernel = _this_kernel()
    if kernel is not None and hasattr(adopted, "kernel"):
        adopted.kernel = kernel  # ipywidgets syncs a widget's changes only through a comm with a kernel
    return adopted


def _this_kernel() -> Any:
    """This process's Jupyter kernel; None outside one (as relay's: IPython is not imported
    here if it was not already)."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None)


class KernelStandIn:
    """What a worker sees as ``get_ipython().kernel``: the message the kernel answers, and no
    sockets. ipywidgets' Output widget reads the parent to capture the output under it."""

    def __init__(self, parent: dict, comm_manager: Any) -> None:
        self._parent, self.comm_manager = parent, comm_manager

    def get_parent(self, channel: str | None = None) -> dict:
        return self._parent

    @property
    def _parent_header(self) -> dict:  # ipykernel < 6 spelling, read by older ipywidgets
        return self._parent


def install(kernel_parent: dict | None, send: Send | None) -> Any:
    """Make this worker's display, widgets and input go through ``send`` (to the launcher);
    returns the shell.

    ``kernel_parent``: the message the launching kernel is answering (None in a terminal IPython,
    where widgets have no front end to reach)."""
    shell = _shell(kernel_parent is not None)
    shell.display_pub = PipePublisher(send)
    png = shell.display_formatter.formatters["image/png"]
    png.for_type_by_name("matplotlib.figure", "Figure", figures.figure_png)
    rank_input.install()  # ipykernel's would ask the front end over its sockets: ours ask through the kernel
    hook = _pipe_displayhook(shell)
    # The trap swaps sys.displayhook for the shell's during run_cell and restores "old_hook".
    shell.displayhook = shell.display_trap.hook = shell.display_trap.old_hook = sys.displayhook = hook
    os.environ["MPLBACKEND"] = MPL_BACKEND
    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].switch_backend(MPL_BACKEND)
    if send is not None and kernel_parent is not None and (manager := _install_comms(send)) is not None:
        shell.kernel = KernelStandIn(kernel_parent, manager)
        if hasattr(shell, "set_parent"):
            shell.set_parent(kernel_parent)
    elif hasattr(shell, "kernel"):
        shell.kernel = None
    # ipykernel's shell sends a traceback shown inside an Output widget over its sockets.
    shell._showtraceback = lambda etype, value, stb: print(shell.InteractiveTB.stb2text(stb), file=sys.stderr)
    return shell


def follow_parent(parent: dict | None) -> None:
    """A session's worker runs many cells: its widgets and Output captures hang under the cell
    the kernel answers now, not the one that started the session."""
    if parent is None:
        return
    from IPython.core.interactiveshell import InteractiveShell

    shell: Any = InteractiveShell.instance() if InteractiveShell.initialized() else None
    stand_in = getattr(shell, "kernel", None)
    if isinstance(stand_in, KernelStandIn):
        stand_in._parent = parent
        if hasattr(shell, "set_parent"):
            shell.set_parent(parent)


def _shell(in_kernel: bool) -> Any:
    """The kernel's shell, inherited by fork (never use its sockets); under spawn a new one of the
    same class when launched from a Jupyter kernel: libraries recognise a notebook by the class
    ZMQInteractiveShell, by ``ipykernel.zmqshell`` being imported (tqdm.auto) or by the
    ``IPKernelApp`` section of its config."""
    from IPython.core.interactiveshell import InteractiveShell

    if InteractiveShell.initialized():
        return InteractiveShell.instance()
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    if not in_kernel:
        return InteractiveShell.instance(config=config)
    from ipykernel.zmqshell import ZMQInteractiveShell

    config.IPKernelApp.enot_nb_worker = True
    return ZMQInteractiveShell.instance(config=config)


def _pipe_displayhook(shell: Any) -> Any:
    """The shell's displayhook (``run_cell`` in a cell, ``sys.displayhook``): a value is shown as
    display data through the publisher, not by ipykernel's hook, which writes to its sockets."""
    from IPython.core.displayhook import DisplayHook

    class PipeDisplayHook(DisplayHook):
        def start_displayhook(self) -> None:
            pass

        def write_output_prompt(self) -> None:
            pass

        def write_format_data(self, format_dict: dict, md_dict: dict | None = None) -> None:
            shell.display_pub.publish(format_dict, md_dict or {})

        def finish_displayhook(self) -> None:
            pass

        def set_parent(self, parent: dict) -> None:  # ipykernel's shell stamps its hook's messages
            pass

    return PipeDisplayHook(shell=shell, cache_size=0)
