"""A tokenizer's output for a text, assembled from its output for the text's pieces, so
that pieces seen before (a system prompt, tool schemas, the earlier turns of a
conversation) need not be tokenised again.

Why the result is exact. A Hugging Face tokenizer (the `tokenizers` library) first cuts
the text at every added token (`<|im_start|>`, `<s>`, ...) matched on the raw text,
leftmost-longest, and from then on handles each piece between them on its own:
normalising, the normalised added tokens, pre-tokenising and the model all see one
piece at a time. The output for the whole text is therefore the added tokens' ids with
each piece's own output between them, under conditions checked or arranged here:
- the cut is found exactly where the tokenizer finds it: a regular expression of the
  same tokens, longest first, is leftmost-longest too; an added token that strips the
  spaces around it or matches single words only would move the cut, so a tokenizer with
  one is refused (its callers tokenise whole);
- a piece is encoded as it stood: the one thing a piece's handling reads from outside it
  is whether it starts the text (SentencePiece-style `Metaspace(prepend_scheme="first")`
  marks the first piece only), so a piece that did not start the text is encoded behind
  an added token whose id is then dropped;
- the tokenizer extracts added tokens at all (`encode_special_tokens` off), and it
  neither truncates nor pads.

A long run of text between added tokens (a document, a long user message, a prompt of
the completions API) is cut further, between words, where the tokenizer's
pre-tokenizer is one of those below, so that a prompt that repeats the start of an
earlier one reuses that start too. A cut goes before a space that has a character
other than whitespace on either side ("...word| word..."), and the result is still
exact, because of how these pre-tokenizers split:
- GPT-2's byte-level regular expression (`ByteLevel(use_regex=True)`), and Llama 3's
  and Qwen 2's (`Split(pattern, "isolated")` then `ByteLevel(use_regex=False)`), both
  without a prefix space: a space is taken only at the start of a match, or inside a
  run of whitespace; so the match of the character before the space ends at it, and
  the next match starts there, as it would at the start of the second part;
- the part before the cut matches as it would alone: no alternative of these patterns
  looks behind; the only one that looks ahead (whitespace not followed by anything
  else) looks at most one character past a run of whitespace, which ends before the
  character left of the cut; and every other alternative stops at a space as it stops
  at the end of the text;
- the model (BPE, without dropout) encodes each pre-token on its own, and the
  normaliser, if any, is NFC, which composes nothing with a space.
The first piece's start is kept as it was (`starts_text`); a cut piece is encoded behind
an added token like any other. Runs are cut at the first such space past every
`SEGMENT_CHARS` characters from the last cut (more, far into a long run), reading from
the start, so two texts that share a start are cut alike within it.

`tests/core/test_tokenizer_pieces.py` checks the equality on generated texts for byte-level
BPE, SentencePiece-style and WordPiece tokenizers, and the cuts between words on the
patterns above; the router also compares a sample of its piecewise results with whole
tokenisation, and stops using pieces on any difference.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

_PROBES = ("a", "Hello, world 123")

SEGMENT_CHARS = 512
"""Text runs are cut between words about this often (see the module doc), and less
often far into a long run: each cut piece costs a cache entry and a hash a prompt, each
character past the last cut that a later prompt shares is tokenised again."""
SEGMENT_GROWTH = 32
"""Past SEGMENT_CHARS * SEGMENT_GROWTH characters into a run, a piece is this fraction
of the way so far: a 1 MB text makes about 170 pieces, not 2,000, and a later prompt that
shares most of it tokenises again at most a 32nd of what they share."""

_GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_SPLIT_PATTERNS = frozenset(
    {
        # Spelled as in these models' tokenizer.json files (as public copies of them,
        # and llama.cpp's and tiktoken ports' tables, spell them); any other spelling,
        # such as GGUF conversions' `(?:'[sS]|...)`, is refused, never cut wrongly.
        # Llama 3 (and Mistral's Tekken)
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        # Qwen 2, 2.5 and 3
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of text between added tokens, or one added token (`token_id` set)."""

    text: str
    token_id: int | None
    starts_text: bool


