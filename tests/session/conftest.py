"""Fixtures of the session tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["tracked", "shadow"])
def pages(request, monkeypatch):
    """How a long-lived process tells the pages it wrote: the kernel's write tracking (see
    _memory/writes), or, where that is refused, a paused shadow fork."""
    from enot_nb._memory.writes import WRITES

    if request.param == "shadow":
        monkeypatch.setenv("ENOT_NB_TRACK_WRITES", "0")  # the workers inherit it
    elif not WRITES.available():
        pytest.skip("this kernel or sandbox refuses userfaultfd's asynchronous write protection")
    return request.param
