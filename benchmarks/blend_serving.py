"""Blending through vLLM's OpenAI server: answer quality and TTFT on a RAG workload (``bench_blend.py serving``).

Workload (``harness/rag_dataset.py``): fictional documents, each pre-cached alone, then
questions whose prompts hold some documents in an order no earlier prompt used (the answer's
document always among them), greedy, streamed, in one of three forms (``--format``):

* ``ids``: token ids built piece by piece (each document's ids as when alone) to ``/v1/completions``;
* ``text``: the same prompt as one text string (the chat template's text around it) to
  ``/v1/completions``: vLLM tokenizes it, the separator's space merging into the next word;
* ``chat``: ``/v1/chat/completions`` with the prompt as the user message (the server renders
  the template), as RAG clients send it.

With ``text`` and ``chat`` the documents are pre-cached as text too (``/v1/completions``).

Servers (one fresh server each, the real model, vLLM's prefix caching off in all):

* ``baseline``: no KV connector; every prompt is a full prefill.
* ``lmcache prefix`` (``--with-prefix``): our connector without blending, the same
  pre-caching: what exact prefix reuse alone gets from these prompts (a prompt whose first
  documents are those of an earlier prompt reuses them);
* ``blend r``: our connector with ``enable_blending`` and ``blend_recompute_ratios: r``
  (CPU tier, chunk 256, check layer 1, ``blend_min_tokens`` 256); before the questions, each
  document's ids are sent alone (``max_tokens`` 1) so that its KV is cached.

Measured per server: accuracy (``judge``), first generated token equal to the baseline's,
ROUGE-L of the answer against the baseline's, TTFT p50 on the quality prompts (``--quality-docs``
documents, ~1.5k tokens) and on the speed prompts (``--speed-docs``, ~3k tokens), the ratio of
the speed TTFT p50 to the baseline's, vLLM's ``cached_tokens`` and lmcache's blending counters
(``lmcache_blend_*`` in ``/metrics``; ``n/a`` when the server does not export them) as the share
of the prompts' document tokens reused and as the share of all prompt tokens. The instruction
is a segment too (reused after the first prompt), and a speed prompt's question was already
asked in a quality prompt, so reused tokens can exceed the document tokens at low ratios.
"First token = full" says little with this model, whose answers nearly always start with
"The"; "answer = full" compares the whole answers.

Scenarios (``--scenario``; the above is ``quality``, the default): the cost of turning blending
on where there is nothing to blend. Two fresh lmcache servers, the same config but
``enable_blending`` (``blend off``: lmcache prefix only; ``blend on``: blending at the first
``--ratios`` value, 0.2 by default), run at the same time and are sent the same prompts in
turn (one request at a time, the order alternating), so that the machine's drift falls on both.
Between two requests the benchmark waits ``--settle`` seconds (1.5): vLLM's worker keeps
spinning on its shared-memory queue for 1 s after a step (``busy_loop_s`` in vLLM's
``shm_broadcast.py``), and a request sent to the other server within that second was up to
~1 s slower (a 0.3 s exact hit took 1.1-1.45 s in 9 of 16 such sends, never otherwise).


* ``cold``: ``--scenario-prompts`` RAG prompts (``--scenario-docs`` documents each, in
  ``--format``) whose documents were never sent before: each document starts with a tag
  (``Record 3-1-0.``) of its own per prompt and per replicate, so no segment and no prefix
  chunk of it is cached (nothing is pre-cached; only the chat template's first 32-token
  block repeats). Each prompt shape is sent ``--replicates`` times (2) with fresh tags.
* ``repeat``: each prompt (fresh documents) is sent once cold, then ``--replicates`` (4)
  more times unchanged: every later send is an exact prefix hit (not a blend) on both
  servers. ``--repeat-docs cached`` instead pre-caches the eight documents alone and uses
  them, in orders no prompt repeats: the first send is then a blend on the blend-on server
  (what a repeated RAG prompt meets there).

Per prompt and server: the median TTFT of the measured sends (``cold``: the replicates;
``repeat``: the sends after the first; the second send alone is reported too), and on / off.
The ratio is the geometric mean of the per-prompt ratios, with a 95% paired bootstrap
interval over the prompts. The noise is the same statistic on the blend-off server alone,
its odd-numbered measured sends over its even-numbered ones, whose interval should hold 1.
Verdict: "within noise" unless the on / off interval lies above 1 ("SLOWER beyond noise").
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import rag_dataset as rag  # noqa: E402
from harness.openai_server import DYNAMIC, OpenAIServer  # noqa: E402
from harness.real_model import RealModelUnavailable, real_model_dir  # noqa: E402

SERVED_NAME = "m"
BLEND_METRICS = {
    "reused": "lmcache_blend_reused_tokens_total",
    "recomputed": "lmcache_blend_recomputed_tokens_total",
    "requests": "lmcache_blend_requests_total",
    "seconds_sum": "lmcache_blend_seconds_sum",
    "seconds_count": "lmcache_blend_seconds_count",
    "stored_segment_tokens": "lmcache_blend_stored_segment_tokens_total",
}
DEFAULT_RATIOS = (0.0, 0.05, 0.15, 0.3, 0.5, 1.0)


# ------------------------------------------------------------------------------ prompts
@dataclass(frozen=True, slots=True)
class Prompt:
    kind: str  # "quality" or "speed"
    question: int  # index in rag.QUESTIONS
    docs: tuple[int, ...]
    ids: tuple[int, ...]
    doc_tokens: int  # tokens of the documents in the prompt (what blending could reuse)
    content: str = ""  # the user message: instruction, documents and question joined by the separator


FORMATS = ("ids", "text", "chat")


def request(p: Prompt, fmt: str, tokenizer: Any) -> tuple[str, dict[str, Any]]:
    """The endpoint and body fields that send prompt ``p`` in format ``fmt``."""
    if fmt == "ids":
        return "/v1/completions", {"prompt": list(p.ids)}
    if fmt == "text":
        before, after = rag.chat_wrapper(tokenizer)
        return "/v1/completions", {"prompt": before + p.content + after}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": p.content}]}


def make_prompts(tokenizer: Any, args: argparse.Namespace) -> list[Prompt]:
    """Quality prompts (one per question), then speed prompts; no two share a document order."""
    seen: set[tuple[int, ...]] = set()
    out: list[Prompt] = []

    def add(kind: str, q: int, num_docs: int) -> None:
        for attempt in range(1000):
            order = tuple(rag.docs_for(q, num_docs, seed=args.seed + 7919 * attempt + (kind == "speed")))
            if order not in seen:
                break
        else:
            raise SystemExit(f"no unused order of {num_docs} documents left for question {q}")
        seen.add(order)
        ids = rag.build_prompt(tokenizer, order, rag.QUESTIONS[q])
        doc_tokens = sum(len(rag.doc_ids(tokenizer, d)) for d in order)
        parts = [rag.INSTRUCTION, *(rag.DOCS[d] for d in order), f"Question: {rag.QUESTIONS[q].text}"]
        out.append(Prompt(kind, q, order, tuple(ids), doc_tokens, rag.SEP_TEXT.join(parts)))

    for q in range(min(args.questions, len(rag.QUESTIONS))):
        add("quality", q, args.quality_docs)
    for s in range(args.speed_prompts):
        add("speed", (5 * s + 3) % len(rag.QUESTIONS), args.speed_docs)
    return out


SCENARIOS = ("quality", "cold", "repeat")


def tagged_prompt(tokenizer: Any, kind: str, q: int, order: tuple[int, ...], tag: str | None) -> Prompt:
    """The prompt of question ``q`` over documents ``order``; with ``tag``, each document starts
    with ``Record {tag}-{k}.`` (a document never sent before: no chunk of it is cached)."""
    texts = [rag.DOCS[d] if tag is None else f"Record {tag}-{k}. {rag.DOCS[d]}" for k, d in enumerate(order)]
    question = rag.QUESTIONS[q]
    before, after = rag.chat_wrapper(tokenizer)
    sep = rag.sep_ids(tokenizer)
    ids = rag.doc_ids(tokenizer, before + rag.INSTRUCTION)  # as rag.build_prompt: every part alone
    for text in texts:
        ids += sep + rag.doc_ids(tokenizer, text)
    ids += sep + rag.doc_ids(tokenizer, f"Question: {question.text}{after}")
    doc_tokens = sum(len(rag.doc_ids(tokenizer, t)) for t in texts)
    content = rag.SEP_TEXT.join([rag.INSTRUCTION, *texts, f"Question: {question.text}"])
    return Prompt(kind, q, order, tuple(ids), doc_tokens, content)


def scenario_prompts(tokenizer: Any, args: argparse.Namespace) -> list[list[Prompt]]:
    """Per prompt shape, the prompts sent in turn to both servers: ``cold``, one per replicate
    (fresh tags); ``repeat``, the same prompt 1 + ``--replicates`` times."""
    groups: list[list[Prompt]] = []
    seen: set[tuple[int, ...]] = set()
    for i in range(args.scenario_prompts):
        q = (5 * i + 3) % len(rag.QUESTIONS)
        for attempt in range(1000):
            order = tuple(rag.docs_for(q, args.scenario_docs, seed=args.seed + 7919 * attempt + 1))
            if order not in seen:
                break
        seen.add(order)
        if args.scenario == "cold":
            groups.append([tagged_prompt(tokenizer, "cold", q, order, f"{i}-{r}") for r in range(args.replicates)])
        else:
            p = tagged_prompt(tokenizer, "repeat", q, order, None if args.repeat_docs == "cached" else f"{i}")
            groups.append([p] * (1 + args.replicates))
    return groups


# ------------------------------------------------------------------------------ requests
@dataclass
class Answer:
    kind: str
    question: int
    docs: list[int]
    prompt_tokens: int
    ttft: float
    text: str
    token_ids: list[int]
    cached_tokens: int | None


def complete(url: str, ids: list[int] | tuple[int, ...], max_tokens: int) -> Answer:
    """A streamed greedy completion of token ids (see :func:`send`)."""
    return send(url, "/v1/completions", {"prompt": list(ids)}, max_tokens)


def send(url: str, path: str, fields: dict[str, Any], max_tokens: int) -> Answer:
    """A streamed greedy completion (``fields``: the prompt or messages): TTFT (first chunk
    carrying a generated token or text), text, usage."""
    body = {
        "model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, **fields,
    }  # fmt: skip
    if path == "/v1/completions":
        body["return_token_ids"] = True
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                new = choice.get("token_ids") or []
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if (new or piece) and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens += new
                text.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Answer("", -1, [], int(usage.get("prompt_tokens", 0)),
                  ttft if ttft is not None else time.perf_counter() - t0, "".join(text), tokens,
                  None if cached is None else int(cached))  # fmt: skip


def metric_or_none(text: str, name: str) -> float | None:
    """Sum of the samples named ``name`` in a Prometheus text page, or None when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    return sum(values) if values else None


