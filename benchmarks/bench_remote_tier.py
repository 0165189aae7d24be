"""The remote tier benchmark, the same as ``lmcache bench remote -- ARGS``: see lmcache/bench/remote_tier.py."""

from lmcache.bench.remote_tier import main

if __name__ == "__main__":
    main()
