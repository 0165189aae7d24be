"""The disk tier benchmark, the same as ``lmcache bench disk -- ARGS``: see lmcache/bench/disk_tier.py."""

from lmcache.bench.disk_tier import main

if __name__ == "__main__":
    main()
