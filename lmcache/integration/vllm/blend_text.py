"""Where a document's cacheable tokens begin, for prompts that arrive as text.

A BPE tokenizer splits text into words first (a word carries the space before it) and
tokenizes each word alone, so a document's tokens are the same wherever it appears,
except for its first word: alone, ``"The cat"`` gives ``[The, Ġcat]``; after the
separator inside a prompt, ``"... # # The cat"`` gives ``[Ġ#, Ġ#, ĠThe, Ġcat]`` (the
separator's trailing space went into ``ĠThe``), and a chat template puts its own text
right before the first document. So a segment is keyed and reused from its *second*
word on (its anchor); its first word is recomputed, and that word's text, stripped of
white space, is folded into the segment's key (its lead), so ``"Not cat sat"`` can never
stand in for ``"The cat sat"``.

Chat messages: special tokens (a template's turn markers) end segments like the separator
does, so documents sent as separate messages are segments of their own; a segment that
follows a special token skips its role line first (``user\n`` after ``<|im_start|>``).

:class:`TokenText` holds what the scheduler needs of the served model's tokenizer: the
ids of tokens that begin a word (their text starts with a space: ``Ġ``/``▁``), the
special token ids, and ``decode``. Built once when blending starts; the anchor of a
segment costs a scan of a few tokens and one decode of its first word.

Runs on vLLM's scheduler thread; immutable after construction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache.v1.blend.segments import MAX_LEAD_BYTES

logger = logging.getLogger(__name__)

ROLE_LINE_TOKENS = 4
"""After a special token, a newline within this many tokens ends a role line (skipped)."""
MAX_LEAD_TOKENS = 16
"""A segment's anchor is searched for within this many tokens of its first one; without a
word start there (text without spaces), the anchor is the segment's second token."""
WORD_START_MARKS = ("Ġ", "▁", " ")
"""First characters of the token strings that begin a word (byte-level BPE, SentencePiece, plain)."""
BLANK_CHARS = frozenset("ĠĊĉč▁ \n\t\r")
"""Characters of token strings that stand for white space (byte-level BPE's and SentencePiece's marks)."""


@dataclass(frozen=True, slots=True)
class Anchor:
    """A segment's cacheable part starts at ``start``; ``lead`` is the key text before it,
    ``lead_tokens`` the tokens it spans (recomputed whenever the segment is reused)."""

    start: int
    lead: bytes
    lead_tokens: int = 0


@dataclass(frozen=True, slots=True, eq=False)
class TokenText:
    """The tokenizer facts behind :meth:`anchor` (see the module docstring)."""

    word_start: frozenset[int]
    special: frozenset[int]
    decode: Callable[[list[int]], str]
    blank: frozenset[int] = frozenset()
    """Tokens that are only white space (skipped like special tokens before a segment's first word)."""
    newline: frozenset[int] = frozenset()
    """Blank tokens holding a line break (the end of a chat template's role line)."""

    @classmethod
    def from_tokenizer(cls, tok: Any) -> TokenText:
        """From a Hugging Face tokenizer (``convert_ids_to_tokens``, ``all_special_ids``, ``decode``)."""
        pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
        starts = frozenset(i for i, p in enumerate(pieces) if isinstance(p, str) and p.startswith(WORD_START_MARKS))
        blank = frozenset(i for i, p in enumerate(pieces) if isinstance(p, str) and p and set(p) <= BLANK_CHARS)
        newline = frozenset(i for i in blank if "Ċ" in pieces[i] or "\n" in pieces[i])
        special = frozenset(int(i) for i in getattr(tok, "all_special_ids", ()) or ())

        def decode(ids: list[int]) -> str:
            return str(tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

        return cls(starts, special, decode, blank, newline)

    def anchor(self, tokens: Sequence[int], start: int, end: int, *, after_special: bool = False) -> Anchor:
        """The anchor of segment ``tokens[start:end]``: past its leading special and blank
        tokens, its role line when it follows a special token (``after_special``), and its
        first word (``end`` when the segment is nothing but those)."""
        first = self._skip_blank(tokens, start, end)
        if after_special:
            for i in range(first, min(end, first + ROLE_LINE_TOKENS)):
                if int(tokens[i]) in self.newline:
                    first = self._skip_blank(tokens, i + 1, end)
                    break
        if first >= end:
            return Anchor(end, b"")
        limit = min(end, first + 1 + MAX_LEAD_TOKENS)
        at = first + 1
        while at < limit and int(tokens[at]) not in self.word_start:
            at += 1
        if at >= limit:
            at = min(first + 1, end)
        lead = self.decode([int(t) for t in tokens[first:at]]).strip().encode("utf-8", "replace")
        return Anchor(at, lead[:MAX_LEAD_BYTES], at - first)

    def _skip_blank(self, tokens: Sequence[int], i: int, end: int) -> int:
        while i < end and (int(tokens[i]) in self.special or int(tokens[i]) in self.blank):
            i += 1
        return i

    def is_text(self, token: int) -> bool:
        """Whether ``token`` is neither special nor blank."""
        return token not in self.special and token not in self.blank
