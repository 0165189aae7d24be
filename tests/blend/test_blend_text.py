"""Documents in text and chat prompts match the same documents sent alone (the real
model's BPE tokenizer), and a segment's first word is part of its key.

``" # # "`` tokenizes alone as ``[Ġ#, Ġ#, Ġ]`` but inside text the trailing space joins the
next word (``ĠThe``), and a chat template puts its own text before the first document:
segments are split on the separator's core and keyed from their second word, with the
first word's text as the lead (lmcache/integration/vllm/blend_text.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.integration.vllm.blend_planner import BlendPlanner, BlendRules
from lmcache.integration.vllm.blend_text import TokenText
from lmcache.v1.blend.segments import Segment
from tests.blend.test_segments import make_keys

DOC = ("The Apache License grants each Contributor a perpetual, worldwide, non-exclusive license to reproduce, "
       "prepare Derivative Works of, publicly display and distribute the Work.")  # fmt: skip
OTHER = "Redistribution must retain this notice, the copyright notice and the list of conditions that follows it."


@pytest.fixture(scope="module")
def tok():
    from harness.real_model import RealModelUnavailable, real_model_dir

    try:
        path = real_model_dir()
    except RealModelUnavailable as exc:
        pytest.skip(str(exc))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def text(tok) -> TokenText:
    return TokenText.from_tokenizer(tok)


@pytest.fixture(scope="module")
def planner(tok, text) -> BlendPlanner:
    core = tuple(tok.encode(" # #", add_special_tokens=False))
    return BlendPlanner(BlendRules(core, min_segment_tokens=4, text=text))


def keyed(prompt: list[int], planner: BlendPlanner) -> list[tuple[tuple[int, ...], bytes]]:
    """Each segment's (key tokens, lead)."""
    return [(tuple(prompt[s.start : s.end]), s.lead) for s in planner.segments(prompt)]


def key_strings(tokens: tuple[int, ...], lead: bytes) -> list[str]:
    keys, _ = make_keys(8)
    return [span.key.to_string() for span in keys.spans(Segment(0, len(tokens), tokens, lead))]


def test_separator_merges_with_the_next_word_in_text(tok):
    alone = tok.encode(" # # ", add_special_tokens=False)
    inside = tok.encode("end # # The", add_special_tokens=False)
    assert alone[:2] == inside[1:3] and alone[2] not in inside  # the trailing space joined "The"


def test_a_document_in_a_text_prompt_has_its_keys_when_alone(tok, planner):
    (alone,) = keyed(tok(DOC)["input_ids"], planner)
    prompt = tok(f"Answer from the documents. # # {OTHER} # # {DOC} # # Who grants the license?")["input_ids"]
    inside = keyed(prompt, planner)
    assert alone in inside and alone[1] == b"The"
    assert key_strings(*alone) == key_strings(*inside[inside.index(alone)])


def test_a_document_in_a_chat_prompt_has_its_keys_when_alone(tok, planner):
    (alone,) = keyed(tok(DOC)["input_ids"], planner)
    for content in (f" # # {DOC} # # Who grants the license?", f"{OTHER} # # {DOC} # # Who grants the license?"):
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False)  # fmt: skip
        assert alone in keyed(tok(text, add_special_tokens=False)["input_ids"], planner)


def test_a_token_id_prompt_built_piece_by_piece_has_the_same_keys(tok, planner):
    sep = tok.encode(" # # ", add_special_tokens=False)
    doc = tok.encode(DOC, add_special_tokens=False)
    (alone,) = keyed(doc, planner)
    assert alone in keyed(tok.encode("Question first.", add_special_tokens=False) + sep + doc + sep, planner)


def test_the_first_word_is_part_of_the_key(tok, planner):
    """A prompt that changes only a document's first word cannot stand in for it."""
    (real,) = keyed(tok(DOC)["input_ids"], planner)
    (forged,) = keyed(tok("Not" + DOC[3:])["input_ids"], planner)
    assert real[0] == forged[0] and real[1] != forged[1]
    assert key_strings(*real) != key_strings(*forged)


@given(words=st.lists(st.sampled_from(["the", "cat", "Sat", "on", "a", "mat,", "über", "42", "#", "\n"]),
                      min_size=1, max_size=30))
@settings(max_examples=100, deadline=None)
def test_anchor_is_inside_the_segment_and_lead_is_bounded(tok, text, words):
    ids = tok(" ".join(words))["input_ids"]
    anchor = text.anchor(ids, 0, len(ids))
    assert 0 < anchor.start <= len(ids) and len(anchor.lead) <= 256
    # the lead's tokens (recomputed on reuse, counted towards the ratio) are those right before start
    assert 0 <= anchor.lead_tokens <= anchor.start
    lead_text = tok.decode(ids[anchor.start - anchor.lead_tokens : anchor.start]).strip()
    assert lead_text.encode("utf-8", "replace")[:256] == anchor.lead


def chat_ids(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_documents_sent_as_separate_chat_messages_have_their_keys_when_alone(tok, planner):
    """A chat template's turn markers (special tokens) end segments, and the role line after
    them is skipped: each document message is a segment keyed as the document alone."""
    (alone,) = keyed(tok(DOC)["input_ids"], planner)
    (other,) = keyed(tok(OTHER)["input_ids"], planner)
    messages = [{"role": "system", "content": "Answer from the documents the user sends."},
                {"role": "user", "content": OTHER}, {"role": "user", "content": DOC},
                {"role": "user", "content": "Who grants the license?"}]  # fmt: skip
    inside = keyed(chat_ids(tok, messages), planner)
    assert alone in inside and other in inside


def test_only_the_first_text_segment_is_stored(tok, planner):
    """Documents after the system message (or after other text) are never stored; the first
    segment with text is, when a turn marker or separator ends it."""
    ids = chat_ids(tok, [{"role": "system", "content": "Answer from the documents the user sends."},
                         {"role": "user", "content": DOC}])  # fmt: skip
    segs = planner.segments(ids)
    assert segs[0].storable and not any(s.storable for s in segs[1:])
    (alone,) = planner.segments(tok(DOC + " # # ")["input_ids"])
    assert alone.storable
    (unended,) = planner.segments(tok(DOC)["input_ids"])
    assert not unended.storable  # ordinary traffic: no separator, not a document
