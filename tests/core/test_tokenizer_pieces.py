"""Piecewise tokenisation equals whole tokenisation, for every kind of tokenizer it
accepts, on generated texts full of added tokens, near-misses of them, spaces, newlines
and non-ASCII text; and the tokenizers whose added tokens move the cut are refused.
Text cut between words too, for the pre-tokenizers that allow it, and only those."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from kvplane.core import tokenizer_pieces
from kvplane.core.tokenizer import DEFAULT_TOKENIZER_DIR
from kvplane.core.tokenizer_pieces import Piece, PieceTokenizer

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|im_start|>x"]
TRAINING = [
    "You are a helpful assistant. Answer the question below in one short paragraph.",
    "The quick brown fox jumps over the lazy dog. 0123456789 ( ) [ ] { } < > |",
    "Grüße aus München, été à Paris, 東京の天気, naïve café résumé.",
    "def f(x):\n    return x * 2\n\n\n  indented\ttabs\r\nend",
]
FRAGMENTS = [
    *SPECIAL,
    "<|im_",
    "<s",
    "s>",
    "|>",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "▁",
    "user",
    "assistant",
    "Hello",
    " world",
    "The quick brown fox",
    "München",
    "東京",
    "été",
    "123",
    "4.5",
    "!?",
    "'s",
    "Ünïcödé",
]


def _trained(
    model: models.Model, trainer: trainers.Trainer, setup: Callable[[Tokenizer], None]
) -> Tokenizer:
    tokenizer = Tokenizer(model)
    setup(tokenizer)
    tokenizer.train_from_iterator(TRAINING, trainer=trainer)
    return tokenizer


def _byte_level_bpe(setup: Callable[[Tokenizer], None], dropout: float | None = None) -> Tokenizer:
    return _trained(
        models.BPE(dropout=dropout),
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
        setup,
    )


def _byte_level(add_prefix_space: bool) -> Tokenizer:
    def setup(tokenizer: Tokenizer) -> None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)

    tokenizer = _byte_level_bpe(setup)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.token_to_id("<s>"))]
    )
    return tokenizer


def _byte_level_with_normalized_added_tokens() -> Tokenizer:
    """Added tokens matched after normalisation are matched within a piece, where they
    may strip spaces or match whole words only: the piece's own encoding does the same."""
    tokenizer = _byte_level(add_prefix_space=False)
    tokenizer.add_tokens(
        [AddedToken(" world", lstrip=True, rstrip=True), AddedToken("user", single_word=True)]
    )
    return tokenizer


def _sentencepiece_like(prepend_scheme: str) -> Tokenizer:
    def setup(tokenizer: Tokenizer) -> None:
        tokenizer.normalizer = normalizers.NFKC()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)

    tokenizer = _trained(
        models.Unigram(),
        trainers.UnigramTrainer(
            vocab_size=300,
            unk_token="<unk>",
            special_tokens=["<unk>", *SPECIAL],
            show_progress=False,
        ),
        setup,
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("<s>", "</s>")],
    )
    return tokenizer


def _wordpiece_lowercase() -> Tokenizer:
    def setup(tokenizer: Tokenizer) -> None:
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()

    tokenizer = _trained(
        models.WordPiece(unk_token="[UNK]"),
        trainers.WordPieceTrainer(
            vocab_size=300, special_tokens=["[UNK]", *SPECIAL], show_progress=False
        ),
        setup,
    )
    # Matched after normalisation, inside a piece: the piece's own encoding finds it.
    tokenizer.add_tokens([AddedToken("Hello", normalized=True)])
    return tokenizer


def _llama_like() -> Tokenizer:
    """SentencePiece converted the Llama 2 way: a normaliser that prepends ▁ to every
    piece and turns spaces into ▁, and byte fallback."""

    def setup(tokenizer: Tokenizer) -> None:
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )

    return _trained(
        models.BPE(byte_fallback=True, unk_token="<unk>"),
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=["<unk>", *SPECIAL], show_progress=False
        ),
        setup,
    )


