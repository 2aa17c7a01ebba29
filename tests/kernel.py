"""A real Jupyter kernel for tests (jupyter_client), and what one cell produced."""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class CellRun:
    msg_id: str = ""
    stdout: str = ""
    stderr: str = ""
    displays: list[dict] = field(default_factory=list)
    result: dict | None = None  # execute_result data
    error: dict | None = None  # ename, evalue, traceback
    status: str = ""
    comms: list[dict] = field(default_factory=list)  # comm_open/comm_msg/comm_close messages
    prompts: list[str] = field(default_factory=list)  # the input requests' prompts, in order
    arrived: list[tuple[str, dict]] = field(default_factory=list)  # (msg_type, content), in order

    def comm_states(self) -> list[dict]:
        """The widget states the client received, in order (comm_open and comm_msg updates)."""
        return [m["content"]["data"].get("state", {}) for m in self.comms if m["msg_type"] in ("comm_open", "comm_msg")]

    @property
    def traceback(self) -> str:
        return "\n".join(self.error["traceback"]) if self.error else ""


class Kernel:
    def __init__(self, extra_env: dict[str, str] | None = None, log_path: Path | None = None, cwd: Path = ROOT):
        """``log_path``: the kernel's own stderr (its log) goes there; ``cwd``: its folder."""
        env = dict(os.environ) | {"PYTHONPATH": str(ROOT)} | (extra_env or {})
        self.manager = KernelManager(kernel_name="python3")
        self.log_path = log_path
        if log_path is None:
            self.manager.start_kernel(cwd=str(cwd), env=env)
        else:
            with open(log_path, "wb") as log:
                self.manager.start_kernel(cwd=str(cwd), env=env, stderr=log)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)

    @property
    def pid(self) -> int:
        return self.manager.provisioner.process.pid

    def run(self, code: str, timeout: float = 60, on_output=None, answer=None, allow_stdin: bool = True) -> CellRun:
        """Execute one cell and collect its output until the kernel is idle again. ``answer``:
        the front end's stdin, ``answer(prompt, run)`` giving each line asked for (as a user
        types it; None: none, as when the stop button is pressed at the prompt); without it, an
        input request fails the test. ``allow_stdin``: False is a
        front end without stdin (nbclient, papermill)."""
        msg_id = self.client.execute(code, allow_stdin=allow_stdin)
        run = CellRun(msg_id=msg_id)
        deadline = time.monotonic() + timeout
        while True:
            self._answer_input(run, answer)
            try:
                msg = self.client.get_iopub_msg(timeout=min(0.05, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() < deadline:
                    continue
                raise TimeoutError(
                    f"cell did not finish in {timeout} s: {code[:200]!r}\n"
                    f"stdout so far: {run.stdout[-2000:]!r}\n"
                    f"stderr so far: {run.stderr[-2000:]!r}"
                ) from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            run.arrived.append((kind, content))
            if kind == "stream":
                setattr(run, content["name"], getattr(run, content["name"]) + content["text"])
                if on_output:
                    on_output(run)
            elif kind in ("display_data", "update_display_data"):
                run.displays.append(content)
            elif kind == "execute_result":
                run.result = content["data"]
            elif kind == "error":
                run.error = content
            elif kind.startswith("comm_"):
                run.comms.append({"msg_type": kind, "content": content, "received": time.time()})
            elif kind == "status" and content["execution_state"] == "idle":
                break
        # This cell's reply: wait_for_ready may have sent a second kernel_info_request whose reply
        # is still queued (seen in CI under load: a later cell then read the one before's status).
        while True:
            reply = self.client.get_shell_msg(timeout=10)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        run.status = reply["content"]["status"]
        return run

    def _answer_input(self, run: CellRun, answer) -> None:
        try:
            msg = self.client.get_stdin_msg(timeout=0)
        except queue.Empty:
            return
        if msg["msg_type"] != "input_request":
            return
        prompt = msg["content"]["prompt"]
        run.prompts.append(prompt)
        if answer is None:
            raise AssertionError(f"the cell asked for input ({prompt!r}), and the test gives none")
        line = answer(prompt, run)
        if line is not None:  # None: no answer (the test pressed stop instead)
            self.client.input(line)

    def ok(self, code: str, timeout: float = 60) -> CellRun:
        run = self.run(code, timeout)
        assert run.error is None, run.traceback + run.stderr
        return run

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@contextmanager
def running_kernel(setup: str = "") -> Iterator[Kernel]:
    """A fresh kernel that has run ``setup``; shut down (with its processes) on the way out."""
    kernel = Kernel()
    try:
        if setup:
            kernel.ok(setup)
        yield kernel
    finally:
        kernel.shutdown()