def blend_counters(server: OpenAIServer) -> dict[str, float | None]:
    text = server.metrics()
    out = {key: metric_or_none(text, name) for key, name in BLEND_METRICS.items()}
    out["hit_tokens"] = metric_or_none(text, "lmcache_hit_tokens_total")
    return out


def delta(after: dict[str, float | None], before: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (None if v is None else v - (before.get(k) or 0.0)) for k, v in after.items()}


# ------------------------------------------------------------------------------ servers
@dataclass(frozen=True, slots=True)
class ServerConfig:
    name: str
    lmcache: bool
    ratio: float | None = None  # None: no blending

    @staticmethod
    def blend(ratio: float) -> ServerConfig:
        return ServerConfig(f"blend r={ratio:g}", True, ratio)


BASELINE = ServerConfig("baseline", False)
PREFIX = ServerConfig("lmcache prefix", True)


@dataclass
class ServerRun:
    name: str
    config: ServerConfig
    start_s: float = 0.0
    precache_s: float = 0.0
    answers: list[Answer] = field(default_factory=list)
    counters: dict[str, dict[str, float | None]] = field(default_factory=dict)  # per phase: quality, speed


def lmcache_yaml(ratio: float | None, args: argparse.Namespace) -> str:
    text = (
        f"chunk_size: {args.chunk_size}\nlocal_cpu: true\nmax_local_cpu_size: {args.cpu_gib}\nlog_summary_interval: 0\n"
    )
    if ratio is None:
        return text
    return text + (
        f'enable_blending: true\nblend_special_str: "{rag.SEP_TEXT}"\nblend_recompute_ratios: {ratio}\n'
        f"blend_check_layers: {args.check_layers}\nblend_min_tokens: {args.blend_min_tokens}\n"
    )


