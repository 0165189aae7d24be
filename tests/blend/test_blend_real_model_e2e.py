"""Blending with the real model (SmolLM2-135M-Instruct) through vLLM's OpenAI server.

The eight documents of the RAG question set (``harness/rag_dataset.py``) are cached alone;
then questions are asked over four of them in orders never seen before. Each prompt is
blended (all but its last token come from lmcache; at the default recompute ratio, 0.2,
80 % of its document tokens keep their cached KV), and the answers state the facts the
documents give (questions a full prefill answers correctly, chosen for it).

The same server then takes the prompts as users send them, through the official ``openai``
client: one text string to ``/v1/completions``, a ``/v1/chat/completions`` user message (the
server renders the chat template and tokenizes: the separator's space merges into the next
word), and one chat message per document. Those prompts are blended too.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from harness import rag_dataset as rag
from harness.openai_server import DYNAMIC, OpenAIServer, metric_value
from harness.real_model import RealModelUnavailable, real_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUESTIONS = (16, 23, 1)
"""Questions (indices in ``rag.QUESTIONS``) whose facts a full prefill of these prompts states."""


def complete(server: OpenAIServer, ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, tokenizer): the real model with blending on, the eight documents cached alone."""
    try:
        model = real_model_dir()
    except RealModelUnavailable as exc:
        pytest.skip(f"the real model (SmolLM2-135M-Instruct) cannot be built: {exc}")
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("blend-real")
    tok = AutoTokenizer.from_pretrained(str(model))
    cfg = tmp / "lmcache.yaml"
    cfg.write_text("chunk_size: 256\nmax_local_cpu_size: 1\nenable_blending: true\nlog_summary_interval: 0\n")
    server = OpenAIServer(
        str(model), DYNAMIC, tmp / "server.log",
        env={"LMCACHE_CONFIG_FILE": str(cfg), "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        extra_args=["--max-model-len", "2048", "--served-model-name", "m", "--max-num-batched-tokens", "2048"],
    ).start()  # fmt: skip
    try:
        for d in range(len(rag.DOCS)):  # each document alone, ended by the separator
            complete(server, rag.doc_ids(tok, d) + rag.sep_ids(tok), 1)
        yield server, tok
    finally:
        server.stop()


def blend_delta(before: str, after: str) -> dict[str, float]:
    return {
        n: metric_value(after, f"lmcache_blend_{n}_total") - metric_value(before, f"lmcache_blend_{n}_total")
        for n in ("requests", "reused_tokens", "failures")
    }


def test_real_model_answers_from_reordered_cached_documents(served):
    server, tok = served
    for qi in QUESTIONS:
        q = rag.QUESTIONS[qi]
        ids = rag.build_prompt(tok, rag.docs_for(qi, 4), q)
        doc_tokens = sum(len(rag.doc_ids(tok, d)) for d in rag.docs_for(qi, 4))
        before = server.metrics()
        resp = complete(server, ids, 24)
        delta = blend_delta(before, server.metrics())
        answer = resp["choices"][0]["text"]
        assert rag.judge(answer, q), (q.text, answer)
        assert resp["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
        assert delta["requests"] == 1 and delta["failures"] == 0
        # the default ratio (0.2) recomputes the fifth of the reused tokens that deviate most; each
        # document's first word is recomputed too (segments are keyed from their second word)
        assert delta["reused_tokens"] >= 0.8 * (doc_tokens - 4 * 3), (delta, doc_tokens)


@pytest.mark.parametrize("api", ["completions_text", "chat", "chat_messages"])
def test_text_and_chat_prompts_are_blended(served, api):
    """Prompts as RAG clients send them: the documents' text joined by the separator."""
    import openai

    server, tok = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    qi = QUESTIONS[0]
    q = rag.QUESTIONS[qi]
    order = list(reversed(rag.docs_for(qi, 4)))  # an order the id prompts did not use
    if api == "chat":  # the text prompt is this chat prompt rendered: another order, or it is a repeat
        order = order[1:] + order[:1]
    content = rag.SEP_TEXT.join([rag.INSTRUCTION, *(rag.DOCS[d] for d in order), f"Question: {q.text}"])
    doc_tokens = sum(len(rag.doc_ids(tok, d)) for d in order)
    before = server.metrics()
    if api.startswith("chat"):
        messages = [{"role": "user", "content": content}]
        if api == "chat_messages":  # one message per document, no separator
            messages = [{"role": "user", "content": text} for text in
                        (rag.INSTRUCTION, *(rag.DOCS[d] for d in order), f"Question: {q.text}")]  # fmt: skip
        resp = client.chat.completions.create(model="m", messages=messages, max_tokens=24, temperature=0)
        answer = resp.choices[0].message.content
    else:
        before_text, after_text = rag.chat_wrapper(tok)
        resp = client.completions.create(model="m", prompt=before_text + content + after_text, max_tokens=24,
                                         temperature=0)  # fmt: skip
        answer = resp.choices[0].text
    delta = blend_delta(before, server.metrics())
    assert delta["requests"] == 1 and delta["failures"] == 0, delta
    assert delta["reused_tokens"] >= 0.7 * doc_tokens, (delta, doc_tokens)
    assert resp.usage.prompt_tokens_details.cached_tokens == resp.usage.prompt_tokens - 1
    assert answer and answer.strip()


def test_a_repeated_chat_prompt_loads_its_blend_and_answers_the_same(served):
    """The second send of a blended chat prompt loads the first send's KV (a blend result):
    no second blend, every token but the last cached, and the same answer."""
    import openai

    server, _ = served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    q = rag.QUESTIONS[QUESTIONS[1]]
    order = rag.docs_for(QUESTIONS[1], 4)[::2] + rag.docs_for(QUESTIONS[1], 4)[1::2]
    content = rag.SEP_TEXT.join([rag.INSTRUCTION, *(rag.DOCS[d] for d in order), f"Question: {q.text}"])
    answers, deltas, cached = [], [], []
    for _ in range(2):
        before = server.metrics()
        resp = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}], max_tokens=24, temperature=0
        )
        after = server.metrics()
        deltas.append(blend_delta(before, after))
        cached.append((resp.usage.prompt_tokens_details.cached_tokens, resp.usage.prompt_tokens))
        answers.append(resp.choices[0].message.content)
    assert deltas[0]["requests"] == 1 and deltas[1]["requests"] == 0, deltas
    assert cached[1][0] >= cached[1][1] - 256, cached  # all but the prompt's last, partial chunk at most
    assert answers[1] == answers[0]
