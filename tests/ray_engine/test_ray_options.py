"""The Ray engine's options in the magic, refused before anything starts (no cluster needed)."""

from __future__ import annotations

import pytest

from tests.kernel import running_kernel

pytestmark = pytest.mark.timeout(120)


def _usage_error(run, words: str) -> bool:
    """IPython prints a UsageError as one line, without a traceback, and replies with an error."""
    return run.status == "error" and run.stderr.startswith("UsageError: ") and words in run.stderr


def test_ray_client_and_engine_options_without_the_engine_are_usage_errors():
    with running_kernel("%load_ext enot_nb") as kernel:
        run = kernel.run("%enot_session start -n 2 --engine ray --address ray://head:10001")
        assert _usage_error(run, "%enot_session --address: address='ray://head:10001': Ray Client (ray://)"), run.stderr
        run = kernel.run("%enot_session start -n 2 --gpus-per-rank 1")
        assert _usage_error(run, "%enot_session --engine: "), run.stderr
        run = kernel.run("%enot_session start --engine ray")
        assert _usage_error(run, "%enot_session -n: engine='ray' needs -n N"), run.stderr
        assert "no session is running" in kernel.ok("%enot_session").stdout
