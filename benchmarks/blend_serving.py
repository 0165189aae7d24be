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

Servers (one fresh server each, the real model, vLLM's prefix caching off in all but the
scoring baseline's, below; ``--parallel N`` runs N at once, each vLLM worker bound to a CPU of
its own: for quality runs, the TTFTs then share the machine):

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
of the prompts' document tokens reused and as the share of all prompt tokens. Each prompt's
instruction starts with a tag of its own (``Request 7.``), so that no two prompts share a KV
chunk (:func:`make_prompts`); a speed prompt's question was already asked in a quality prompt,
so reused tokens can exceed the document tokens at low ratios.
"First token = full" says little with this model, whose answers nearly always start with
"The"; "answer = full" compares the whole answers.

Teacher-forced score (on unless ``--no-score``): each quality prompt is first sent with its
answer forced to the gold answer (``rag.gold_answer``: the question restated, then the fact),
and the server returns each forced token's log-probability, computed over the prompt's KV
(blended, or a full prefill) exactly as a generated token would be. The score is the sum over
the fact's tokens, log P(fact | prompt, restatement): a continuous, low-noise measure of what
the KV approximation costs, paired per question with the baseline's. The forcing is a vLLM logits processor (:func:`forced_answer_class`, loaded with
``--logits-processors``); vLLM reports logprobs of the raw logits, before any processor.
vLLM's prompt logprobs (``echo`` with ``logprobs``) cannot be used for this: vLLM 0.32 makes
every request with prompt logprobs skip cached KV (``skip_reading_prefix_cache``), so lmcache's
offer is dropped and such a request is a full prefill on every server (measured: no blend, 0
cached tokens). The answer request follows: on a blending server it loads the forced send's
blend result (every full KV block of the prompt; vLLM computes the last partial block, at most
31 tokens, mostly the question, over it), and on the baseline it reuses the forced send's KV
through vLLM's prefix caching (on there, each prompt's two requests under a ``cache_salt`` of
their own). Checked per server: lmcache blended one request per quality prompt (the forced
one: every token but the last from lmcache) and none more, and each answer request was given
every full block; the table shows how many document tokens the answer sends computed
afresh. Paired with the baseline by question: accuracy counts (both right, only the full
prefill, only this server, neither), the accuracy difference with a 95% paired bootstrap
interval and an exact McNemar p, and the mean log P(fact) difference with its 95% bootstrap
interval. ``--parallel`` and ``--concurrency`` shorten such a run (the answers' numerics then
depend on which requests share a batch, far below the blend's effect).

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
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
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
    "failures": "lmcache_blend_failures_total",
}
DEFAULT_RATIOS = (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)
BLOCK = 32
"""vLLM's KV block size in every server."""
FORCED_ARG = "lmcache_bench_forced_ids"
"""``vllm_xargs`` key of a teacher-forced request: the token ids it must generate (:func:`forced_answer_class`)."""
FORCED_PROCESSOR = "benchmarks.blend_serving:ForcedAnswer"
"""vLLM's ``--logits-processors`` name of the teacher-forcing processor (resolved by :func:`__getattr__`)."""


# ------------------------------------------------------------------------------ teacher forcing
def forced_answer_class() -> type:
    """vLLM logits processor (``--logits-processors``) that makes a request whose ``vllm_xargs`` hold
    ``FORCED_ARG`` generate exactly those token ids: at step k every logit but that of the k-th id
    is set to -inf. Other requests are left alone. vLLM computes the returned logprobs from the raw
    logits, before any processor (its default ``logprobs_mode``, ``raw_logprobs``), so a forced
    token's logprob is the model's own, computed over the request's KV like any generated token.
    Defined on first use so that importing this module does not import vLLM."""
    import torch
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class ForcedAnswer(LogitsProcessor):
        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            self.forced: dict[int, tuple[list[int], list[int]]] = {}  # batch row -> (ids to force, output so far)

        def is_argmax_invariant(self) -> bool:
            return False

        @staticmethod
        def _state(params: Any, _prompt: list[int] | None, output: list[int]) -> tuple[list[int], list[int]] | None:
            ids = (getattr(params, "extra_args", None) or {}).get(FORCED_ARG)
            return ([int(t) for t in ids], output) if ids else None

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            process_dict_updates(self.forced, batch_update, self._state)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for row, (ids, output) in self.forced.items():
                if len(output) < len(ids):
                    token = ids[len(output)]
                    kept = logits[row, token].clone()
                    logits[row] = float("-inf")
                    logits[row, token] = kept
            return logits

    return ForcedAnswer


