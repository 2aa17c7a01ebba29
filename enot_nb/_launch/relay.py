"""The kernel's side of the workers' front end (see :mod:`enot_nb._worker.frontend`): what the shown
ranks display, clear and open as widgets is published by this kernel, under the cell it runs."""

from __future__ import annotations

import sys
from typing import Any

from enot_nb._processes.protocol import Kind


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


def show(kind: str, payload: Any) -> None:
    """Publish one worker message in the notebook, as the worker's own code asked."""
    from IPython.display import clear_output, publish_display_data

    if kind == Kind.DISPLAY:
        publish_display_data(payload.data, payload.metadata, transient=payload.transient, update=payload.update)
    elif kind == Kind.CLEAR_OUTPUT:
        clear_output(wait=payload)
    elif kind == Kind.COMM:
        _publish_comm(payload)


def _publish_comm(message: Any) -> None:
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


def adopt_comm(comm_id: str, target_name: str) -> Any:
    """The kernel's comm for one a worker opened (its model exists in the front end already):
    registered without a new comm_open, so the object that came back keeps working, both ways."""
    import comm

    adopted = comm.create_comm(comm_id=comm_id, target_name=target_name, primary=False)
    comm.get_comm_manager().register_comm(adopted)
    kernel = _kernel()
    if kernel is not None and hasattr(adopted, "kernel"):
        adopted.kernel = kernel  # ipywidgets syncs a widget's changes only through a comm with a kernel
    return adopted
