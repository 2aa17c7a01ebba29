"""The exception hierarchy of enot_nb.

Every error the package raises derives from :class:`EnotNbError`; each leaf also derives from
the builtin it refines, so ``except RuntimeError`` keeps working for users who do not know us.
"""

from __future__ import annotations


class EnotNbError(Exception):
    """Root of every error raised by enot_nb."""


class DistributedRuntimeException(EnotNbError, RuntimeError):
    """A distributed set-up or collective failed (name kept from the ENOT reference API)."""


class EnotNbWarning(UserWarning):
    """Root of every warning issued by enot_nb (turned into errors in our own tests)."""
