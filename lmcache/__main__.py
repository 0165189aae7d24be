"""``python -m lmcache``: the lmcache command line (see :mod:`lmcache.cli`)."""

from lmcache.cli import entry_point

entry_point()
