"""lmcache: a KV-cache engine for LLM inference engines."""

__version__ = "0.1.0"

from lmcache.observability.logs import setup_logging as _setup_logging  # noqa: E402

# Visible, prefixed log lines under hosts that configure no logging (vLLM); a no-op
# for hosts that did (see lmcache.observability.logs).
_setup_logging()
