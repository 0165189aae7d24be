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
"""

from __future__ import annotations

import argparse
import json
import math
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


def main(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    ratios = DEFAULT_RATIOS if args.ratios is None else tuple(args.ratios)
    try:
        model_dir = real_model_dir()
    except RealModelUnavailable as exc:
        print(f"cannot run: {exc}")
        return 1
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
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
