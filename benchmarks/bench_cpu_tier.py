"""The cpu tier benchmark, the same as ``lmcache bench cpu -- ARGS``: see lmcache/bench/cpu_tier.py."""

from lmcache.bench.cpu_tier import main

if __name__ == "__main__":
    main()