def __getattr__(name: str) -> Any:
    """Module attributes made on first use: ``ForcedAnswer`` (vLLM loads it by name in its worker)."""
    if name == "ForcedAnswer":
        cls = forced_answer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------ prompts
@dataclass(frozen=True, slots=True)
class Prompt:
    kind: str  # "quality" or "speed"
    question: int  # index in rag.QUESTIONS
    docs: tuple[int, ...]
    ids: tuple[int, ...]
    doc_tokens: int  # tokens of the documents in the prompt (what blending could reuse)
    content: str = ""  # the user message: instruction, documents and question joined by the separator
    tail: int = 0  # tokens after the last document (separator, question, template), as token ids


FORMATS = ("ids", "text", "chat")


def request(p: Prompt, fmt: str, tokenizer: Any, salt: str | None = None) -> tuple[str, dict[str, Any]]:
    """The endpoint and body fields that send prompt ``p`` in format ``fmt`` (with vLLM's
    ``cache_salt`` when ``salt`` is given)."""
    extra = {} if salt is None else {"cache_salt": salt}
    if fmt == "ids":
        return "/v1/completions", {"prompt": list(p.ids), **extra}
    if fmt == "text":
        before, after = rag.chat_wrapper(tokenizer)
        return "/v1/completions", {"prompt": before + p.content + after, **extra}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": p.content}], **extra}


def make_prompts(tokenizer: Any, args: argparse.Namespace) -> list[Prompt]:
    """Quality prompts (one per question), then speed prompts; no two share a document order, and
    each instruction starts with a tag of its own (``Request 7.``), so that no two prompts share a
    KV chunk: every prompt's first send is then a blend of its own, never served from an earlier
    prompt's blend result (lmcache loads one for a prompt that begins with the same chunks, and
    computes the rest exactly: a quality run would measure a mix)."""
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
        instruction = f"Request {len(out) + 1}. {rag.INSTRUCTION}"
        ids = rag.build_prompt(tokenizer, order, rag.QUESTIONS[q], instruction)
        doc_tokens = sum(len(rag.doc_ids(tokenizer, d)) for d in order)
        parts = [instruction, *(rag.DOCS[d] for d in order), f"Question: {rag.QUESTIONS[q].text}"]
        after = rag.chat_wrapper(tokenizer)[1]  # as rag.build_prompt ends a prompt
        tail = len(rag.sep_ids(tokenizer)) + len(rag.doc_ids(tokenizer, f"Question: {rag.QUESTIONS[q].text}{after}"))
        out.append(Prompt(kind, q, order, tuple(ids), doc_tokens, rag.SEP_TEXT.join(parts), tail))

    for q in range(min(args.questions, len(rag.QUESTIONS))):
        add("quality", q, args.quality_docs)
    for s in range(args.speed_prompts):
        add("speed", (5 * s + 3) % len(rag.QUESTIONS), args.speed_docs)
    return out


SCENARIOS = ("quality", "cold", "repeat", "stall")


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
    logprobs: list[float] = field(default_factory=list)  # each generated token's (raw) log-probability, if asked


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
    logprobs: list[float] = []
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
                logprobs += chunk_logprobs(choice)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return Answer("", -1, [], int(usage.get("prompt_tokens", 0)),
                  ttft if ttft is not None else time.perf_counter() - t0, "".join(text), tokens,
                  None if cached is None else int(cached), logprobs)  # fmt: skip


