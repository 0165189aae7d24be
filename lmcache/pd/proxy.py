"""The ``lmcache proxy`` HTTP app: each completion request goes to a prefiller, then a decoder.

Legs of one request (both carry the header ``X-Request-Id: <id>``, one fresh id per
client request, also returned to the client):

1. **prefill**: the client's JSON body with ``max_tokens: 1`` (chat: also
   ``max_completion_tokens: 1`` if the client set it), ``stream: false``, no
   ``stream_options`` nor ``min_tokens``, and ``kv_transfer_params:
   {"do_remote_decode": true, "do_remote_prefill": false}``, to the next prefiller that
   is up. Its answer's ``kv_transfer_params`` (a dict), signed by the proxy
   (:func:`lmcache.pd.signing.sign`: the prefiller's ``prompt_digest`` and
   ``remote_num_tokens`` under the shared PD secret, valid ``sign_ttl`` seconds), is the
   result of the leg.
2. **decode**: the client's body (streaming or not, as it asked) with
   ``kv_transfer_params`` set to that dict, to the next decoder that is up. Its answer
   goes back to the client: JSON, or SSE passed on line by line as it arrives, in both
   cases without ``kv_transfer_params``.

Limits (answered by the proxy alone, no server asked, counted in
``lmcache_proxy_rejected_total{reason}``): a body over ``max_body_bytes`` -> 413, a body
not received within 30 s -> 408 (:class:`lmcache.http_server.BodyLimit`);
``max_concurrency`` requests to the serving routes already in flight -> 503 with
``Retry-After``. ``/health`` and ``/metrics`` are never refused by the proxy (the server's
own connection limit is set above ``max_concurrency``, :meth:`ProxyConfig.server_limits`).

Failures:

* prefill leg (no prefiller up, no connection, no answer within ``prefill_timeout``,
  non-200, no ``kv_transfer_params`` dict, or one without ``prompt_digest`` and
  ``remote_num_tokens`` to sign): the decoder serves the request alone (no
  ``kv_transfer_params``), counted in ``lmcache_proxy_prefill_fallbacks_total{cause}``
  and logged once per cause;
* decode leg before the first byte went to the client: a decoder that could not be
  reached (connection refused: nothing was sent) or answered 5xx is replaced by one other
  decoder that is up; a timeout is never re-run elsewhere (the generation may have
  happened): 504. Failing that the client gets the decoder's error answer, or 502 (no
  connection) / 504 (timeout) / 503 (no decoder up) with an OpenAI-style
  ``{"error": {...}}`` body. A 4xx answer (the client's fault) is passed on as it is;
* decode leg after the first byte (the decoder's stream broke off, or ended without
  ``data: [DONE]``): the client's stream ends with an SSE error event
  ``data: {"error": {"message", "type": "upstream_error", "code": 502}}`` (504 for a
  timeout), never with a ``[DONE]``; counted as outcome ``stream_error``;
* no request failure takes an instance out of rotation: only its health check does
  (:mod:`lmcache.pd.pool`).

A client that closes its connection ends its request: the legs in flight are cancelled,
which closes the connections to the servers (vLLM then aborts the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from lmcache.http_server import ASGIApp, Message, Receive, Scope, Send, ServerLimits
from lmcache.log_once import LogOnce
from lmcache.pd import signing
from lmcache.pd.metrics import ProxyMetrics
from lmcache.pd.pool import Instance, InstancePool
from lmcache.pd.sse import KEY, SSEFilter, strip_json_body

logger = logging.getLogger(__name__)

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""``kv_transfer_params`` of the prefill leg: compute and store the prompt's KV for a remote decoder."""

_FORWARDED_HEADERS = ("authorization",)
"""Client headers passed on to both legs (an ``--api-key`` of the vLLM servers)."""

DEFAULT_MAX_BODY_BYTES = 8 << 20
"""8 MiB: a 1M-token id prompt as JSON; at --max-concurrency 256, bodies held at once stay under ~8 GiB."""
RETRY_AFTER_S = 1
"""``Retry-After`` of the proxy's own 503 (too many requests in flight)."""


def _seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r}: expected seconds > 0")