def make_server(model_dir: Path, config: ServerConfig, workdir: Path, max_len: int,
                args: argparse.Namespace) -> OpenAIServer:  # fmt: skip
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # the same CPU layout with and without a connector
    block = 32
    extra = ["--max-model-len", str(math.ceil(max_len / block) * block), "--block-size", str(block),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens or max_len),
             "--no-enable-prefix-caching", "--served-model-name", SERVED_NAME]  # fmt: skip
    name = config.name.replace(" ", "-").replace("=", "")
    if not config.lmcache:
        return OpenAIServer(str(model_dir), None, workdir / f"{name}.log", env=env, extra_args=extra)
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(lmcache_yaml(config.ratio, args))
    env["LMCACHE_CONFIG_FILE"] = str(cfg)
    ktc = {**DYNAMIC, "kv_load_failure_policy": "recompute"}
    return OpenAIServer(str(model_dir), ktc, workdir / f"{name}.log", env=env, extra_args=extra)


def run_server(model_dir: Path, config: ServerConfig, prompts: list[Prompt], tokenizer: Any, workdir: Path,
               args: argparse.Namespace) -> ServerRun:  # fmt: skip
    max_len = max(len(p.ids) for p in prompts) + args.max_tokens + 64
    server = make_server(model_dir, config, workdir, max_len, args)
    run = ServerRun(config.name, config)
    t0 = time.perf_counter()
    try:
        server.start(timeout=args.start_timeout)
        run.start_s = time.perf_counter() - t0
        print(f"  [{run.name}] server up in {run.start_s:.0f} s", flush=True)
        complete(server.url, rag.doc_ids(tokenizer, "Warm-up."), 2)  # first-step costs, not measured
        if config.lmcache:
            t1 = time.perf_counter()
            for d in range(len(rag.DOCS)):
                if args.format == "ids":  # the document's ids, ended by the separator's
                    complete(server.url, rag.doc_ids(tokenizer, d) + rag.sep_ids(tokenizer), 1)
                else:  # as a user caches a document: its text, alone, ended by the separator
                    send(server.url, "/v1/completions", {"prompt": rag.DOCS[d] + rag.SEP_TEXT}, 1)
            run.precache_s = time.perf_counter() - t1
            print(f"  [{run.name}] {len(rag.DOCS)} documents pre-cached in {run.precache_s:.1f} s", flush=True)
        before = blend_counters(server) if config.lmcache else {}
        for kind in ("quality", "speed"):
            for p in (p for p in prompts if p.kind == kind):
                path, fields = request(p, args.format, tokenizer)
                ans = send(server.url, path, fields, args.max_tokens)
                ans.kind, ans.question, ans.docs = p.kind, p.question, list(p.docs)
                run.answers.append(ans)
                ok = rag.judge(ans.text, rag.QUESTIONS[p.question])
                print(f"    {kind} q{p.question:<2} docs {p.docs} {ans.prompt_tokens} tok  TTFT {ans.ttft:6.2f} s  "
                      f"{'ok ' if ok else 'BAD'} {ans.text.strip()[:70]!r}", flush=True)  # fmt: skip
            if config.lmcache:
                time.sleep(1.0)  # counters ride on the worker's step outputs
                after = blend_counters(server)
                run.counters[kind] = delta(after, before)
                before = after
    except Exception:
        print(f"  [{run.name}] failed; server log tail:\n{server.log()[-6000:]}", flush=True)
        raise
    finally:
        server.stop()
    return run


