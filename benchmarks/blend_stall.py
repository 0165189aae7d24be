"""``bench_blend.py serving --scenario stall``: what other users feel while a prompt is blended.

A blend runs the model's layers in torch for the prompt (seconds for a few thousand tokens
on a CPU). Without ``enable_async_loading`` it runs in the step, before vLLM's forward,
so every request decoding in that step waits for it; with it, the blend runs on lmcache's
blend thread while the blended request waits and vLLM keeps decoding the others
(docs/async_loading.md).

One vLLM OpenAI server per setting (``--stall-async off|on|both``): the real model,
lmcache with blending at ``--ratios``' first ratio (default 0.2), CPU tier only,
``--max-num-batched-tokens 512``, vLLM's prefix caching off. The 16 RAG documents
(``harness/rag_dataset.py``) are sent alone first (cached as segments). Then
``--stall-pairs`` pairs, each:

* baseline: ``--stall-streamers`` users stream a chat answer of ``--stall-tokens`` tokens
  (``ignore_eos``), nothing else runs;
* loaded: the same, and once every streamer has ``--stall-load-after`` chunks, one RAG
  prompt of ``--stall-docs`` documents in an order no earlier prompt had (token ids,
  ``max_tokens`` 1) is sent: it is blended.

Reported per setting: the streamers' inter-token latency (ITL) p50/p99 in the baseline,
the gaps overlapping the blended prompt's window (sent -> first token): their p99 against
the baseline's p99, and the longest gap per blend (how long the streamers froze); the
blended prompt's TTFT; blends and asynchronous loads counted by lmcache's metrics.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import serving_stall as stall
from harness import rag_dataset as rag
from harness.openai_server import DYNAMIC, OpenAIServer, metric_value


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--stall-async",
        choices=("off", "on", "both"),
        default="both",
        help="stall: enable_async_loading off, on, or a server for each (default both)",
    )
    group.add_argument("--stall-pairs", type=int, default=4, help="stall: baseline / loaded pairs (4)")
    group.add_argument("--stall-streamers", type=int, default=4, help="stall: streaming users (4)")
    group.add_argument("--stall-tokens", type=int, default=160, help="stall: tokens per streamed answer (160)")
    group.add_argument("--stall-load-after", type=int, default=10, help="stall: chunks each streamer has first (10)")
    group.add_argument("--stall-docs", type=int, default=8, help="stall: documents in the blended prompt (8)")  # fmt: skip


@dataclass(slots=True)
class Pair:
    baseline: list[float]
    window: list[float]
    longest: float
    ttft: float
    blends: float
    async_loads: float


@dataclass(slots=True)
class Setting:
    name: str
    pairs: list[Pair] = field(default_factory=list)


def lmcache_yaml(ratio: float, async_loading: bool) -> str:
    lines = ["chunk_size: 256", "local_cpu: true", "max_local_cpu_size: 2", "log_summary_interval: 0",
             "enable_blending: true", f'blend_special_str: "{rag.SEP_TEXT}"', f"blend_recompute_ratios: {ratio}"]  # fmt: skip
    if async_loading:
        lines.append("enable_async_loading: true")
    return "\n".join(lines) + "\n"


def make_server(model_dir: Path, workdir: Path, ratio: float, async_loading: bool) -> OpenAIServer:
    cfg = workdir / "lmcache.yaml"
    cfg.write_text(lmcache_yaml(ratio, async_loading))
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "LMCACHE_CONFIG_FILE": str(cfg), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    extra = ["--max-model-len", str(stall.MAX_MODEL_LEN), "--block-size", "32", "--max-num-batched-tokens", "512",
             "--no-enable-prefix-caching"]  # fmt: skip
    ktc = {**DYNAMIC, "kv_load_failure_policy": "recompute"}
    return OpenAIServer(str(model_dir), ktc, workdir / "server.log", env=env, extra_args=extra)


def counts(server: OpenAIServer) -> tuple[float, float]:
    text = server.metrics()
    return metric_value(text, "lmcache_blend_requests_total"), metric_value(text, "lmcache_async_loads_total")


def blended_prompts(tokenizer: Any, count: int, num_docs: int) -> list[list[int]]:
    """``count`` RAG prompts, each with its own tag and document order (no blend result reused)."""
    out, seen = [], set()
    for i in range(count * 50):
        order = tuple(rag.docs_for(i % len(rag.QUESTIONS), num_docs, seed=1000 + i))
        if order in seen:
            continue
        seen.add(order)
        instruction = f"Stall {len(out) + 1}. {rag.INSTRUCTION}"
        out.append(rag.build_prompt(tokenizer, order, rag.QUESTIONS[i % len(rag.QUESTIONS)], instruction))
        if len(out) == count:
            return out
    raise SystemExit(f"not {count} distinct orders of {num_docs} documents")


def streams(client: Any, model: str, args: argparse.Namespace, ids: list[int] | None) -> tuple[list[Any], Any]:
    """The streamers' traces and, with ``ids``, the send of that prompt once each streamer has
    ``--stall-load-after`` chunks (None without)."""
    progress = stall.Progress(args.stall_load_after, args.stall_streamers)
    send = None
    with ThreadPoolExecutor(args.stall_streamers) as pool:
        futures = [pool.submit(stall.stream_chat, client, model, u, args.stall_tokens, progress)
                   for u in range(args.stall_streamers)]  # fmt: skip
        if ids is not None:
            progress.wait(timeout=600)
            send = stall.send_prompt(client, model, ids, "blend")
        return [f.result() for f in futures], send


def loaded_pair(server: OpenAIServer, client: Any, args: argparse.Namespace, ids: list[int]) -> Pair:
    base = stall.steady_gaps(streams(client, server.model, args, None)[0])
    time.sleep(1.5)
    before = counts(server)
    traces, send = streams(client, server.model, args, ids)
    after = counts(server)
    window = [g for t in traces for g in t.gaps_within(send.sent, send.first)]
    return Pair(base, window, max(window, default=0.0), send.ttft, after[0] - before[0], after[1] - before[1])


def run_setting(name: str, async_loading: bool, model_dir: Path, tokenizer: Any, args: argparse.Namespace,
                ratio: float) -> Setting:  # fmt: skip
    import openai

    workdir = Path(tempfile.mkdtemp(prefix=f"blend-stall-{name}-"))
    server = make_server(model_dir, workdir, ratio, async_loading)
    try:
        server.start(timeout=args.start_timeout)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=1800)
        stall.stream_chat(client, server.model, 0, 4, None)  # first-step costs, not timed
        for d in range(len(rag.DOCS)):  # every document alone: cached as a segment
            stall.send_prompt(client, server.model, rag.doc_ids(tokenizer, d) + rag.sep_ids(tokenizer), "doc")
        result = Setting(name)
        for p, ids in enumerate(blended_prompts(tokenizer, args.stall_pairs, args.stall_docs)):
            time.sleep(1.5)
            pair = loaded_pair(server, client, args, ids)
            result.pairs.append(pair)
            print(f"    [{name}] pair {p + 1}: {len(ids)} tokens, TTFT {pair.ttft:.2f} s, blends {pair.blends:.0f}, "
                  f"async {pair.async_loads:.0f}; ITL p99 base {stall.pct_ms(pair.baseline, 99):.0f} ms, window "
                  f"{stall.pct_ms(pair.window, 99):.0f} ms, longest {pair.longest * 1e3:.0f} ms", flush=True)  # fmt: skip
        return result
    except Exception:
        server.print_log_tail(name)
        raise
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def table(settings: list[Setting]) -> str:
    head = ("| setting | ITL p50 / p99 baseline (ms) | window p99 (ms), / baseline p99 | longest gap per blend, p50 "
            "(range) (ms) | blended prompt TTFT p50 (s) | blends / asynchronous |")  # fmt: skip
    lines = [head, "|---|---|---|---|---|---|"]
    for s in settings:
        base = [g for p in s.pairs for g in p.baseline]
        window = [g for p in s.pairs for g in p.window]
        longest = [p.longest * 1e3 for p in s.pairs]
        b99, w99 = stall.pct_ms(base, 99), stall.pct_ms(window, 99)
        lines.append(
            f"| {s.name} | {stall.pct_ms(base, 50):.0f} / {b99:.0f} | {w99:.0f}, {w99 / b99:.2f} x | "
            f"{statistics.median(longest):.0f} ({min(longest):.0f}-{max(longest):.0f}) | "
            f"{statistics.median(p.ttft for p in s.pairs):.2f} | {sum(p.blends for p in s.pairs):.0f} / "
            f"{sum(p.async_loads for p in s.pairs):.0f} of {len(s.pairs)} |"
        )
    return "\n".join(lines)


def main(model_dir: Path, tokenizer: Any, args: argparse.Namespace, ratio: float) -> int:
    names = {"off": [False], "on": [True], "both": [False, True]}[args.stall_async]
    print(
        f"blend stall: ratio {ratio}, {args.stall_streamers} streamers x {args.stall_tokens} tokens, "
        f"{args.stall_pairs} pairs, blended prompts of {args.stall_docs} documents",
        flush=True,
    )
    settings = [run_setting(f"async {'on' if a else 'off'}", a, model_dir, tokenizer, args, ratio) for a in names]
    print("\n" + table(settings))
    return 0
