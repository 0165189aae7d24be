"""lmcache: a KV-cache engine for LLM inference engines."""

__version__ = "0.1.0"