BLEND_OFF = ServerConfig("blend off", True)


@dataclass
class PairedRun:
    """A ``cold`` or ``repeat`` scenario: the answers of both servers, ``answers[name][i][k]``
    for prompt shape ``i``, send ``k``."""

    configs: list[ServerConfig]
    groups: list[list[Prompt]]
    answers: dict[str, list[list[Answer]]] = field(default_factory=dict)
    counters: dict[str, dict[str, float | None]] = field(default_factory=dict)
    start_s: float = 0.0


def precache(server: OpenAIServer, tokenizer: Any, args: argparse.Namespace) -> None:
    """Each document alone, ended by the separator (as ``run_server`` does)."""
    for d in range(len(rag.DOCS)):
        if args.format == "ids":
            complete(server.url, rag.doc_ids(tokenizer, d) + rag.sep_ids(tokenizer), 1)
        else:
            send(server.url, "/v1/completions", {"prompt": rag.DOCS[d] + rag.SEP_TEXT}, 1)


def run_paired(model_dir: Path, configs: list[ServerConfig], groups: list[list[Prompt]], tokenizer: Any,
               workdir: Path, args: argparse.Namespace) -> PairedRun:  # fmt: skip
    """Both servers up at once; every prompt sent to one, then the other (one request at a time,
    which server goes first alternating), so that a change in the machine's load falls on both."""
    warm = tagged_prompt(tokenizer, "warm-up", 0, groups[0][0].docs, "warm")
    max_len = max(len(p.ids) for g in groups for p in g + [warm]) + args.max_tokens + 64
    servers = [make_server(model_dir, c, workdir, max_len, args) for c in configs]
    run = PairedRun(configs, groups, {c.name: [[] for _ in groups] for c in configs})
    t0 = time.perf_counter()
    try:
        for server in servers:
            server.launch()
        for server in servers:
            server.wait_ready(args.start_timeout)
        run.start_s = time.perf_counter() - t0
        print(f"  servers up in {run.start_s:.0f} s: {', '.join(c.name for c in configs)}", flush=True)
        before = {}
        for c, server in zip(configs, servers):
            complete(server.url, rag.doc_ids(tokenizer, "Warm-up."), 2)  # first-step costs, not measured
            path, fields = request(warm, args.format, tokenizer)  # a cold prompt of the same size, not measured
            send(server.url, path, fields, args.max_tokens)
            if args.scenario == "repeat" and args.repeat_docs == "cached":
                precache(server, tokenizer, args)
            time.sleep(max(1.0, args.settle))  # counters ride on the worker's step outputs
            before[c.name] = blend_counters(server)
        for i, group in enumerate(groups):
            for k, p in enumerate(group):
                order = list(zip(configs, servers))
                if (i + k) % 2:
                    order.reverse()
                for c, server in order:
                    path, fields = request(p, args.format, tokenizer)
                    ans = send(server.url, path, fields, args.max_tokens)
                    ans.kind, ans.question, ans.docs = p.kind, p.question, list(p.docs)
                    run.answers[c.name][i].append(ans)
                    time.sleep(args.settle)  # the other server's worker stops spinning (see the docstring)
                    print(f"    {p.kind} {i}.{k} q{p.question:<2} {ans.prompt_tokens} tok  [{c.name:>9}] "
                          f"TTFT {ans.ttft:6.3f} s  cached {fmt(ans.cached_tokens, 'd')}", flush=True)  # fmt: skip
        time.sleep(1.0)
        for c, server in zip(configs, servers):
            run.counters[c.name] = delta(blend_counters(server), before[c.name])
    except Exception:
        for server in servers:
            print(f"  server log tail ({server.log_path.name}):\n{server.log()[-4000:]}", flush=True)
        raise
    finally:
        for server in servers:
            server.stop()
    return run