def chunk_logprobs(choice: dict[str, Any]) -> list[float]:
    """The generated tokens' log-probabilities in one streamed choice (completions or chat form)."""
    lp = choice.get("logprobs") or {}
    if "token_logprobs" in lp:  # /v1/completions
        return [float(x) for x in lp["token_logprobs"]]
    return [float(c["logprob"]) for c in lp.get("content") or ()]  # /v1/chat/completions


def gold_ids(tokenizer: Any, q: int) -> tuple[list[int], list[int]]:
    """The forced answer's ids: its lead's and its fact's (:func:`rag.gold_answer`)."""
    lead, fact = rag.gold_answer(rag.QUESTIONS[q])
    return rag.doc_ids(tokenizer, lead), rag.doc_ids(tokenizer, fact)


def force(url: str, p: Prompt, fmt: str, tokenizer: Any, salt: str | None = None) -> Answer:
    """Teacher forcing: prompt ``p`` sent as the answer request would send it, its answer forced
    to the gold answer (``ForcedAnswer``): the returned ``logprobs`` are the fact's tokens',
    log P(fact token k | prompt, lead, fact tokens before k); their sum is log P(fact). Raises
    when the server did not generate the gold ids (no forcing processor)."""
    lead, fact = gold_ids(tokenizer, p.question)
    gold = lead + fact
    path, fields = request(p, fmt, tokenizer, salt)
    extra: dict[str, Any] = {"vllm_xargs": {FORCED_ARG: gold}, "ignore_eos": True}
    extra |= {"logprobs": 0} if path == "/v1/completions" else {"logprobs": True, "top_logprobs": 0}
    ans = send(url, path, fields | extra, len(gold))
    got = ans.token_ids if ans.token_ids else rag.doc_ids(tokenizer, ans.text)
    if got != gold or len(ans.logprobs) != len(gold):
        raise RuntimeError(f"teacher forcing failed for q{p.question}: generated {got} ({ans.text!r}), "
                           f"gold {gold}; logprobs {ans.logprobs}")  # fmt: skip
    ans.kind, ans.question, ans.docs = "forced", p.question, list(p.docs)
    ans.logprobs = ans.logprobs[len(lead) :]
    return ans


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
    scores: list[Answer] = field(default_factory=list)  # teacher-forced gold answers, one per quality prompt
    counters: dict[str, dict[str, float | None]] = field(default_factory=dict)  # per phase: quality, speed


def scoring(args: argparse.Namespace) -> bool:
    """Whether quality prompts are also teacher-forced (``--no-score`` turns it off)."""
    return getattr(args, "scenario", "quality") == "quality" and not getattr(args, "no_score", False)


def blend_ratios(ratio: float, args: argparse.Namespace) -> list[float]:
    """``blend_recompute_ratios`` for a server of ``ratio``: one per check layer, the last one
    ``ratio``, the earlier ones ``--gradual`` (gradual filtering over several check layers)."""
    earlier = max(args.gradual or ratio, ratio)
    return [earlier] * (len(args.check_layers) - 1) + [ratio]


def lmcache_yaml(ratio: float | None, args: argparse.Namespace) -> str:
    text = (
        f"chunk_size: {args.chunk_size}\nlocal_cpu: true\nmax_local_cpu_size: {args.cpu_gib}\nlog_summary_interval: 0\n"
    )
    if ratio is None:
        return text
    return text + (
        f'enable_blending: true\nblend_special_str: "{rag.SEP_TEXT}"\nblend_recompute_ratios: {blend_ratios(ratio, args)}\n'
        f"blend_check_layers: {list(args.check_layers)}\nblend_min_tokens: {args.blend_min_tokens}\n"
        f"blend_sink_tokens: {args.sink_tokens}\n"
    )


