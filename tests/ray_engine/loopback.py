"""The environment of a Ray cluster on this machine, for the tests and benchmarks/bench_ray.py."""

from __future__ import annotations

import secrets


def ray_variables(folder: str) -> dict[str, str]:
    """The variables every process of a loopback cluster shares: Ray's single-machine mode
    (else it turns 127.0.0.1 into the machine's outward address), token authentication with
    a fresh token, its own ``RAY_TMPDIR`` (``folder``), no usage reports."""
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_TMPDIR": folder,
        "RAY_USAGE_STATS_ENABLED": "0",
    }