# ------------------------------------------------------------------------------ report
def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Row:
    name: str
    accuracy: float
    first_token_same: float | None
    same_answer: float | None  # the whole answer equal to the baseline's
    rouge_l: float | None
    ttft_quality_p50: float
    ttft_speed_p50: float
    speed_vs_full: float | None
    cached_share: float | None  # vLLM's cached_tokens / prompt tokens
    reused_share: float | None  # lmcache_blend_reused_tokens / document tokens
    reused_prompt_share: float | None  # lmcache_blend_reused_tokens / prompt tokens
    recomputed_tokens: float | None
    blend_requests: float | None
    blend_ms: float | None  # mean lmcache_blend_seconds per observation


def first_token(answer: Answer) -> list[int] | list[str]:
    """The first generated token's id (its first word where the server returned no ids)."""
    return answer.token_ids[:1] or answer.text.split()[:1]


def summarize(run: ServerRun, base: ServerRun | None, prompts: list[Prompt]) -> Row:
    quality = [a for a in run.answers if a.kind == "quality"]
    speed = [a for a in run.answers if a.kind == "speed"]
    acc = sum(rag.judge(a.text, rag.QUESTIONS[a.question]) for a in quality) / max(1, len(quality))
    same = exact = rouge = ratio = None
    if base is not None and base is not run:
        pairs = list(zip(quality, (a for a in base.answers if a.kind == "quality")))
        same = sum(first_token(a) == first_token(b) for a, b in pairs) / max(1, len(pairs))
        exact = sum(a.text == b.text for a, b in pairs) / max(1, len(pairs))
        rouge = statistics.fmean(rag.rouge_l(a.text, b.text) for a, b in pairs) if pairs else None
        base_speed = p50([a.ttft for a in base.answers if a.kind == "speed"])
        ratio = p50([a.ttft for a in speed]) / base_speed if speed and base_speed > 0 else None
    cached = [a.cached_tokens for a in run.answers if a.cached_tokens is not None]
    cached_share = sum(cached) / sum(a.prompt_tokens for a in run.answers) if cached else None
    totals: dict[str, float | None] = {}
    for phase in run.counters.values():
        for k, v in phase.items():
            totals[k] = None if v is None else (totals.get(k) or 0.0) + v
    doc_tokens = sum(p.doc_tokens for p in prompts)
    reused = totals.get("reused")
    count, secs = totals.get("seconds_count"), totals.get("seconds_sum")
    prompt_tokens = sum(len(p.ids) for p in prompts)
    return Row(
        run.name, acc, same, exact, rouge, p50([a.ttft for a in quality]), p50([a.ttft for a in speed]), ratio,
        cached_share, None if reused is None else reused / max(1, doc_tokens),
        None if reused is None else reused / max(1, prompt_tokens), totals.get("recomputed"),
        totals.get("requests"), secs / count * 1e3 if count and secs is not None else None,
    )  # fmt: skip


def fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(rows: list[Row]) -> str:
    head = ("| server | accuracy | first token = full | answer = full | ROUGE-L vs full | TTFT p50 quality (s) "
            "| TTFT p50 speed (s) | speed TTFT / full | vLLM cached | blend reused / doc tokens "
            "| blend reused / prompt tokens | recomputed tokens | blend requests | blend ms |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.accuracy:.0%} | {fmt(r.first_token_same, '.0%')} | {fmt(r.same_answer, '.0%')} | "
            f"{fmt(r.rouge_l, '.3f')} | "
            f"{r.ttft_quality_p50:.3f} | {fmt(r.ttft_speed_p50, '.3f')} | {fmt(r.speed_vs_full, '.3f')} | "
            f"{fmt(r.cached_share, '.1%')} | {fmt(r.reused_share, '.1%')} | {fmt(r.reused_prompt_share, '.1%')} | "
            f"{fmt(r.recomputed_tokens, '.0f')} | "
            f"{fmt(r.blend_requests, '.0f')} | {fmt(r.blend_ms, '.1f')} |"
        )
    return "\n".join(lines)


def geo_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def bootstrap_ci(ratios: list[float], reps: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the geometric mean of ``ratios`` (paired: one ratio per prompt),
    resampling the prompts."""
    if len(ratios) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    logs = [math.log(r) for r in ratios]
    means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(reps))
    return math.exp(means[int(0.025 * reps)]), math.exp(means[int(0.975 * reps) - 1])


@dataclass
class PairedSummary:
    scenario: str
    prompts: int
    ratio: float  # geometric mean of the per-prompt on / off
    ci: tuple[float, float]
    noise: float  # the same statistic, off vs off
    noise_ci: tuple[float, float]
    noise_max: float  # largest |off / off - 1| of one prompt
    off_p50: float
    on_p50: float
    first_ratio: float | None  # repeat: the first (cold) sends' on / off
    second_ratio: tuple[float, float, float] | None  # repeat: the second sends' on / off, its 95% interval
    blended: dict[str, float | None]  # lmcache_blend_requests per server
    hit_tokens: dict[str, float | None]
    verdict: str


def summarize_paired(run: PairedRun, scenario: str) -> tuple[list[str], PairedSummary]:
    """The per-prompt table and the summary. Per prompt and server, the median TTFT of the
    measured sends (``cold``: every replicate; ``repeat``: every send after the first, all
    exact hits); the noise is the blend-off server's median of the odd-numbered measured sends
    over that of the even-numbered ones (``cold`` with 2 replicates: replicate 1 / replicate 0;
    ``repeat`` with 2: third send / second)."""
    off, on = (c.name for c in run.configs)
    lines = []
    ratios: list[float] = []
    nulls: list[float] = []
    firsts: list[float] = []
    seconds: list[float] = []
    offs: list[float] = []
    ons: list[float] = []
    if scenario == "cold":
        head = ("| prompt | tokens | TTFT off (s), each replicate | TTFT on (s), each replicate | on / off "
                "| off / off (odd / even replicates) |")  # fmt: skip
    else:
        head = ("| prompt | tokens | first send off / on (s) | TTFT off (s), sends 2.. | TTFT on (s), sends 2.. "
                "| on / off (median of sends 2..) | on / off (2nd send) | off / off (odd / even sends) "
                "| cached tokens off / on (2nd) |")  # fmt: skip
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for i, group in enumerate(run.groups):
        a_off, a_on = run.answers[off][i], run.answers[on][i]
        if len(a_off) != len(group) or len(a_on) != len(group):
            continue
        skip = 0 if scenario == "cold" else 1
        t_off, t_on = [a.ttft for a in a_off[skip:]], [a.ttft for a in a_on[skip:]]
        if not t_off:
            continue
        m_off, m_on = statistics.median(t_off), statistics.median(t_on)
        null = statistics.median(t_off[1::2]) / statistics.median(t_off[0::2]) if len(t_off) > 1 else None
        each_off, each_on = (" ".join(f"{t:.3f}" for t in ts) for ts in (t_off, t_on))
        if scenario == "cold":
            lines.append(f"| {i} | {a_off[0].prompt_tokens} | {each_off} | {each_on} | {m_on / m_off:.3f} | "
                         f"{fmt(null, '.3f')} |")  # fmt: skip
        else:
            firsts.append(a_on[0].ttft / a_off[0].ttft)
            seconds.append(t_on[0] / t_off[0])
            lines.append(
                f"| {i} | {a_off[0].prompt_tokens} | {a_off[0].ttft:.3f} / {a_on[0].ttft:.3f} | {each_off} | "
                f"{each_on} | {m_on / m_off:.3f} | {seconds[-1]:.3f} | {fmt(null, '.3f')} | "
                f"{fmt(a_off[1].cached_tokens, 'd')} / {fmt(a_on[1].cached_tokens, 'd')} |"
            )
        ratios.append(m_on / m_off)
        offs.append(m_off)
        ons.append(m_on)
        if null is not None:
            nulls.append(null)
    ratio = geo_mean(ratios) if ratios else float("nan")
    ci = bootstrap_ci(ratios)
    noise = geo_mean(nulls) if nulls else float("nan")
    noise_ci = bootstrap_ci(nulls)
    noise_max = max((abs(x - 1) for x in nulls), default=float("nan"))
    if not ratios:
        verdict = "no measurement"
    elif not ci[0] > 1.0:
        verdict = "within noise" if ci[1] >= 1.0 else "faster beyond noise"
    else:
        verdict = "SLOWER beyond noise"
    summary = PairedSummary(
        scenario, len(ratios), ratio, ci, noise, noise_ci, noise_max, p50(offs), p50(ons),
        geo_mean(firsts) if firsts else None,
        (geo_mean(seconds), *bootstrap_ci(seconds)) if seconds else None,
        {n: c.get("requests") for n, c in run.counters.items()},
        {n: c.get("hit_tokens") for n, c in run.counters.items()}, verdict,
    )  # fmt: skip
    return lines, summary


def verdict_line(s: PairedSummary) -> str:
    what = "TTFT" if s.scenario == "cold" else "repeat-send TTFT"
    return (f"{s.scenario}: {what} blend on / off = {s.ratio:.3f} x (95% CI {s.ci[0]:.3f}-{s.ci[1]:.3f}, "
            f"{s.prompts} prompts; p50 {s.on_p50:.3f} s on, {s.off_p50:.3f} s off); noise, off / off = "
            f"{s.noise:.3f} x (95% CI {s.noise_ci[0]:.3f}-{s.noise_ci[1]:.3f}, largest {s.noise_max:.1%}): "
            f"{s.verdict}")  # fmt: skip


def main_paired(model_dir: Path, tokenizer: Any, args: argparse.Namespace) -> int:
    """The ``cold`` and ``repeat`` scenarios (see the module's docstring)."""
    ratio = 0.2 if args.ratios is None else float(args.ratios[0])
    if args.replicates is None:
        args.replicates = 2 if args.scenario == "cold" else 4
    configs = [BLEND_OFF, ServerConfig("blend on", True, ratio)]
    groups = scenario_prompts(tokenizer, args)
    lens = [len(g[0].ids) for g in groups]
    cached = args.scenario == "repeat" and args.repeat_docs == "cached"
    docs = "the 8 pre-cached documents" if cached else "fresh documents"
    print(f"scenario {args.scenario}: {len(groups)} prompts x {len(groups[0])} sends ({args.scenario_docs} "
          f"{docs}, {min(lens)}-{max(lens)} tokens, format {args.format}); blend on at ratio {ratio:g}",
          flush=True)  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-bench-blend-"))
    t_all = time.perf_counter()
    try:
        run = run_paired(model_dir, configs, groups, tokenizer, workdir, args)
    finally:
        if args.keep_workdir:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    lines, summary = summarize_paired(run, args.scenario)
    counters = "; ".join(f"{n}: {fmt(c.get('requests'), '.0f')} blended prompts, "
                         f"{fmt(c.get('hit_tokens'), '.0f')} lmcache hit tokens, "
                         f"{fmt(c.get('stored_segment_tokens'), '.0f')} segment tokens stored"
                         for n, c in run.counters.items())  # fmt: skip
    first = ""
    if summary.first_ratio is not None and summary.second_ratio is not None:
        r2, lo, hi = summary.second_ratio
        first = (f"\nrepeat: first (cold) sends on / off {summary.first_ratio:.3f} x; second sends alone on / off "
                 f"{r2:.3f} x (95% CI {lo:.3f}-{hi:.3f})")  # fmt: skip
    print("\n" + "\n".join(lines) + f"\n\n{counters}{first}\n{verdict_line(summary)}")
    print(f"total {time.perf_counter() - t_all:.0f} s")
    if args.json is not None:
        payload = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "prompts": [[asdict(p) | {"ids": None, "tokens": len(p.ids)} for p in g[:1]] for g in groups],
            "answers": {n: [[asdict(a) for a in sends] for sends in per] for n, per in run.answers.items()},
            "counters": run.counters,
            "summary": asdict(summary),
        }
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"results written to {args.json}")
    return 0 if summary.prompts == len(groups) else 1


