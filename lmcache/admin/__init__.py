"""The admin API (``lmcache admin serve``): an HTTP service that answers, for the vLLM
instances using lmcache, how much of a prompt each tier holds, and clears or pins
cached prefixes. It never returns KV bytes. See docs/admin.md.

Modules: :mod:`.auth` (bearer token, bind check), :mod:`.schemas` (request bodies),
:mod:`.directory` (which instances exist: registrations and local sockets),
:mod:`.remote` (the remote store probed directly), :mod:`.service` (the operations),
:mod:`.server` (the FastAPI app).
"""
