"""What a rank of a session on Ray knows of its place on the cluster, and the guard that keeps
it from joining Ray itself.

A rank is a child of its Ray actor (the agent, see _launch/ray_agent), not a Ray worker: Ray's
API in it would connect as a new driver (or start a Ray instance of its own) and answer for
that connection's node, not the rank's. So the agent hands the rank its place in one variable
(``ENOT_NB_RAY_CONTEXT``, read by ``enot_nb.distributed.ray_context()``), auto-connect is off
(``RAY_ENABLE_AUTO_CONNECT=0``), and ``ray.init`` and the calls that would connect raise an error
that names ``ray_context()``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

CONTEXT_VARIABLE = "ENOT_NB_RAY_CONTEXT"


@dataclass(frozen=True)
class RayContext:
    """Where a rank of a session on Ray runs, as its agent (the Ray actor that started it) sees it."""

    node_id: str
    """The Ray node's id (hex)."""
    node_ip: str
    """The node's IP address, as Ray knows it."""
    actor_id: str
    """The rank's agent: its Ray actor id (hex)."""
    actor_name: str
    """The agent's name (``ray.get_actor(actor_name)`` from the notebook's driver)."""
    placement_group_id: str
    """The session's placement group (hex)."""
    bundle_index: int
    """The bundle of that group the rank's agent holds."""
    gpu_ids: tuple[str, ...]
    """The GPUs Ray assigned to the agent (the rank sees them as ``CUDA_VISIBLE_DEVICES``)."""

    def variables(self) -> dict[str, str]:
        """What the agent sets in its rank's environment."""
        return {CONTEXT_VARIABLE: json.dumps(asdict(self)), "RAY_ENABLE_AUTO_CONNECT": "0"}


def context() -> RayContext | None:
    """This rank's place on the cluster; None outside a rank of a session on Ray."""
    text = os.environ.get(CONTEXT_VARIABLE)
    if not text:
        return None
    fields: dict[str, Any] = json.loads(text)
    fields["gpu_ids"] = tuple(fields["gpu_ids"])
    return RayContext(**fields)


REFUSAL = (
    "this process is a rank of an enot_nb session on Ray, not a Ray worker: calling Ray here would "
    "connect it to a cluster as a new driver (or start a Ray instance of its own). For the rank's "
    "node, actor, bundle and GPUs, call enot_nb.distributed.ray_context(); run Ray work from the notebook"
)


def refuse(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(REFUSAL)


def install() -> None:
    """In a rank of a session on Ray: ``ray``, once imported, refuses to connect (see above)."""
    if CONTEXT_VARIABLE not in os.environ:
        return
    if "ray" in sys.modules:
        _guard(sys.modules["ray"])
    else:
        sys.meta_path.insert(0, _RayFinder())


def _guard(ray: ModuleType) -> None:
    """``ray.init``, ``ray.get_runtime_context`` and Ray's auto-connect hook replaced by refuse."""
    for name in ("init", "get_runtime_context"):
        setattr(ray, name, refuse)
    # Ray's auto-connect hook (ray.get, ray.put, ray.remote(...).remote, placement groups...):
    # both modules Ray imports it into (its own import loaded them; looked up, not imported here).
    for hooked in ("ray._private.auto_init_hook", "ray._private.client_mode_hook"):
        module = sys.modules.get(hooked)
        if module is not None:
            module.auto_init_ray = refuse  # type: ignore[attr-defined]


class _RayFinder(importlib.abc.MetaPathFinder):
    """Guards ``ray`` right after it is imported (a rank that never imports it pays nothing)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "ray":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            _guard(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