def _count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r}: expected an integer > 0")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """What ``lmcache proxy`` was started with.

    ``timeout``: seconds to connect, and seconds without a byte from a decoder, per
    request (a non-streaming decode sends nothing until it is done: it bounds the whole
    generation). ``prefill_timeout``: seconds the whole prefill leg may take before the
    decoder serves the request alone. ``health_interval``: seconds between health
    checks; ``health_timeout``: seconds one health check may take.
    ``max_concurrency``: requests to the serving routes in flight at once (503 beyond);
    ``max_body_bytes``: largest request body (413 beyond). ``sign_ttl``: seconds the
    proxy's signature of a prefiller's parameters stays valid. ``secret``: the shared PD
    secret (:func:`lmcache.pd.signing.load_secret`), keyword only, never shown in a repr.
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    health_interval: float = 5.0
    timeout: float = 600.0
    health_timeout: float = 5.0
    prefill_timeout: float = 30.0
    max_concurrency: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    sign_ttl: float = signing.DEFAULT_TTL_S
    secret: str = field(kw_only=True, repr=False)

    def __post_init__(self) -> None:
        for name in ("health_interval", "timeout", "health_timeout", "prefill_timeout", "sign_ttl"):
            _seconds(name, getattr(self, name))
        if self.sign_ttl > signing.MAX_TTL_S:
            raise ValueError(f"sign_ttl={self.sign_ttl!r}: expected at most {signing.MAX_TTL_S:g} seconds "
                             "(decoders refuse signatures that expire later)")
        _count("max_concurrency", self.max_concurrency)
        _count("max_body_bytes", self.max_body_bytes)
        if not isinstance(self.secret, str):
            raise TypeError(f"secret: expected the PD secret as a str, got {type(self.secret).__name__}")
        object.__setattr__(self, "secret", signing.check_secret(self.secret, "secret"))

    def server_limits(self) -> ServerLimits:
        """The HTTP server's limits: ``max_body_bytes``, and a connection limit above
        ``max_concurrency`` so that ``/health`` and ``/metrics`` stay reachable when the
        proxy refuses requests."""
        headroom = max(32, self.max_concurrency // 4)
        return ServerLimits(max_body_bytes=self.max_body_bytes, limit_concurrency=self.max_concurrency + headroom)


@dataclass(frozen=True, slots=True)
class _Endpoint:
    path: str
    label: str
    chat: bool


COMPLETIONS = _Endpoint("/v1/completions", "completions", chat=False)
CHAT = _Endpoint("/v1/chat/completions", "chat_completions", chat=True)
_ADMITTED = {COMPLETIONS.path: COMPLETIONS.label, CHAT.path: CHAT.label, "/v1/models": "models"}
"""Routes under ``max_concurrency`` (path -> endpoint label); the rest are always served."""


def error_body(status: int, message: str, kind: str = "proxy_error") -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "code": status}}


