"""The blending benchmark's question set (harness/rag_dataset.py): facts, judge, ROUGE-L, prompt layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import rag_dataset as rag

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"


def test_every_fact_in_exactly_one_document():
    assert len(rag.DOCS) == 8 and len(rag.QUESTIONS) >= 24
    for q in rag.QUESTIONS:
        fact = q.answers[0].lower()
        assert [i for i, d in enumerate(rag.DOCS) if fact in d.lower()] == [q.doc], q
        for alias in q.answers[1:]:  # an alias may be a form the text does not use, never another document's
            assert all(alias.lower() not in d.lower() for i, d in enumerate(rag.DOCS) if i != q.doc), (q, alias)
    assert {q.doc for q in rag.QUESTIONS} == set(range(len(rag.DOCS)))


def test_judge_contains_fact_or_alias_case_insensitively():
    q = rag.Question("Who?", 0, ("Tobias Wren", "Wren"))
    assert rag.judge("It was founded by TOBIAS WREN.", q)
    assert rag.judge("Mr wren did.", q)
    assert not rag.judge("Edith Carrow", q)
    assert not rag.judge("", q)


def test_rouge_l():
    assert rag.rouge_l("a b c", "a b c") == 1.0
    assert rag.rouge_l("a b c", "d e") == 0.0
    assert rag.rouge_l("", "") == 1.0 and rag.rouge_l("a", "") == 0.0
    # LCS "a c" (2): precision 2/3, recall 2/2 -> F 0.8
    assert rag.rouge_l("a b c", "a c") == pytest.approx(0.8)
    # order matters: LCS of "a b" and "b a" is 1
    assert rag.rouge_l("a b", "b a") == pytest.approx(0.5)


def test_docs_for_includes_the_answer_document():
    for i, q in enumerate(rag.QUESTIONS):
        order = rag.docs_for(i, 4)
        assert q.doc in order and len(set(order)) == 4
    with pytest.raises(ValueError):
        rag.docs_for(0, 9)


@pytest.fixture(scope="module")
def tokenizer():
    if not (MODEL_DIR / "tokenizer.json").exists():
        pytest.skip(f"the real model's tokenizer is not in {MODEL_DIR}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def test_prompt_is_parts_joined_by_separator(tokenizer):
    from lmcache.v1.blend.segments import split_segments

    sep = rag.sep_ids(tokenizer)
    order = [3, 0, 6, 1]
    ids = rag.build_prompt(tokenizer, order, rag.QUESTIONS[0])
    segments = split_segments(ids, sep)
    assert len(segments) == len(order) + 2  # instruction, documents, question
    docs = segments[1:-1]
    for seg, d in zip(docs, order):
        assert list(ids[seg.start : seg.start + len(seg.tokens)]) == rag.doc_ids(tokenizer, d)
        assert list(seg.tokens) == rag.doc_ids(tokenizer, d)
    assert all(ids[s.start - len(sep) : s.start] == sep for s in segments[1:])
    # sizes the benchmark relies on: ~300-450 tokens a document
    assert all(300 <= len(rag.doc_ids(tokenizer, d)) <= 450 for d in range(len(rag.DOCS)))
