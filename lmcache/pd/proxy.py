"""The ``lmcache proxy`` HTTP app: each completion request goes to a prefiller, then a decoder.

Legs of one request (both carry the header ``X-Request-Id: <id>``, one fresh id per
client request, also returned to the client):

1. **prefill**: the client's JSON body with ``max_tokens: 1`` (chat: also
   ``max_completion_tokens: 1`` if the client set it), ``stream: false``, no
   ``stream_options`` nor ``min_tokens``, and ``kv_transfer_params:
   {"do_remote_decode": true, "do_remote_prefill": false}``, to the next prefiller that
   is up. Its answer's ``kv_transfer_params`` (a dict) is the result of the leg.
2. **decode**: the client's body (streaming or not, as it asked) with
   ``kv_transfer_params`` set to that dict, to the next decoder that is up. Its answer
   goes back to the client: JSON, or SSE passed on line by line as it arrives, in both
   cases without ``kv_transfer_params``.

Failures:

* prefill leg (no prefiller up, no connection, timeout, non-200, no
  ``kv_transfer_params`` dict): the decoder serves the request alone (no
  ``kv_transfer_params``), counted in ``lmcache_proxy_prefill_fallbacks_total{cause}``
  and logged once per cause;
* decode leg before the first byte went to the client (no connection, timeout, 5xx):
  one other decoder that is up is tried; failing that the client gets the decoder's
  error answer, or 502 (no connection) / 504 (timeout) / 503 (no decoder up) with an
  OpenAI-style ``{"error": {...}}`` body. A 4xx answer (the client's fault) is passed
  on as it is, without a retry;
* an instance whose request failed (no connection, timeout, 5xx) is out of rotation
  until its next good health check (:mod:`lmcache.pd.pool`).

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
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from lmcache.log_once import LogOnce
from lmcache.pd.metrics import ProxyMetrics
from lmcache.pd.pool import Instance, InstancePool
from lmcache.pd.sse import KEY, SSEFilter, strip_json_body

logger = logging.getLogger(__name__)

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""``kv_transfer_params`` of the prefill leg: compute and store the prompt's KV for a remote decoder."""

_FORWARDED_HEADERS = ("authorization",)
"""Client headers passed on to both legs (an ``--api-key`` of the vLLM servers)."""


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """What ``lmcache proxy`` was started with.

    ``timeout``: seconds to connect, and seconds without a byte from an instance, per
    request (a non-streaming decode sends nothing until it is done: it bounds the whole
    generation). ``health_interval``: seconds between health checks;
    ``health_timeout``: seconds one health check may take.
    """

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    health_interval: float = 5.0
    timeout: float = 600.0
    health_timeout: float = 5.0

    def __post_init__(self) -> None:
        for name in ("health_interval", "timeout", "health_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r}: expected seconds > 0")


@dataclass(frozen=True, slots=True)
class _Endpoint:
    path: str
    label: str
    chat: bool


COMPLETIONS = _Endpoint("/v1/completions", "completions", chat=False)
CHAT = _Endpoint("/v1/chat/completions", "chat_completions", chat=True)