LLAMA_3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_2_PATTERN = LLAMA_3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def _split_then_byte_level(
    pattern: str, normalizer: normalizers.Normalizer | None = None, dropout: float | None = None
) -> Tokenizer:
    """Llama 3's and Qwen 2's shape: a regular expression's matches, then bytes."""

    def setup(tokenizer: Tokenizer) -> None:
        if normalizer is not None:
            tokenizer.normalizer = normalizer
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return _byte_level_bpe(setup, dropout)


TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {
    "kvplane default": lambda: Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json")),
    "byte-level BPE": lambda: _byte_level(add_prefix_space=False),
    "byte-level BPE, prefix space": lambda: _byte_level(add_prefix_space=True),
    "byte-level BPE, normalized added tokens": _byte_level_with_normalized_added_tokens,
    "SentencePiece, space first only": lambda: _sentencepiece_like("first"),
    "SentencePiece, space always": lambda: _sentencepiece_like("always"),
    "WordPiece, lowercase": _wordpiece_lowercase,
    "Llama-like": _llama_like,
    "Llama 3 split": lambda: _split_then_byte_level(LLAMA_3_PATTERN),
    "Qwen 2 split, NFC": lambda: _split_then_byte_level(QWEN_2_PATTERN, normalizers.NFC()),
}
CUT_BETWEEN_WORDS = ("kvplane default", "byte-level BPE", "Llama 3 split", "Qwen 2 split, NFC")
texts = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=6), max_size=40).map("".join)
# Words, and what may stand next to a space: whitespace of every kind Unicode has (and
# Python's isspace() adds), punctuation, digits, contractions, combining marks.
WORDY = [
    *FRAGMENTS,
    "word",
    " word",
    " ",
    " ",
    "\u00a0",
    "\u3000",
    "\u2028",
    "\x1c",
    "\x85",
    "\u0301",
    "e\u0301",
    " '",
    "'ll",
    " 12345",
    ".",
    " .",
    "-",
    "\r\n",
]
wordy_texts = st.lists(st.sampled_from(WORDY) | st.text(max_size=4), max_size=60).map("".join)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_pieces_encode_to_exactly_what_the_whole_text_encodes_to(name: str) -> None:
    backend = TOKENIZERS[name]()
    pieces = PieceTokenizer.of(backend)
    assert isinstance(pieces, PieceTokenizer), pieces

    @settings(max_examples=150, deadline=None)
    @given(text=texts)
    def check(text: str) -> None:
        split = pieces.split(text)
        assert "".join(piece.text for piece in split) == text
        encoded = iter(pieces.encode([piece for piece in split if piece.token_id is None]))
        joined = []
        for piece in split:
            joined += [piece.token_id] if piece.token_id is not None else next(encoded)
        assert joined == backend.encode(text, add_special_tokens=False).ids
        if pieces.wrap is not None:
            before, after = pieces.wrap
            assert before + joined + after == backend.encode(text, add_special_tokens=True).ids

    check()


def cut_between_words(pieces: PieceTokenizer, text: str) -> list[Piece]:
    """The text cut at its added tokens, and each run between them between words."""
    return [segment for piece in pieces.split(text) for segment in pieces.segments(piece)]


