"""Whether the kernel's out-of-memory killer killed a process of ours: its count of OOM kills in
this process's memory cgroup (``oom_kill`` in cgroup v2's ``memory.events``, or in v1's
``memory.oom_control``), read before and after. A SIGKILL is named as the OOM killer's only where
the count rose; elsewhere a person, a scheduler or another process sent it."""

from __future__ import annotations

import functools
import os


def oom_kills() -> int | None:
    """The OOM kills counted in this process's memory cgroup so far, or None where no cgroup
    file tells (not Linux, no memory controller, not readable)."""
    for path in _counter_files():
        try:
            with open(path) as counters:
                for line in counters:
                    name, _, value = line.partition(" ")
                    if name == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


@functools.cache
def _counter_files() -> list[str]:
    """Where the counter may be: cgroup v2's memory.events (the unified hierarchy, mounted at
    /sys/fs/cgroup or /sys/fs/cgroup/unified), then v1's memory.oom_control. Found once: a
    process keeps its cgroup (a launch reads the counter at every start)."""
    try:
        with open("/proc/self/cgroup") as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return []
    files = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _, controllers, path = entry
        if controllers == "":
            files += [f"/sys/fs/cgroup{path}/memory.events", f"/sys/fs/cgroup/unified{path}/memory.events"]
        elif "memory" in controllers.split(","):
            files.append(f"/sys/fs/cgroup/memory{path}/memory.oom_control")
    return [f for f in files if os.path.exists(f)]
