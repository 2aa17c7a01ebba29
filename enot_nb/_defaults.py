"""Defaults that several layers share, defined once (the functional API, the launcher, the
magic, the exported script and the rendezvous all default to the same process-group timeout)."""

from __future__ import annotations

import datetime

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a process group's collectives wait for every rank (torch's own default)."""

SESSION_HANG_AFTER = 300.0
"""A session's ``hang_after`` (one-off launches: never): five minutes in which no rank used CPU
time is a hang, or a wait on something outside the ranks (a download on the master)."""