def _error(status: int, message: str, kind: str = "proxy_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill leg's body for the client's ``body`` (a new dict; ``body`` is not changed)."""
    out = dict(body)
    out["max_tokens"] = 1
    if chat and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # min_tokens > 1 with max_tokens 1 is a 400
    out[KEY] = dict(PREFILL_PARAMS)
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg's body: the client's, with the prefiller's ``params`` (none: a plain request)."""
    out = dict(body)
    out.pop(KEY, None)
    if params is not None:
        out[KEY] = params
    return out


class _Failed(Exception):
    """A request to an instance failed in a way that takes it out of rotation."""

    def __init__(self, status: int, reason: str, response: Response | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.response = response


@dataclass(slots=True)
class _Upstream:
    """An instance's answer, its status and headers read: ``chunks`` is the body of a
    streamed 200 (its first chunk already read, so that a failure before it can still be
    retried); otherwise the body is read by the caller."""

    inst: Instance
    resp: httpx.Response
    chunks: AsyncIterator[bytes] | None = None


class Proxy:
    """The router: two :class:`InstancePool`, one ``httpx.AsyncClient``, :class:`ProxyMetrics`.

    :meth:`app` builds the FastAPI app; its lifespan runs :meth:`start` (one health check
    of every instance, then the periodic check) and :meth:`stop`.
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = InstancePool("prefill", list(config.prefill_urls))
        self.decode = InstancePool("decode", list(config.decode_urls))
        self.metrics = ProxyMetrics()
        self._log_once = LogOnce(logger)
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
        ``/health`` and ``/metrics``."""

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

        return app

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
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._done(ep.label, "bad_request", start)
            return _error(400, "expected a JSON object as the request body", "invalid_request_error")
        # A client that leaves before its answer starts cancels both legs (closing the
        # connections to the servers makes vLLM abort the request); once a stream has
        # started, the StreamingResponse notices the disconnect itself.
        work = asyncio.ensure_future(self._serve(request, ep, body, start))
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

    async def _serve(self, request: Request, ep: _Endpoint, body: dict[str, Any], start: float) -> Response:
        request_id = f"pd-{uuid.uuid4().hex}"
        headers = {**_forwarded(request), "X-Request-Id": request_id}
        params = await self._prefill(ep, body, headers)
        stream = bool(body.get("stream"))
        dbody = decode_body(body, params)
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
    async def _prefill(self, ep: _Endpoint, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any] | None:
        """The prefiller's ``kv_transfer_params`` for ``body``; None (a counted fallback) on any failure."""
        inst = self.prefill.pick()
        if inst is None:
            return self._fallback("no_prefiller", "no prefill instance is up")
        client = self._require_client()
        t0 = time.perf_counter()
        try:
            resp = await client.post(inst.url + ep.path, json=prefill_body(body, ep.chat), headers=headers)
        except httpx.TimeoutException as exc:
            self.prefill.mark_down(inst, f"timeout: {type(exc).__name__}")
            return self._fallback("timeout", "prefill request to %s timed out (%s)", inst.url, type(exc).__name__)
        except httpx.TransportError as exc:
            self.prefill.mark_down(inst, f"{type(exc).__name__}: {exc}")
            return self._fallback("connect", "prefill request to %s failed: %s: %s", inst.url, type(exc).__name__, exc)
        finally:
            self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        if resp.status_code != 200:
            if resp.status_code >= 500:
                self.prefill.mark_down(inst, f"answered {resp.status_code}")
            return self._fallback(
                "status", "prefiller %s answered %d: %s", inst.url, resp.status_code, resp.text[:200]
            )
        try:
            params = resp.json().get(KEY)
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            return self._fallback(
                "no_params", "prefiller %s answered without a kv_transfer_params dict (is its kv_role kv_producer?)",
                inst.url,
            )
        return params

    def _fallback(self, cause: str, msg: str, *args: object) -> None:
        self.metrics.fallbacks.labels(cause).inc()
        self._log_once(
            logging.WARNING, cause, "lmcache proxy: " + msg + "; the decoder computes the prompt itself "
            "(logged once per cause; see lmcache_proxy_prefill_fallbacks_total)", *args,
        )
        return None

    # ------------------------------------------------------------------ decode leg
    async def _with_decoder(self, send: Callable[[Instance], Awaitable[_Upstream]]) -> _Upstream | Response:
        """``await send(instance)`` on the next decoder, then on one other if that failed.

        Returns the decoder's answer (status 200 or 4xx) or an error answer for the client:
        the last decoder's 5xx, or the proxy's own 502/503/504.
        """
        first = self.decode.pick()
        if first is None:
            return _error(503, "no decode instance is up", "service_unavailable")
        try:
            return await send(first)
        except _Failed as exc:
            self.decode.mark_down(first, exc.reason)
            failure = exc
        second = self.decode.pick(exclude=first)
        if second is not None:
            try:
                return await send(second)
            except _Failed as exc:
                self.decode.mark_down(second, exc.reason)
                failure = exc
        if failure.response is not None:
            return failure.response
        return _error(failure.status, failure.reason)

    async def _post_decode(
        self, inst: Instance, path: str, body: dict[str, Any], headers: dict[str, str], stream: bool
    ) -> _Upstream:
        """POST ``body`` to ``inst``, the body read unless it is a streamed 200. Raises
        :class:`_Failed` on a failure worth a retry."""
        client = self._require_client()
        resp = await _send(client, client.build_request("POST", inst.url + path, json=body, headers=headers))
        if resp.status_code >= 500:
            content = await _read_closing(resp)
            raise _Failed(resp.status_code, f"answered {resp.status_code}", _plain(resp, content))
        if not (stream and resp.status_code == 200):
            await _read(resp)
            return _Upstream(inst, resp)
        it = resp.aiter_bytes()
        try:
            first = await anext(it, b"")
        except httpx.HTTPError as exc:
            await resp.aclose()
            raise _failure(exc) from exc
        return _Upstream(inst, resp, _chain(first, it))

    async def _get(self, inst: Instance, path: str, headers: dict[str, str]) -> _Upstream:
        """GET ``path`` of ``inst``, the body read. Raises :class:`_Failed` on a failure worth a retry."""
        client = self._require_client()
        resp = await _send(client, client.build_request("GET", inst.url + path, headers=headers))
        if resp.status_code >= 500:
            content = await _read_closing(resp)
            raise _Failed(resp.status_code, f"answered {resp.status_code}", _plain(resp, content))
        await _read(resp)
        return _Upstream(inst, resp)

    def _stream(self, up: _Upstream, ep: _Endpoint, start: float, request_id: str) -> StreamingResponse:
        metrics, resp, chunks = self.metrics, up.resp, up.chunks
        assert chunks is not None

        async def body() -> AsyncIterator[bytes]:
            sse = SSEFilter()
            outcome = "stream_error"
            first = True
            try:
                async for chunk in chunks:
                    out = sse.feed(chunk)
                    if out:
                        if first:
                            metrics.ttfb_seconds.observe(time.perf_counter() - start)
                            first = False
                        yield out
                tail = sse.flush()
                if tail:
                    yield tail
                outcome = "ok"
            except httpx.HTTPError as exc:
                self.decode.mark_down(up.inst, f"stream broke off: {type(exc).__name__}")
                self._log_once(
                    logging.WARNING, "stream", "lmcache proxy: a decoder's stream broke off after the first byte "
                    "(%s: %s); the client's answer is cut short (logged once)", type(exc).__name__, exc,
                )
            except (asyncio.CancelledError, GeneratorExit):
                outcome = "disconnected"
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    await resp.aclose()  # a client gone before the end: the decoder aborts the request
                self._done(ep.label, outcome, start, ttfb=False)

        headers = {"X-Request-Id": request_id}
        return StreamingResponse(body(), status_code=200, media_type=resp.headers.get("content-type"), headers=headers)

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


def _failure(exc: httpx.HTTPError) -> _Failed:
    if isinstance(exc, httpx.TimeoutException):
        return _Failed(504, f"timeout: {type(exc).__name__}")
    return _Failed(502, f"{type(exc).__name__}: {exc}")


def _plain(resp: httpx.Response, content: bytes) -> Response:
    """``content`` with ``resp``'s status and content type."""
    return Response(content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))


async def _read(resp: httpx.Response) -> None:
    """Read ``resp``'s whole body (``resp.content``) and close it; :class:`_Failed` if it broke off."""
    try:
        await resp.aread()
    except httpx.HTTPError as exc:
        raise _failure(exc) from exc
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
        raise _failure(exc) from exc


async def _chain(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first:
        yield first
    async for chunk in rest:
        yield chunk
