"""Disaggregated prefill/decode (PD) serving: the ``lmcache proxy`` router.

A prefiller vLLM server (``kv_role: kv_producer``) computes a prompt's KV and stores it
in the shared remote tier; a decoder (``kv_role: kv_consumer``) loads it and generates.
The proxy sends each client request to one of each, in that order:

* :mod:`lmcache.pd.pool`: the instances of one role, round-robin over the healthy ones,
  and the background health check;
* :mod:`lmcache.pd.sse`: removing ``kv_transfer_params`` from the decoder's answers;
* :mod:`lmcache.pd.metrics`: the proxy's own Prometheus registry;
* :mod:`lmcache.pd.signing`: the proxy's signature of a prefiller's parameters, checked
  by the decoders (the shared PD secret);
* :mod:`lmcache.pd.proxy`: the HTTP app (the two legs, fallback, retry, admission),
  served under :mod:`lmcache.http_server`'s limits.

This package imports nothing from the engine nor from the vLLM adapter; it needs
FastAPI, uvicorn and httpx (``pip install lmcache[proxy]``; vLLM depends on all three).
"""
