"""The proxy's Prometheus metrics, in a registry of its own (served on the proxy's ``/metrics``).

==========================================  =========  ===============================================
name                                        type       labels / meaning
==========================================  =========  ===============================================
``lmcache_proxy_requests_total``            counter    ``endpoint`` (completions, chat_completions,
                                                       models), ``outcome`` (see :data:`OUTCOMES`)
``lmcache_proxy_prefill_fallbacks_total``   counter    ``cause`` (see :data:`FALLBACK_CAUSES`): the
                                                       decoder served the request without the
                                                       prefiller's KV
``lmcache_proxy_rejected_total``            counter    ``reason`` (see :data:`REJECT_REASONS`): answered
                                                       by the proxy alone, no server asked
``lmcache_proxy_prefill_seconds``           histogram  the prefill leg, sent to answered (or failed)
``lmcache_proxy_ttfb_seconds``              histogram  request received to the first byte of the
                                                       answer sent to the client
``lmcache_proxy_e2e_seconds``               histogram  request received to the last byte sent
``lmcache_proxy_instance_up``               gauge      ``role``, ``url``: 1 while taken for requests
``lmcache_proxy_in_flight``                 gauge      requests being served now (at most
                                                       ``--max-concurrency``)
==========================================  =========  ===============================================
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("ok", "error", "stream_error", "disconnected", "unavailable", "bad_request")
"""``ok``: a 200 answer sent in full; ``error``: the decoder's error answer (or 502/504 when
no decoder answered) sent; ``stream_error``: the decoder's stream broke off (or ended
without ``data: [DONE]``) after the first byte, the client got a final error event;
``disconnected``: the client left before the end of its answer; ``unavailable``: no
decoder up (503); ``bad_request``: the client's body is not a JSON object (400)."""

FALLBACK_CAUSES = ("no_prefiller", "connect", "timeout", "status", "no_params", "unsigned")
"""``no_prefiller``: none up; ``connect``/``timeout``: the request to it failed (timeout:
``--prefill-timeout``); ``status``: it answered non-200; ``no_params``: its answer had no
``kv_transfer_params`` dict; ``unsigned``: its ``kv_transfer_params`` had no well-formed
``prompt_digest`` and ``remote_num_tokens``, so the proxy could not sign them."""

REJECT_REASONS = ("overloaded", "body_too_large", "body_timeout")
"""``overloaded``: ``--max-concurrency`` requests already in flight (503); ``body_too_large``:
a body over ``--max-body-bytes`` (413); ``body_timeout``: a body not received in time (408)."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ProxyMetrics:
    """The metrics above, registered in a fresh ``CollectorRegistry`` (two proxies in one
    process, as in tests, never share counts)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lmcache_proxy_requests", "Client requests by endpoint and outcome", ("endpoint", "outcome"), registry=r
        )
        self.fallbacks = Counter(
            "lmcache_proxy_prefill_fallbacks",
            "Requests the decoder served without the prefiller's KV, by cause",
            ("cause",),
            registry=r,
        )
        for cause in FALLBACK_CAUSES:
            self.fallbacks.labels(cause)
        self.rejected = Counter(
            "lmcache_proxy_rejected",
            "Requests the proxy answered alone (too many in flight, body too large or too slow), by reason",
            ("reason",),
            registry=r,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.prefill_seconds = Histogram(
            "lmcache_proxy_prefill_seconds", "Prefill leg duration", buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttfb_seconds = Histogram(
            "lmcache_proxy_ttfb_seconds",
            "Request received to first byte sent to the client",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_seconds = Histogram(
            "lmcache_proxy_e2e_seconds", "Request received to last byte sent", buckets=LATENCY_BUCKETS, registry=r
        )
        self.instance_up = Gauge(
            "lmcache_proxy_instance_up", "1 while the instance is taken for requests", ("role", "url"), registry=r
        )

        self.in_flight = Gauge(
            "lmcache_proxy_in_flight", "Requests to the serving routes being answered now", registry=r
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of the registry."""
        return generate_latest(self.registry)
