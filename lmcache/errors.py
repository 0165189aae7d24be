"""The one error root of lmcache.

:class:`LMCacheError` is the base of every exception lmcache defines. Callers that want
"anything the cache itself raised" catch this one class. Errors about user input also
subclass ``ValueError``/``TypeError`` (``ConfigError`` is a ``ValueError`` too), so code
written against the standard types keeps working.

This module imports nothing from lmcache, so every layer may import it.
"""

from __future__ import annotations


class LMCacheError(Exception):
    """Base class of every exception defined by lmcache."""
