"""Defaults that several layers share, defined once (the functional API, the launcher, the
magic, the exported script and the rendezvous all default to the same process-group timeout)."""

from __future__ import annotations

import datetime

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a process group's collectives wait for every rank (torch's own default)."""
