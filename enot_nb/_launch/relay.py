"""The kernel's side of the workers' front end (see ``enot_nb._worker.frontend``): what the shown
ranks display, clear and open as widgets is published by this kernel, under the cell it runs.

A widget that comes back with a cell's state is adopted by the kernel's comm manager through
``frontend.adopt_comm``, defined next to the reduce that names it (a worker never imports this
layer)."""

from __future__ import annotations

import sys
from typing import Any

from typing_extensions import assert_never

from enot_nb._processes.protocol import ClearOutput, CommMessage, Display, FrontEndMessage


def _shell() -> Any:
    """This process's IPython shell; None in a plain Python process (IPython is not imported)."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


def _kernel() -> Any:
    """This process's Jupyter kernel; None outside one (a plain process, a terminal IPython)."""
    return getattr(_shell(), "kernel", None)


def in_ipython() -> bool:
    """Launched from IPython (a kernel or a terminal): workers get a front end to talk to."""
    return _shell() is not None


def kernel_parent() -> dict | None:
    """The message this Jupyter kernel is answering (its cell's execute_request); None outside a
    kernel. The workers' widgets and Output captures hang under it."""
    kernel = _kernel()
    if kernel is None or not hasattr(kernel, "get_parent"):
        return None
    header = kernel.get_parent().get("header")
    return {"header": dict(header)} if header else {}  # the header is what widgets read


def show(message: FrontEndMessage) -> None:
    """Publish one worker message in the notebook, as the worker's own code asked."""
    from IPython.display import clear_output, publish_display_data

    match message:
        case Display(data, metadata, transient, update):
            publish_display_data(data, metadata, transient=transient, update=update)
        case ClearOutput(wait):
            clear_output(wait=wait)
        case CommMessage():
            _publish_comm(message)
        case _:
            assert_never(message)


def _publish_comm(message: CommMessage) -> None:
    kernel = _kernel()
    if kernel is None:  # a terminal IPython: no front end can show a widget
        return
    kernel.session.send(
        kernel.iopub_socket,
        message.msg_type,
        message.content,
        metadata=message.metadata,
        parent=kernel.get_parent(),
        ident=message.topic,
        buffers=message.buffers,
    )
