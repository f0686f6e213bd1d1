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
`tests/test_tokenizer_pieces.py` checks the equality on generated texts for byte-level
BPE, SentencePiece-style and WordPiece tokenizers; the router also compares a sample of
its piecewise results with whole tokenisation, and stops using pieces on any difference.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_PROBES = ("a", "Hello, world 123")


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
