"""The admin API (``lmcache admin serve``): an HTTP service that answers, for the vLLM
instances using lmcache, how much of a prompt each tier holds, and clears, pins and
unpins cached prefixes. It never returns KV bytes. See docs/admin.md.

Modules: :mod:`.auth` (bearer token and Host rules), :mod:`.token_file` (the generated
token in the private runtime directory), :mod:`.guard` (ASGI middleware checking Host
and token before anything else), :mod:`.schemas` (request bodies, parsed off the event
loop), :mod:`.directory` (which instances exist and which registrations are trusted),
:mod:`.remote` (the remote store probed directly), :mod:`.service` (the operations),
:mod:`.server` (the FastAPI app and how it is served).
"""
