"""The tier benchmarks that ``lmcache bench`` runs, shipped with the package.

``cpu_tier``, ``disk_tier`` and ``remote_tier`` each print a ratio table against limits
measured in the same run (``limits``: numpy memcpy, raw file I/O, raw redis-py), so an
installed lmcache can measure itself on the machine it serves from. Each module's
``main(argv)`` parses the arguments after ``lmcache bench TIER --``. The benchmarks that
need vLLM, a model or an older build to compare with stay in the source checkout's
``benchmarks/`` (docs/performance.md). Not used by the engine itself.
"""