# ------------------------------------------------------------------------------ main
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--questions", type=int, default=len(rag.QUESTIONS), help="quality prompts (first N questions)")
    ap.add_argument("--quality-docs", type=int, default=4, help="documents per quality prompt (~1.5k tokens)")
    ap.add_argument("--speed-prompts", type=int, default=3, help="speed prompts (0: none)")
    ap.add_argument("--speed-docs", type=int, default=8, help="documents per speed prompt (~3k tokens)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--format", choices=FORMATS, default="ids",
                    help="how prompts are sent: token ids, one text string, or the chat API (see above)")
    ap.add_argument("--seed", type=int, default=0, help="document orders")
    ap.add_argument("--no-baseline", action="store_true", help="no full-prefill server (no comparison columns)")
    ap.add_argument("--with-prefix", action="store_true", help="also lmcache without blending (prefix reuse only)")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--cpu-gib", type=float, default=2.0, help="max_local_cpu_size")
    ap.add_argument("--check-layers", type=int, default=1, help="blend_check_layers")
    ap.add_argument("--blend-min-tokens", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: the longest prompt (one prefill step)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--keep-workdir", action="store_true", help="keep the server logs and configs")
    ap.add_argument("--json", type=Path, help="write the answers, timings and the table here")
    ap.add_argument("--scenario", choices=SCENARIOS, default="quality",
                    help="quality: the ratios' accuracy and TTFT (above); cold: never-seen documents, blend on vs off; "
                         "repeat: the same prompt sent again, blend on vs off")
    ap.add_argument("--scenario-prompts", type=int, default=8, help="cold/repeat: prompt shapes")
    ap.add_argument("--scenario-docs", type=int, default=4, help="cold/repeat: documents per prompt (~1.5k tokens)")
    ap.add_argument("--replicates", type=int, default=None,
                    help="cold: sends of each prompt shape, fresh tags (default 2); repeat: sends after the first "
                         "(default 4)")
    ap.add_argument("--settle", type=float, default=1.5,
                    help="cold/repeat: seconds between requests (vLLM's worker spins 1 s after a step)")
    ap.add_argument("--repeat-docs", choices=("fresh", "cached"), default="fresh",
                    help="repeat: documents never sent before, or the 8 documents pre-cached alone")


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    ratios = DEFAULT_RATIOS if args.ratios is None else tuple(args.ratios)
    try:
        model_dir = real_model_dir()
    except RealModelUnavailable as exc:
        print(f"cannot run: {exc}")
        return 1
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if args.scenario != "quality":
        return main_paired(model_dir, tokenizer, args)
    prompts = make_prompts(tokenizer, args)
    q_len = [len(p.ids) for p in prompts if p.kind == "quality"]
    s_len = [len(p.ids) for p in prompts if p.kind == "speed"]
    print(f"{len(q_len)} quality prompts ({args.quality_docs} documents, {min(q_len, default=0)}-"
          f"{max(q_len, default=0)} tokens), {len(s_len)} speed prompts ({args.speed_docs} documents, "
          f"{min(s_len, default=0)}-{max(s_len, default=0)} tokens); ratios {list(ratios)}", flush=True)  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-bench-blend-"))
    runs: list[ServerRun] = []
    t_all = time.perf_counter()
    try:
        configs = [BASELINE] * (not args.no_baseline) + [PREFIX] * args.with_prefix
        configs += [ServerConfig.blend(r) for r in ratios]
        for config in configs:
            try:
                runs.append(run_server(model_dir, config, prompts, tokenizer, workdir, args))
            except Exception as exc:  # one broken server must not lose the others' numbers
                print(f"  [{config.name}] FAILED: {exc!r}", flush=True)
    finally:
        if args.keep_workdir:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if not runs:
        return 1
    base = runs[0] if runs[0].config == BASELINE else None
    rows = [summarize(r, base, prompts) for r in runs]
    print(f"\n{table(rows)}\n\ntotal {time.perf_counter() - t_all:.0f} s")
    if args.json is not None:
        payload = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "prompts": [asdict(p) | {"ids": None, "tokens": len(p.ids)} for p in prompts],
            "runs": [asdict(r) for r in runs],
            "table": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"results written to {args.json}")
    return 0 if len(runs) == len(configs) else 1