class PieceTokenizer:
    """Splits texts where the tokenizer does, and encodes the pieces as it would."""

    def __init__(self, backend: Any, added: dict[str, int], sentinel: str) -> None:
        self._backend = backend
        self._added = added
        self._sentinel = sentinel
        self.no_cuts_between_words_reason = _why_not_cut_between_words(backend)
        longest_first = sorted(added, key=len, reverse=True)
        self._cut = re.compile("|".join(re.escape(content) for content in longest_first))
        self.wrap = _special_token_wrap(backend)

    @classmethod
    def of(cls, backend: Any) -> PieceTokenizer | str:
        """A piece tokenizer for this `tokenizers.Tokenizer`, or why it cannot have one."""
        if backend.encode_special_tokens:
            return "it does not extract added tokens (encode_special_tokens)"
        if backend.truncation is not None or backend.padding is not None:
            return "it truncates or pads"
        added: dict[str, int] = {}
        for token_id, token in backend.get_added_tokens_decoder().items():
            if token.normalized or not token.content:
                continue  # matched within a piece, by the piece's own encoding
            if token.lstrip or token.rstrip or token.single_word:
                return f"added token {token.content!r} strips spaces or matches whole words"
            added[token.content] = token_id
        sentinel = next(
            (
                content
                for content, token_id in added.items()
                if not any(other != content and other.startswith(content) for other in added)
                and backend.encode(content, add_special_tokens=False).ids == [token_id]
            ),
            None,
        )
        if sentinel is None:
            return "it has no added token that encodes alone to its own id"
        return cls(backend, added, sentinel)

    def split(self, text: str) -> list[Piece]:
        """The text cut at its added tokens: the runs of text between them, and them."""
        pieces = []
        start = 0
        for match in self._cut.finditer(text):
            if match.start() > start:
                pieces.append(Piece(text[start : match.start()], None, start == 0))
            pieces.append(Piece(match.group(), self._added[match.group()], match.start() == 0))
            start = match.end()
        if start < len(text):
            pieces.append(Piece(text[start:], None, start == 0))
        return pieces

    def segments(self, piece: Piece) -> list[Piece]:
        """A run of text cut between words, where the tokenizer allows it (the module
        doc); [piece] when it is not cut."""
        if self.no_cuts_between_words_reason is not None or piece.token_id is not None:
            return [piece]
        text = piece.text
        segments = []
        start = 0
        for cut in _cuts_between_words(text):
            segments.append(Piece(text[start:cut], None, piece.starts_text and start == 0))
            start = cut
        segments.append(Piece(text[start:], None, piece.starts_text and start == 0))
        return segments

    def encode(self, pieces: Sequence[Piece]) -> list[list[int]]:
        """Each text piece's token ids, as the tokenizer produces them within the text.

        The library's batch call that skips the character offsets: a quarter less work
        than `encode` on any length (offsets are of no use here), and it lets other
        threads run meanwhile, for long new text tokenised in a worker thread."""
        encodings = self._backend.encode_batch_fast(
            [self._input(piece) for piece in pieces], add_special_tokens=False
        )
        return [
            self._ids(piece, encoding) for piece, encoding in zip(pieces, encodings, strict=True)
        ]

    def _input(self, piece: Piece) -> str:
        return piece.text if piece.starts_text else self._sentinel + piece.text

    @staticmethod
    def _ids(piece: Piece, encoding: Any) -> list[int]:
        ids: list[int] = encoding.ids  # a new list at every read: no copy needed
        return ids if piece.starts_text else ids[1:]


def _cuts_between_words(text: str) -> Iterator[int]:
    """Where a run of text is cut: at the first space with no whitespace on either side,
    SEGMENT_CHARS (or a SEGMENT_GROWTH-th of the way into the run, if more) past the last
    cut. Each cut depends on the text before it only, so runs that share a start are cut
    alike within it. (Python's isspace() holds for all of Unicode's White_Space, which the
    patterns' whitespace class matches, and for a few characters more: a cut it refuses
    is only a cut not made.)"""
    at = SEGMENT_CHARS
    while at < len(text) - 1:
        space = text.find(" ", at, len(text) - 1)
        if space < 0:
            return
        if not text[space - 1].isspace() and not text[space + 1].isspace():
            yield space
            at = space + max(SEGMENT_CHARS, space // SEGMENT_GROWTH)
        else:
            at = space + 1


def _why_not_cut_between_words(backend: Any) -> str | None:
    """None when a text run may be cut between words (the module doc's conditions)."""
    if type(backend.model).__name__ != "BPE" or backend.model.dropout:
        return "its model is not BPE without dropout"
    normalizer = backend.normalizer
    if normalizer is not None and json.loads(normalizer.__getstate__()) != {"type": "NFC"}:
        return "it normalises other than NFC"
    pre_tokenizer = backend.pre_tokenizer
    state = json.loads(pre_tokenizer.__getstate__()) if pre_tokenizer is not None else {}
    if _is(state, _GPT2_BYTE_LEVEL):
        return None
    steps = state.get("pretokenizers", []) if state.get("type") == "Sequence" else []
    if (
        len(steps) == 2
        and _is(steps[0], {"type": "Split", "behavior": "Isolated", "invert": False})
        and steps[0].get("pattern", {}).get("Regex") in _SPLIT_PATTERNS
        and _is(steps[1], {**_GPT2_BYTE_LEVEL, "use_regex": False})
    ):
        return None
    return "its pre-tokenizer is not one whose splits are known to fall between words"


def _is(state: dict[str, Any], wanted: dict[str, Any]) -> bool:
    return all(state.get(name) == value for name, value in wanted.items())


def _special_token_wrap(backend: Any) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a single text when special
    tokens are added (BOS for Llama-like tokenizers), if it does no more than that."""
    wraps = set()
    for probe in _PROBES:
        try:
            bare = list(backend.encode(probe, add_special_tokens=False).ids)
            full = list(backend.encode(probe, add_special_tokens=True).ids)
        except Exception:  # the tokenizers library raises plain Exception (no unknown token)
            return None
        at = next(
            (i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare),
            None,
        )
        if not bare or at is None:
            return None
        wraps.add((tuple(full[:at]), tuple(full[at + len(bare) :])))
    if len(wraps) != 1:
        return None
    before, after = wraps.pop()
    return list(before), list(after)