def make_server(model_dir: Path, config: ServerConfig, workdir: Path, max_len: int,
                args: argparse.Namespace, cpu: int | None = None) -> OpenAIServer:  # fmt: skip
    """A server for ``config``; with ``cpu``, vLLM's compute threads are bound to that CPU."""
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}  # the same CPU layout with and without a connector
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    block = BLOCK
    extra = ["--max-model-len", str(math.ceil(max_len / block) * block), "--block-size", str(block),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens or max_len),
             "--no-enable-prefix-caching", "--served-model-name", SERVED_NAME]  # fmt: skip
    if scoring(args):
        extra += ["--logits-processors", FORCED_PROCESSOR]
        if not config.lmcache:  # exact KV: the answer request reuses the forced request's (same cache_salt)
            extra += ["--enable-prefix-caching"]
    name = config.name.replace(" ", "-").replace("=", "")
    if not config.lmcache:
        return OpenAIServer(str(model_dir), None, workdir / f"{name}.log", env=env, extra_args=extra)
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(lmcache_yaml(config.ratio, args))
    env["LMCACHE_CONFIG_FILE"] = str(cfg)
    ktc = {**DYNAMIC, "kv_load_failure_policy": "recompute"}
    return OpenAIServer(str(model_dir), ktc, workdir / f"{name}.log", env=env, extra_args=extra)


def run_servers(model_dir: Path, configs: list[ServerConfig], prompts: list[Prompt], tokenizer: Any,
                workdir: Path, args: argparse.Namespace) -> list[ServerRun]:  # fmt: skip
    """One server per config, in turn, or ``--parallel`` at once (each bound to a CPU of its own,
    the costliest configs first); the runs in ``configs``' order, without the failed ones."""
    cpus = [None] if args.parallel <= 1 else [k % (os.cpu_count() or 1) for k in range(args.parallel)]
    free: queue.Queue[int | None] = queue.Queue()
    for cpu in cpus:
        free.put(cpu)

    def one(config: ServerConfig) -> ServerRun | None:
        cpu = free.get()
        try:
            return run_server(model_dir, config, prompts, tokenizer, workdir, args, cpu)
        except Exception as exc:  # one broken server must not lose the others' numbers
            print(f"  [{config.name}] FAILED: {exc!r}", flush=True)
            return None
        finally:
            free.put(cpu)

    order = sorted(configs, key=lambda c: 1.0 if c.ratio is None else c.ratio, reverse=True)  # stable: baseline first
    with ThreadPoolExecutor(max_workers=len(cpus)) as pool:
        done = dict(zip(order, pool.map(one, order)))
    return [run for c in configs if (run := done[c]) is not None]