def _error(status: int, message: str, kind: str = "proxy_error", headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_body(raw: bytes) -> dict[str, Any] | None:
    """The client's body as a JSON object; None for anything else (not JSON, NaN or
    Infinity, nested too deeply, not an object)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return body if isinstance(body, dict) else None


def encode_json(obj: Any) -> bytes:
    """``obj`` as compact JSON, UTF-8 (``\\u`` escapes when it holds lone surrogates).
    ValueError or RecursionError for what JSON cannot carry."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


_LEG_KEYS = ("max_tokens", "max_completion_tokens", "stream", "stream_options", "min_tokens", KEY)
"""Keys of the client's body that the prefill leg sets or drops."""


@dataclass(frozen=True, slots=True)
class LegBodies:
    """The two legs' bodies for one client body, which is encoded once: ``core`` is the
    client's JSON object without :data:`_LEG_KEYS`, ``kept`` the client's values of those
    (``kv_transfer_params`` excepted: a client's own is ignored)."""

    core: bytes
    kept: dict[str, Any]
    chat: bool

    @classmethod
    def of(cls, body: dict[str, Any], chat: bool) -> LegBodies:
        """ValueError or RecursionError for a body that cannot be encoded again."""
        rest = {k: v for k, v in body.items() if k not in _LEG_KEYS}
        kept = {k: body[k] for k in _LEG_KEYS if k in body and k != KEY}
        return cls(encode_json(rest), kept, chat)

    def prefill(self) -> bytes:
        """The client's body with ``max_tokens: 1`` (chat: also ``max_completion_tokens: 1`` if
        the client set it), ``stream: false``, no ``stream_options`` nor ``min_tokens``
        (``min_tokens`` > 1 with ``max_tokens`` 1 is a 400), and :data:`PREFILL_PARAMS`."""
        extra: dict[str, Any] = {"max_tokens": 1, "stream": False, KEY: PREFILL_PARAMS}
        if self.chat and "max_completion_tokens" in self.kept:
            extra["max_completion_tokens"] = 1
        return _join(extra, self.core)

    def decode(self, params: dict[str, Any] | None) -> bytes:
        """The client's body with the (signed) prefiller's ``params`` (none: a plain request)."""
        extra = dict(self.kept)
        if params is not None:
            extra[KEY] = params
        return _join(extra, self.core)


def _join(extra: dict[str, Any], core: bytes) -> bytes:
    """The JSON object ``core`` with the members of ``extra`` (keys not in ``core``) in front."""
    if not extra:
        return core
    head = encode_json(extra)
    return head if core == b"{}" else head[:-1] + b"," + core[1:]


class _Failed(Exception):
    """A request to an instance failed. ``retry``: nothing can have been generated (no
    connection, or an error answer), so another instance may get the request."""

    def __init__(self, status: int, reason: str, response: Response | None = None, retry: bool = False) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.response = response
        self.retry = retry


@dataclass(slots=True)
class _Upstream:
    """An instance's answer, its status and headers read: ``chunks`` is the body of a
    streamed 200 (its first chunk already read, so that a failure before it can still be
    answered with a status); otherwise the body is read by the caller."""

    inst: Instance
    resp: httpx.Response
    chunks: AsyncIterator[bytes] | None = None


class _Admission:
    """ASGI middleware: at most ``proxy.config.max_concurrency`` requests to the serving
    routes (:data:`_ADMITTED`) at once, each counted until its answer is sent in full (a
    stream included); beyond, 503 with ``Retry-After`` before any server is asked."""

    def __init__(self, app: ASGIApp, proxy: Proxy) -> None:
        self.app = app
        self.proxy = proxy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        proxy = self.proxy
        if scope["type"] != "http" or scope.get("path") not in _ADMITTED:
            await self.app(scope, receive, send)
            return
        limit = proxy.config.max_concurrency
        if proxy.in_flight >= limit:
            proxy.metrics.rejected.labels("overloaded").inc()
            proxy.log_once(logging.WARNING, "overloaded", "lmcache proxy: %d requests in flight "
                           "(--max-concurrency); answering 503 to more (logged once; see "
                           "lmcache_proxy_rejected_total)", limit)
            answer = _error(503, f"the proxy is serving {limit} requests, its limit; retry later",
                            "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
            await answer(scope, receive, send)
            return
        proxy.in_flight += 1
        proxy.metrics.in_flight.set(proxy.in_flight)
        counted = True

        def release() -> None:
            nonlocal counted
            if counted:
                counted = False
                proxy.in_flight -= 1
                proxy.metrics.in_flight.set(proxy.in_flight)

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()  # before the last bytes go out: a client that saw its answer end may send the next
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            release()


class Proxy:
    """The router: two :class:`InstancePool`, one ``httpx.AsyncClient``, :class:`ProxyMetrics`.

    :meth:`app` builds the FastAPI app; its lifespan runs :meth:`start` (one health check
    of every instance, then the periodic check) and :meth:`stop`. Serve it behind
    :class:`lmcache.http_server.BodyLimit` with :meth:`ProxyConfig.server_limits` and
    :meth:`error_body` (:func:`lmcache.http_server.serve` does both).
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = InstancePool("prefill", list(config.prefill_urls))
        self.decode = InstancePool("decode", list(config.decode_urls))
        self.metrics = ProxyMetrics()
        self.log_once = LogOnce(logger)
        self.in_flight = 0
        """Requests to the serving routes being answered now (:class:`_Admission`)."""
        self._client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            trust_env=False,
        )
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="lmcache-proxy-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def check_health(self) -> None:
        """One health check of every instance of both roles."""
        client = self._require_client()
        await asyncio.gather(
            self.prefill.check_all(client, self.config.health_timeout),
            self.decode.check_all(client, self.config.health_timeout),
        )

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await self.check_health()

    def _require_client(self) -> httpx.AsyncClient:
        assert self._client is not None, "Proxy.start() has not run"
        return self._client

    # ------------------------------------------------------------------ app
    def app(self) -> FastAPI:
        """The FastAPI app serving ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
        ``/health`` and ``/metrics``, with the ``max_concurrency`` admission."""

        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            await self.start()
            try:
                yield
            finally:
                await self.stop()

        app = FastAPI(title="lmcache proxy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @app.post(COMPLETIONS.path)
        async def completions(request: Request) -> Response:
            return await self.handle_generate(request, COMPLETIONS)

        @app.post(CHAT.path)
        async def chat_completions(request: Request) -> Response:
            return await self.handle_generate(request, CHAT)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            return await self.handle_models(request)

        @app.get("/health")
        async def health() -> Response:
            return self.handle_health()

        @app.get("/metrics")
        async def metrics() -> Response:
            return self.handle_metrics()

        app.add_middleware(_Admission, proxy=self)
        return app

    def error_body(self, status: int, message: str) -> dict[str, Any]:
        """The body of :class:`lmcache.http_server.BodyLimit`'s answers (413, 408), counted."""
        reason = {413: "body_too_large", 408: "body_timeout"}.get(status)
        if reason is not None:
            self.metrics.rejected.labels(reason).inc()
        return error_body(status, message, "invalid_request_error")

    # ------------------------------------------------------------------ handlers
    def handle_health(self) -> Response:
        status = {
            role: {"up": [i.url for i in pool.instances if i.up], "down": pool.down_urls()}
            for role, pool in (("prefill", self.prefill), ("decode", self.decode))
        }
        ok = self.prefill.any_up() and self.decode.any_up()
        return JSONResponse({"status": "ok" if ok else "unavailable", **status}, status_code=200 if ok else 503)

    def handle_metrics(self) -> Response:
        for pool in (self.prefill, self.decode):
            for inst in pool.instances:
                self.metrics.instance_up.labels(pool.role, inst.url).set(1 if inst.up else 0)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def handle_models(self, request: Request) -> Response:
        start = time.perf_counter()
        headers = _forwarded(request)
        outcome = "error"
        try:
            up = await self._with_decoder(lambda inst: self._get(inst, "/v1/models", headers))
            if isinstance(up, _Upstream):
                outcome = "ok" if up.resp.status_code == 200 else "error"
                return _plain(up.resp, up.resp.content)
            outcome = "unavailable" if up.status_code == 503 else "error"
            return up
        finally:
            self._done("models", outcome, start)

    async def handle_generate(self, request: Request, ep: _Endpoint) -> Response:
        start = time.perf_counter()
        body = parse_body(await request.body())
        legs = None
        if body is not None:
            try:
                legs = LegBodies.of(body, ep.chat)
            except (ValueError, RecursionError):
                legs = None
        if body is None or legs is None:
            self._done(ep.label, "bad_request", start)
            return _error(400, "expected a JSON object as the request body", "invalid_request_error")
        # A client that leaves before its answer starts cancels both legs (closing the
        # connections to the servers makes vLLM abort the request); once a stream has
        # started, the StreamingResponse notices the disconnect itself.
        work = asyncio.ensure_future(self._serve(request, ep, legs, bool(body.get("stream")), start))
        del body
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if work in done:
            return work.result()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        self._done(ep.label, "disconnected", start)
        return Response(status_code=499)  # nobody reads it

    async def _serve(self, request: Request, ep: _Endpoint, legs: LegBodies, stream: bool, start: float) -> Response:
        request_id = f"pd-{uuid.uuid4().hex}"
        headers = {**_forwarded(request), "X-Request-Id": request_id, "Content-Type": "application/json"}
        params = await self._prefill(ep, legs, headers)
        dbody = legs.decode(params)
        up = await self._with_decoder(lambda inst: self._post_decode(inst, ep.path, dbody, headers, stream))
        if not isinstance(up, _Upstream):  # no decoder answered
            self._done(ep.label, "unavailable" if up.status_code == 503 else "error", start)
            up.headers["X-Request-Id"] = request_id
            return up
        if up.chunks is not None:
            return self._stream(up, ep, start, request_id)
        self._done(ep.label, "ok" if up.resp.status_code == 200 else "error", start)
        out = _plain(up.resp, strip_json_body(up.resp.content))
        out.headers["X-Request-Id"] = request_id
        return out

    # ------------------------------------------------------------------ prefill leg
    async def _prefill(self, ep: _Endpoint, legs: LegBodies, headers: dict[str, str]) -> dict[str, Any] | None:
        """The prefiller's ``kv_transfer_params`` for the request, signed; None (a counted
        fallback) on any failure. The whole leg takes at most ``prefill_timeout`` seconds."""
        inst = self.prefill.pick()
        if inst is None:
            return self._fallback("no_prefiller", "no prefill instance is up")
        client = self._require_client()
        limit = self.config.prefill_timeout
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(limit):
                resp = await client.post(inst.url + ep.path, content=legs.prefill(), headers=headers,
                                         timeout=httpx.Timeout(limit))
        except (TimeoutError, httpx.TimeoutException) as exc:
            return self._fallback("timeout", "prefill request to %s got no answer within %g s (%s)", inst.url,
                                  limit, type(exc).__name__)
        except httpx.TransportError as exc:
            return self._fallback("connect", "prefill request to %s failed: %s: %s", inst.url, type(exc).__name__, exc)
        finally:
            self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        if resp.status_code != 200:
            return self._fallback(
                "status", "prefiller %s answered %d: %s", inst.url, resp.status_code, resp.text[:200]
            )
        try:
            params = resp.json().get(KEY)
        except (ValueError, RecursionError, AttributeError):
            params = None
        if not isinstance(params, dict):
            return self._fallback(
                "no_params", "prefiller %s answered without a kv_transfer_params dict (is its kv_role kv_producer?)",
                inst.url,
            )
        signed = signing.sign(params, self.config.secret, now=time.time(), ttl=self.config.sign_ttl)
        if signed is None:
            return self._fallback(
                "unsigned", "prefiller %s answered kv_transfer_params without a prompt_digest and remote_num_tokens "
                "to sign (an older lmcache on it?)", inst.url,
            )
        return signed

    def _fallback(self, cause: str, msg: str, *args: object) -> None:
        self.metrics.fallbacks.labels(cause).inc()
        self.log_once(
            logging.WARNING, cause, "lmcache proxy: " + msg + "; the decoder computes the prompt itself "
            "(logged once per cause; see lmcache_proxy_prefill_fallbacks_total)", *args,
        )
        return None

    # ------------------------------------------------------------------ decode leg
    async def _with_decoder(self, send: Callable[[Instance], Awaitable[_Upstream]]) -> _Upstream | Response:
        """``await send(instance)`` on the next decoder, then on one other if the first could
        not have generated anything (:attr:`_Failed.retry`).

        Returns the decoder's answer (status 200 or 4xx) or an error answer for the client:
        the last decoder's 5xx, or the proxy's own 502/503/504. No failure takes a decoder
        out of rotation (its health check does).
        """
        first = self.decode.pick()
        if first is None:
            return _error(503, "no decode instance is up", "service_unavailable")
        try:
            return await send(first)
        except _Failed as exc:
            self._decode_failed(first, exc)
            failure = exc
        second = self.decode.pick(exclude=first) if failure.retry else None
        if second is not None:
            try:
                return await send(second)
            except _Failed as exc:
                self._decode_failed(second, exc)
                failure = exc
        if failure.response is not None:
            return failure.response
        return _error(failure.status, failure.reason)

    def _decode_failed(self, inst: Instance, exc: _Failed) -> None:
        self.log_once(logging.WARNING, f"decode {exc.status}", "lmcache proxy: request to decode instance %s "
                      "failed: %s (%s; logged once per status)", inst.url, exc.reason,
                      "tried on another decoder if one is up" if exc.retry else "not re-run elsewhere")

    async def _post_decode(
        self, inst: Instance, path: str, body: bytes, headers: dict[str, str], stream: bool
    ) -> _Upstream:
        """POST ``body`` to ``inst``, the body read unless it is a streamed 200. Raises
        :class:`_Failed` when it failed before a status the client may get."""
        client = self._require_client()
        resp = await _send(client, client.build_request("POST", inst.url + path, content=body, headers=headers))
        if resp.status_code >= 500:
            content = await _read_closing(resp)
            raise _Failed(resp.status_code, f"answered {resp.status_code}", _plain(resp, content), retry=True)
        if not (stream and resp.status_code == 200):
            await _read(resp)
            return _Upstream(inst, resp)
        it = resp.aiter_bytes()
        try:
            first = await anext(it, b"")
        except httpx.HTTPError as exc:
            await resp.aclose()
            raise _failure(exc, sent=True) from exc
        return _Upstream(inst, resp, _chain(first, it))

    async def _get(self, inst: Instance, path: str, headers: dict[str, str]) -> _Upstream:
        """GET ``path`` of ``inst``, the body read. Raises :class:`_Failed` (a GET may be
        retried whatever failed)."""
        client = self._require_client()
        try:
            resp = await _send(client, client.build_request("GET", inst.url + path, headers=headers))
            if resp.status_code >= 500:
                content = await _read_closing(resp)
                raise _Failed(resp.status_code, f"answered {resp.status_code}", _plain(resp, content))
            await _read(resp)
        except _Failed as exc:
            exc.retry = True
            raise
        return _Upstream(inst, resp)

    def _stream(self, up: _Upstream, ep: _Endpoint, start: float, request_id: str) -> StreamingResponse:
        metrics, resp, chunks = self.metrics, up.resp, up.chunks
        assert chunks is not None
        media_type = resp.headers.get("content-type")
        sse_checked = (media_type or "").startswith("text/event-stream")

        async def body() -> AsyncIterator[bytes]:
            sse = SSEFilter()
            outcome = "stream_error"
            first = True
            try:
                broke: tuple[str, str, int] | None = None
                try:
                    async for chunk in chunks:
                        out = sse.feed(chunk)
                        if out:
                            if first:
                                metrics.ttfb_seconds.observe(time.perf_counter() - start)
                                first = False
                            yield out
                except httpx.TimeoutException as exc:
                    broke = ("timeout", f"the decode instance sent nothing for {self.config.timeout:g} s "
                             f"({type(exc).__name__})", 504)
                except httpx.HTTPError as exc:
                    broke = ("broken", f"the decode instance's stream broke off ({type(exc).__name__})", 502)
                if broke is None and (sse.done or not sse_checked):
                    tail = sse.flush()
                    if tail:
                        yield tail
                    outcome = "ok"
                    return
                if broke is None:
                    broke = ("no_done", "the decode instance ended its stream before data: [DONE]", 502)
                cause, message, code = broke
                self.log_once(logging.WARNING, f"stream {cause}", "lmcache proxy: %s: %s (request %s); the client "
                              "gets a final error event (logged once per cause; see lmcache_proxy_requests_total"
                              "{outcome=\"stream_error\"})", up.inst.url, message, request_id)
                yield sse.error_event(message, code)
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "disconnected"
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    await resp.aclose()  # a client gone before the end: the decoder aborts the request
                self._done(ep.label, outcome, start, ttfb=False)

        headers = {"X-Request-Id": request_id}
        return StreamingResponse(body(), status_code=200, media_type=media_type, headers=headers)

    def _done(self, endpoint: str, outcome: str, start: float, ttfb: bool = True) -> None:
        """Count one finished client request; ``ttfb``: its answer was sent in one piece (TTFB = end-to-end)."""
        elapsed = time.perf_counter() - start
        self.metrics.requests.labels(endpoint, outcome).inc()
        self.metrics.e2e_seconds.observe(elapsed)
        if ttfb:
            self.metrics.ttfb_seconds.observe(elapsed)


# ---------------------------------------------------------------------- helpers
def _forwarded(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}


def _failure(exc: httpx.HTTPError, sent: bool) -> _Failed:
    """``exc`` as a :class:`_Failed`; retried elsewhere only when the request cannot have
    reached the instance (``sent`` False and no connection was made)."""
    retry = not sent and isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
    if isinstance(exc, httpx.TimeoutException):
        return _Failed(504, f"timeout: {type(exc).__name__}", retry=retry)
    return _Failed(502, f"{type(exc).__name__}: {exc}", retry=retry)


def _plain(resp: httpx.Response, content: bytes) -> Response:
    """``content`` with ``resp``'s status and content type."""
    return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))


async def _read(resp: httpx.Response) -> None:
    """Read ``resp``'s whole body (``resp.content``) and close it; :class:`_Failed` if it broke off."""
    try:
        await resp.aread()
    except httpx.HTTPError as exc:
        raise _failure(exc, sent=True) from exc
    finally:
        await resp.aclose()


async def _read_closing(resp: httpx.Response) -> bytes:
    """``resp``'s whole body (b"" if it broke off), the response closed."""
    try:
        return await resp.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await resp.aclose()


async def _disconnected(request: Request) -> None:
    """Return once the client has closed its connection (its body must have been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _send(client: httpx.AsyncClient, request: httpx.Request) -> httpx.Response:
    """``request`` sent, the answer's headers read, its body not (``stream=True``)."""
    try:
        return await client.send(request, stream=True)
    except httpx.TransportError as exc:
        raise _failure(exc, sent=False) from exc


async def _chain(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk
