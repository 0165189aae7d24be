"""Exceptions raised by remote connectors (one root, four meanings).

The remote backend catches exactly these: :class:`RemoteUnavailable` opens the
circuit breaker, :class:`RemoteAuthError` disables the tier, :class:`RemoteWrongType`
(a value of another Redis type under our key) is a corrupt entry, anything else derived
from :class:`RemoteError` is a miss for that one call. Exceptions raised by a read
plan (e.g. a corrupt entry) pass through the connector unchanged.
"""

from __future__ import annotations

from lmcache.errors import LMCacheError


class RemoteError(LMCacheError):
    """A remote call failed for this key only (bad reply, server-side error)."""


class RemoteUnavailable(RemoteError):
    """The server cannot be reached or did not answer within the timeout."""


class RemoteAuthError(RemoteError):
    """The server refused the credentials (wrong or missing username/password)."""


class RemoteWrongType(RemoteError):
    """The key holds a value of another Redis type (list, hash, ...): not one of our entries."""
