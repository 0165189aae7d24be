"""``lmcache proxy`` under load: 64 concurrent streams over two decoders, one killed mid-stream.

The proxy runs in this process (uvicorn in a thread, served as ``lmcache proxy`` serves
it); the decoders are :class:`RawDecoder` (bare asyncio servers whose connections can be
reset); the clients are httpx in one asyncio loop. Every client must get either a
complete answer (ending with ``data: [DONE]``) or a final SSE error event, and the
process's RSS must stay bounded over the waves. Everything waits on events, never on time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from lmcache.pd.proxy import Proxy, ProxyConfig
from tests.pd.fakes import DEADLINE, SECRET, Fake, RawDecoder, serve_proxy, stop_all

pytestmark = pytest.mark.slow

N = 64
WAVES_AFTER_THE_KILL = 3
RSS_GROWTH_MB = 100
BODY = {"model": "tiny", "prompt": "soak " * 200, "max_tokens": 8, "stream": True}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def outcome(raw: bytes) -> str:
    """"done" (ends with [DONE]), "error" (ends with an upstream error event), or "bad"."""
    if raw.endswith(b"data: [DONE]\n\n"):
        return "done"
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    if events and raw.endswith(b"\n\n") and events[-1].startswith(b"data: {"):
        err = json.loads(events[-1][len(b"data: "):]).get("error")
        if isinstance(err, dict) and err.get("type") == "upstream_error":
            return "error"
    return "bad"


async def one(client: httpx.AsyncClient, on_first: Callable[[], None]) -> bytes:
    """One streamed request; ``on_first()`` once its first event arrived."""
    raw = b""
    first = True
    async with client.stream("POST", "/v1/completions", json=BODY) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for chunk in resp.aiter_raw():
            raw += chunk
            if first and b"\n\n" in raw:
                first = False
                on_first()
    return raw


async def wave(url: str, between: Callable[[], None] | None = None) -> list[bytes]:
    """``N`` concurrent streams; with ``between``, it is called once all have their first event."""
    limits = httpx.Limits(max_connections=N, max_keepalive_connections=N)
    async with httpx.AsyncClient(base_url=url, timeout=DEADLINE, limits=limits) as client:
        firsts = 0
        all_started = asyncio.Event()

        def on_first() -> None:
            nonlocal firsts
            firsts += 1
            if firsts == N:
                all_started.set()

        tasks = [asyncio.create_task(one(client, on_first)) for _ in range(N)]
        if between is not None:
            await asyncio.wait_for(all_started.wait(), DEADLINE * 3)
            await asyncio.to_thread(between)
        return await asyncio.gather(*tasks)


@pytest.fixture
def cluster() -> Iterator[tuple[Proxy, str, RawDecoder, RawDecoder]]:
    prefiller = Fake("p1").start()
    a, b = RawDecoder("a"), RawDecoder("b")
    proxy, served = serve_proxy(ProxyConfig((prefiller.url,), (a.url, b.url), health_interval=3600.0,
                                            timeout=DEADLINE, secret=SECRET))
    try:
        yield proxy, served.url, a, b
    finally:
        stop_all([served, prefiller.served])  # type: ignore[list-item]
        a.stop()
        b.stop()


def test_64_streams_one_decoder_killed_mid_stream(cluster):
    proxy, url, a, b = cluster
    warm = asyncio.run(wave(url))
    assert [outcome(r) for r in warm] == ["done"] * N and a.streams == b.streams == N // 2
    base = rss_mb()

    a.hold = b.hold = True  # every stream stops after its first event until released
    a_before, b_before = a.streams, b.streams

    def kill_a_release_b() -> None:
        a.kill()  # its 32 streams break off mid-stream (connections reset)
        b.release()

    killed = asyncio.run(wave(url, kill_a_release_b))
    got = [outcome(r) for r in killed]
    on_a, on_b = a.streams - a_before, b.streams - b_before
    assert on_a + on_b == N and on_a > 0 and on_b > 0
    assert got.count("error") == on_a and got.count("done") == on_b and "bad" not in got
    assert proxy.decode.down_urls() == []  # only a failed health check would take it out

    for _ in range(WAVES_AFTER_THE_KILL):  # a is still in rotation: refused connections go to b
        again = asyncio.run(wave(url))
        assert [outcome(r) for r in again] == ["done"] * N
    assert b.streams == b_before + on_b + WAVES_AFTER_THE_KILL * N
    assert proxy.in_flight == 0
    growth = rss_mb() - base
    assert growth < RSS_GROWTH_MB, f"RSS grew by {growth:.0f} MB over {(WAVES_AFTER_THE_KILL + 1) * N} requests"
    text = proxy.metrics.render().decode()
    assert f'lmcache_proxy_requests_total{{endpoint="completions",outcome="stream_error"}} {on_a}.0' in text
