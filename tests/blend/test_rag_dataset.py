"""The blending benchmark's question set (harness/rag_dataset.py): facts, judge, ROUGE-L, prompt layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import rag_dataset as rag

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m"


def test_every_fact_in_exactly_one_document():
    assert len(rag.DOCS) == 16 and len(rag.DOCS) % rag.GROUP == 0 and len(rag.QUESTIONS) >= 100
    for q in rag.QUESTIONS:
        fact = q.answers[0].lower()
        assert [i for i, d in enumerate(rag.DOCS) if fact in d.lower()] == [q.doc], q
        for alias in q.answers[1:]:  # an alias may be a form the text does not use, never another document's
            assert all(alias.lower() not in d.lower() for i, d in enumerate(rag.DOCS) if i != q.doc), (q, alias)
    assert {q.doc for q in rag.QUESTIONS} == set(range(len(rag.DOCS)))


def test_no_answer_is_given_away_by_its_question():
    """An answer restating the question must not pass the judge."""
    for q in rag.QUESTIONS:
        assert all(a.lower() not in q.text.lower() for a in q.answers), q
    assert len({q.text for q in rag.QUESTIONS}) == len(rag.QUESTIONS)


def test_documents_and_questions_are_only_appended():
    """Tests and earlier measurements use indices: the original eight documents and 28 questions
    keep theirs (spot checks), and so do their prompts' document orders."""
    assert rag.DOCS[0].startswith("Brindlemoor is a small market town") and rag.DOCS[7].startswith("The silver-crested")
    assert rag.QUESTIONS[1].answers[0] == "4,318" and rag.QUESTIONS[16].answers[0] == "87"
    assert rag.QUESTIONS[23].answers[0] == "780" and rag.QUESTIONS[27].answers[0] == "Harriet Quinlan"
    # the orders the eight-document set gave (test_blend_real_model_e2e.py relies on them)
    assert rag.docs_for(16, 4) == [6, 4, 2, 3]
    assert rag.docs_for(23, 4) == [0, 7, 2, 6]
    assert rag.docs_for(1, 4) == [1, 2, 0, 5]


def test_gold_answer_is_the_question_restated_then_the_fact():
    for q in rag.QUESTIONS:
        lead, fact = rag.gold_answer(q)
        assert lead == q.lead and lead and lead == lead.strip() and fact == " " + q.answers[0]
        assert rag.judge(lead + fact, q) and not rag.judge(lead, q)  # the lead gives no answer away
    assert rag.gold_answer(rag.Question("Who?", 0, ("Wren",))) == (rag.ANSWER_LEAD, " Wren")


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


def test_docs_for_stays_in_the_answer_documents_group():
    assert list(rag.group_of(3)) == list(range(8)) and list(rag.group_of(12)) == list(range(8, 16))
    for i, q in enumerate(rag.QUESTIONS):
        group = set(rag.group_of(q.doc))
        assert set(rag.docs_for(i, 4, seed=1)) <= group
        assert sorted(rag.docs_for(i, rag.GROUP)) == sorted(group)
    # every group has questions, and every document of it
    assert {q.doc // rag.GROUP for q in rag.QUESTIONS} == set(range(len(rag.DOCS) // rag.GROUP))


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
    # a teacher-forced answer's ids are the lead's then the fact's, as the whole answer tokenizes
    for q in rag.QUESTIONS:
        lead, fact = rag.gold_answer(q)
        assert rag.doc_ids(tokenizer, lead + fact) == rag.doc_ids(tokenizer, lead) + rag.doc_ids(tokenizer, fact), q
    # sizes the benchmark relies on: 360-390 tokens a document (the appended ones 360-380)
    sizes = [len(rag.doc_ids(tokenizer, d)) for d in range(len(rag.DOCS))]
    assert all(360 <= n <= 390 for n in sizes), sizes
    assert all(360 <= n <= 380 for n in sizes[8:]), sizes