@pytest.mark.parametrize("name", CUT_BETWEEN_WORDS)
def test_text_cut_between_words_encodes_to_exactly_the_whole_text(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokenizer_pieces, "SEGMENT_CHARS", 2)  # a cut at every chance
    backend = TOKENIZERS[name]()
    pieces = PieceTokenizer.of(backend)
    assert isinstance(pieces, PieceTokenizer), pieces
    assert pieces.no_cuts_between_words_reason is None
    cut = 0

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(text=wordy_texts)
    def check(text: str) -> None:
        nonlocal cut
        split = cut_between_words(pieces, text)
        assert "".join(piece.text for piece in split) == text
        text_pieces = [piece for piece in split if piece.token_id is None]
        cut += sum(piece.text.startswith(" ") and not piece.starts_text for piece in text_pieces)
        joined = []
        encoded = iter(pieces.encode(text_pieces))
        for piece in split:
            joined += [piece.token_id] if piece.token_id is not None else next(encoded)
        assert joined == backend.encode(text, add_special_tokens=False).ids

    check()
    assert cut > 30  # the texts were cut between words, often


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: _byte_level(add_prefix_space=True), "pre-tokenizer"),
        (lambda: _sentencepiece_like("first"), "not BPE"),
        (_wordpiece_lowercase, "not BPE"),
        (_llama_like, "normalises"),
        (lambda: _split_then_byte_level(r"\S+|\s+"), "pre-tokenizer"),
        (lambda: _split_then_byte_level(LLAMA_3_PATTERN, normalizers.NFKC()), "normalises"),
        (lambda: _split_then_byte_level(LLAMA_3_PATTERN, dropout=0.1), "dropout"),
    ],
)
def test_text_is_cut_between_words_only_where_that_is_proven_exact(
    make: Callable[[], Tokenizer], reason: str
) -> None:
    pieces = PieceTokenizer.of(make())
    assert isinstance(pieces, PieceTokenizer), pieces
    assert reason in (pieces.no_cuts_between_words_reason or "")
    long_text = "word " * 400
    assert [piece.text for piece in cut_between_words(pieces, long_text)] == [long_text]


def test_texts_that_share_a_start_are_cut_alike_within_it() -> None:
    pieces = PieceTokenizer.of(Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json")))
    assert isinstance(pieces, PieceTokenizer)
    shared = " ".join(f"word{number}" for number in range(1000))  # about 8,900 characters
    first = cut_between_words(pieces, shared + " and then one ending")
    second = cut_between_words(pieces, shared + " but another")
    assert len(first) > 10
    assert [piece.text for piece in first[:-1]] == [piece.text for piece in second[:-1]]
    assert all(len(piece.text) >= tokenizer_pieces.SEGMENT_CHARS for piece in first[:-1])


def test_a_long_text_is_cut_less_often_far_into_it() -> None:
    """A megabyte of text in a few hundred pieces at most (the router tokenises a prompt
    of more than 1,024 pieces whole)."""
    pieces = PieceTokenizer.of(Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json")))
    assert isinstance(pieces, PieceTokenizer)
    split = cut_between_words(pieces, "word " * 200_000)
    assert 100 < len(split) < 200
    assert len(split[-2].text) > 20 * len(split[0].text)


def test_the_post_processors_wrap_is_read_off_the_tokenizer() -> None:
    byte_level = PieceTokenizer.of(_byte_level(add_prefix_space=False))
    assert isinstance(byte_level, PieceTokenizer)
    assert byte_level.wrap == ([SPECIAL.index("<s>")], [])
    sentencepiece = PieceTokenizer.of(_sentencepiece_like("first"))
    assert isinstance(sentencepiece, PieceTokenizer)
    assert sentencepiece.wrap is not None
    assert [len(part) for part in sentencepiece.wrap] == [1, 1]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda t: t.add_special_tokens([AddedToken("<mask>", lstrip=True)]), "strips spaces"),
        (
            lambda t: t.add_tokens([AddedToken("word", single_word=True, normalized=False)]),
            "whole words",
        ),
        (lambda t: setattr(t, "encode_special_tokens", True), "encode_special_tokens"),
        (lambda t: t.enable_truncation(16), "truncates"),
    ],
)
def test_tokenizers_whose_cut_moves_are_refused(
    change: Callable[[Tokenizer], object], reason: str
) -> None:
    backend = _byte_level(add_prefix_space=False)
    change(backend)
    refusal = PieceTokenizer.of(backend)
    assert isinstance(refusal, str)
    assert reason in refusal


def test_a_tokenizer_without_added_tokens_is_refused() -> None:
    bare = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    refusal = PieceTokenizer.of(bare)
    assert isinstance(refusal, str)
    assert "no added token" in refusal