def run_server(model_dir: Path, config: ServerConfig, prompts: list[Prompt], tokenizer: Any, workdir: Path,
               args: argparse.Namespace, cpu: int | None = None) -> ServerRun:  # fmt: skip
    max_len = max(len(p.ids) for p in prompts) + args.max_tokens + 64
    server = make_server(model_dir, config, workdir, max_len, args, cpu)
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
            todo = [p for p in prompts if p.kind == kind]
            workers = args.concurrency if kind == "quality" else 1
            with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
                for forced, ans in pool.map(lambda p: ask(server.url, run, p, tokenizer, args), todo):
                    run.scores += [forced] if forced is not None else []
                    run.answers.append(ans)
            if config.lmcache:
                time.sleep(1.0)  # counters ride on the worker's step outputs
                after = blend_counters(server)
                run.counters[kind] = delta(after, before)
                before = after
        print(f"  [{run.name}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    except Exception:
        server.print_log_tail(run.name)
        raise
    finally:
        server.stop()
    return run


def ask(url: str, run: ServerRun, p: Prompt, tokenizer: Any,
        args: argparse.Namespace) -> tuple[Answer | None, Answer]:  # fmt: skip
    """Prompt ``p``'s requests: when scoring a quality prompt, first the teacher-forced one (the
    blend, or full prefill, under test), then the answer (greedy, ``--max-tokens``)."""
    # the baseline (vLLM's prefix caching on when scoring) shares KV between one prompt's requests only
    salt = f"{p.kind}-{p.question}" if scoring(args) and not run.config.lmcache else None
    forced = None
    if p.kind == "quality" and scoring(args):
        forced = force(url, p, args.format, tokenizer, salt)
        print(f"    [{run.name}] forced  q{p.question:<3} {forced.prompt_tokens} tok  TTFT {forced.ttft:6.2f} s  "
              f"cached {fmt(forced.cached_tokens, 'd')}  log P(fact) {sum(forced.logprobs):8.3f}",
              flush=True)  # fmt: skip
    path, fields = request(p, args.format, tokenizer, salt)
    ans = send(url, path, fields, args.max_tokens)
    ans.kind, ans.question, ans.docs = p.kind, p.question, list(p.docs)
    ok = rag.judge(ans.text, rag.QUESTIONS[p.question])
    print(f"    [{run.name}] {p.kind} q{p.question:<3} docs {p.docs} {ans.prompt_tokens} tok  TTFT {ans.ttft:6.2f} s  "
          f"cached {fmt(ans.cached_tokens, 'd')}  {'ok ' if ok else 'BAD'} {ans.text.strip()[:70]!r}",
          flush=True)  # fmt: skip
    return forced, ans


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
    ttft_quality_p50: float  # a quality prompt's first send (the forced request when scoring)
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
    first_sends = run.scores or quality
    return Row(
        run.name, acc, same, exact, rouge, p50([a.ttft for a in first_sends]), p50([a.ttft for a in speed]), ratio,
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


# ------------------------------------------------------------------------------ paired quality
@dataclass
class QualityRow:
    """One server's quality prompts against the baseline's, paired by question."""

    name: str
    questions: int
    accuracy: float
    full_accuracy: float
    both: int  # right on both servers
    only_full: int  # right on the baseline only
    only_this: int
    neither: int
    accuracy_diff: float  # accuracy - full_accuracy
    accuracy_diff_ci: tuple[float, float]  # 95% paired bootstrap
    mcnemar_p: float  # exact two-sided test of only_full against only_this
    gold_logprob: float | None  # mean over questions of log P(fact), teacher-forced
    logprob_diff: float | None  # mean over questions of this server's log P(fact) - the baseline's
    logprob_diff_ci: tuple[float, float] | None  # 95% paired bootstrap
    logprob_diff_median: float | None
    blended: float | None  # lmcache_blend_requests during the quality prompts
    blend_failures: float | None
    forced_cached: int  # forced (first) sends with every prompt token but the last from lmcache
    answers_cached: int  # answer (second) sends given every full KV block of the prompt (the first send's KV)
    answers_exact_doc_tokens: tuple[float, int]  # document tokens the answer send computed afresh: mean, max


def bootstrap_mean_ci(values: list[float], reps: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of ``values`` (one per question), resampling the questions."""
    if len(values) < 2:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar test: P(a split of the b + c discordant pairs at least this uneven | 50/50)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def all_but_last_cached(a: Answer) -> bool:
    return a.cached_tokens is not None and a.cached_tokens == a.prompt_tokens - 1


def full_blocks_cached(a: Answer) -> bool:
    """Every full KV block before the last token came from the cache (lmcache's blend result or,
    on the baseline, vLLM's prefix cache: both are block-granular)."""
    return a.cached_tokens is not None and a.cached_tokens >= (a.prompt_tokens - 1) // BLOCK * BLOCK


def exact_doc_tokens(a: Answer, p: Prompt) -> int:
    """Document tokens among those the answer send computed itself (after its cached blocks): a
    blend kept most of them as cached, so there they are closer to a full prefill than the blend."""
    return max(0, a.prompt_tokens - (a.cached_tokens or 0) - p.tail)


def quality_row(run: ServerRun, base: ServerRun, prompts: list[Prompt]) -> QualityRow:
    """``run``'s quality answers and forced scores paired with ``base``'s by question."""
    by_q = {p.question: p for p in prompts if p.kind == "quality"}
    mine = {a.question: a for a in run.answers if a.kind == "quality"}
    theirs = {a.question: a for a in base.answers if a.kind == "quality"}
    qs = sorted(mine.keys() & theirs.keys())
    ok = {q: rag.judge(mine[q].text, rag.QUESTIONS[q]) for q in qs}
    ok_full = {q: rag.judge(theirs[q].text, rag.QUESTIONS[q]) for q in qs}
    count = lambda mine_ok, full_ok: sum(ok[q] == mine_ok and ok_full[q] == full_ok for q in qs)  # noqa: E731
    diffs = [float(ok[q]) - float(ok_full[q]) for q in qs]
    lp = {a.question: sum(a.logprobs) for a in run.scores}
    lp_full = {a.question: sum(a.logprobs) for a in base.scores}
    lq = sorted(lp.keys() & lp_full.keys())
    lp_diffs = [lp[q] - lp_full[q] for q in lq]
    counters = run.counters.get("quality", {})
    n = max(1, len(qs))
    return QualityRow(
        run.name, len(qs), sum(ok.values()) / n, sum(ok_full.values()) / n,
        count(True, True), count(False, True), count(True, False), count(False, False),
        statistics.fmean(diffs) if diffs else float("nan"), bootstrap_mean_ci(diffs),
        mcnemar_p(count(False, True), count(True, False)),
        statistics.fmean(lp[q] for q in lq) if lq else None,
        statistics.fmean(lp_diffs) if lp_diffs else None, bootstrap_mean_ci(lp_diffs) if lp_diffs else None,
        statistics.median(lp_diffs) if lp_diffs else None,
        counters.get("requests"), counters.get("failures"),
        sum(all_but_last_cached(a) for a in run.scores), sum(full_blocks_cached(mine[q]) for q in qs),
        (statistics.fmean(exact) if (exact := [exact_doc_tokens(mine[q], by_q[q]) for q in qs]) else 0.0,
         max(exact, default=0)),
    )  # fmt: skip


def pct(v: float) -> str:
    return f"{v * 100:+.1f}"


def quality_table(rows: list[QualityRow]) -> str:
    head = ("| server | questions | accuracy | both / only full / only this / neither | accuracy - full, points "
            "(95% CI) | McNemar p | mean log P(fact) | log P(fact) - full: mean (95% CI) | median "
            "| blended first sends | answers from the first send's KV |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ci = r.logprob_diff_ci
        lp = "n/a" if r.logprob_diff is None or ci is None else f"{r.logprob_diff:+.3f} ({ci[0]:+.3f} to {ci[1]:+.3f})"
        lines.append(
            f"| {r.name} | {r.questions} | {r.accuracy:.1%} | {r.both} / {r.only_full} / {r.only_this} / {r.neither} | "
            f"{pct(r.accuracy_diff)} ({pct(r.accuracy_diff_ci[0])} to {pct(r.accuracy_diff_ci[1])}) | "
            f"{r.mcnemar_p:.3f} | {fmt(r.gold_logprob, '.3f')} | {lp} | {fmt(r.logprob_diff_median, '+.3f')} | "
            f"{fmt(r.blended, '.0f')} of {r.questions} ({r.forced_cached} all but the last token from lmcache) | "
            f"{r.answers_cached} of {r.questions} (doc tokens recomputed: mean {r.answers_exact_doc_tokens[0]:.1f}, "
            f"max {r.answers_exact_doc_tokens[1]}) |"
        )
    return "\n".join(lines)


def blend_warnings(rows: list[QualityRow]) -> list[str]:
    """A line per blending server whose first sends were not all blended (their pairs would
    compare a full prefill, or an earlier blend's result, with the baseline)."""
    return [f"WARNING: {r.name}: {fmt(r.blended, '.0f')} of {r.questions} first sends blended, "
            f"{r.forced_cached} given every token but the last by lmcache (documents evicted? raise --cpu-gib)"
            for r in rows if r.blended is not None and not r.blended == r.forced_cached == r.questions]  # fmt: skip


def within(r: QualityRow, points: float = 5.0) -> str:
    """Whether ``r``'s accuracy is within ``points`` of the baseline's: the point estimate, and the
    paired interval's lower end (non-inferiority at that margin)."""
    lo = r.accuracy_diff_ci[0] * 100
    est = "within" if abs(r.accuracy_diff) * 100 <= points else "NOT within"
    ci = "within" if lo >= -points else "not shown within"
    return (f"{r.name}: accuracy {pct(r.accuracy_diff)} points vs full prefill ({est} {points:g}); 95% CI lower end "
            f"{lo:+.1f} ({ci} {points:g} points)")  # fmt: skip


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
    ap.add_argument("--no-score", action="store_true",
                    help="quality: no teacher-forced log P(fact) (one request per prompt, as before)")
    ap.add_argument("--format", choices=FORMATS, default="ids",
                    help="how prompts are sent: token ids, one text string, or the chat API (see above)")
    ap.add_argument("--seed", type=int, default=0, help="document orders")
    ap.add_argument("--no-baseline", action="store_true", help="no full-prefill server (no comparison columns)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="quality: prompts in flight per server (batches the answers' decoding; TTFTs then overlap)")
    ap.add_argument("--parallel", type=int, default=1,
                    help="quality: servers run at once, each vLLM worker bound to a CPU of its own (shortens a "
                         "quality run; the TTFT columns then measure a shared machine)")
    ap.add_argument("--with-prefix", action="store_true", help="also lmcache without blending (prefix reuse only)")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--cpu-gib", type=float, default=8.0,
                    help="max_local_cpu_size (allocated as used): every blended prompt also stores its blend result "
                         "(~55 MB at 1.2k tokens), and once the tier is full, documents unused for a while are "
                         "evicted first and their prompts are no longer blended")
    ap.add_argument("--check-layers", type=lambda v: [int(x) for x in v.split(",")], default=[1],
                    help="blend_check_layers, comma-separated (e.g. 1,4: gradual filtering; see --gradual)")
    ap.add_argument("--gradual", type=float, default=None,
                    help="with several --check-layers: the ratio kept at every check layer but the last "
                         "(the last keeps the server's ratio)")
    ap.add_argument("--blend-min-tokens", type=int, default=256)
    ap.add_argument("--sink-tokens", type=int, default=0,
                    help="blend_sink_tokens: the first cached tokens of each reused document recomputed")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: the longest prompt (one prefill step)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--keep-workdir", action="store_true", help="keep the server logs and configs")
    ap.add_argument("--json", type=Path, help="write the answers, timings and the table here")
    ap.add_argument("--scenario", choices=SCENARIOS, default="quality",
                    help="quality: the ratios' accuracy and TTFT (above); cold: never-seen documents, blend on vs off; "
                         "repeat: the same prompt sent again, blend on vs off; stall: other users' inter-token "
                         "latency while a prompt is blended (benchmarks/blend_stall.py)")
    from benchmarks import blend_stall

    blend_stall.add_arguments(ap)
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
    if args.scenario == "stall":
        from benchmarks import blend_stall

        return blend_stall.main(model_dir, tokenizer, args, args.ratios[0] if args.ratios else 0.2)
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
        runs = run_servers(model_dir, configs, prompts, tokenizer, workdir, args)
    finally:
        if args.keep_workdir:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    if not runs:
        return 1
    base = runs[0] if runs[0].config == BASELINE else None
    rows = [summarize(r, base, prompts) for r in runs]
    quality = [quality_row(r, base, prompts) for r in runs if r is not base] if base is not None else []
    print(f"\n{table(rows)}")
    if quality:
        print(f"\npaired with the full prefill (baseline) by question:\n{quality_table(quality)}\n")
        print("\n".join([*(within(q) for q in quality), *blend_warnings(quality)]))
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    if args.json is not None:
        payload = {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "prompts": [asdict(p) | {"ids": None, "tokens": len(p.ids)} for p in prompts],
            "runs": [asdict(r) for r in runs],
            "table": [asdict(r) for r in rows],
            "quality": [asdict(q) for q in quality],
        }
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"results written to {args.json}")
    return 0 if len(runs) == len(configs) else 1
