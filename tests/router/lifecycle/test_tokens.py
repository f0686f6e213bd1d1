"""The proxy's tokenisation: the model's tokenizer, the cache of identical prompts and
the cache of prompt pieces."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizerFast

from kvplane.core.config import ProxySettings
from kvplane.core.tokenizer import DEFAULT_TOKENIZER_DIR, load_tokenizer
from router.lifecycle.bodies import Endpoint, ParsedRequest, parse_body
from router.lifecycle.tokens import (
    CHECKED_FIRST_USES,
    DEFERRED_REST_SHARE,
    MAX_PIECES,
    MIN_CACHED_PIECE_CHARS,
    OFF_LOOP_CHARS,
    PromptTokens,
    TokenCache,
    piece_key,
    tokenisation_key,
)

MESSAGES = [{"role": "user", "content": "What does the cache remember?"}]
SYSTEM = "You are a helpful assistant. Answer the question below in one short paragraph. " * 8
FIRST_TURN = [{"role": "system", "content": SYSTEM}, *MESSAGES]
SECOND_TURN = [
    *FIRST_TURN,
    {"role": "assistant", "content": "What the model has already read, block by block. " * 4},
    {"role": "user", "content": "And what does it forget?"},
]


def request(endpoint: Endpoint = Endpoint.CHAT, **body: Any) -> ParsedRequest:
    fields = {"model": "m", **body}
    if endpoint is Endpoint.CHAT:
        fields.setdefault("messages", MESSAGES)
    else:
        fields.setdefault("prompt", "hello")
    return parse_body(msgspec.json.encode(fields), endpoint)


def test_the_key_covers_everything_tokenisation_reads() -> None:
    base = tokenisation_key(request(), "")
    assert tokenisation_key(request(), "") == base
    assert tokenisation_key(request(), "a-tenants-salt") != base  # no hits across scopes
    assert tokenisation_key(request(max_tokens=9, temperature=0.5), "") == base  # not read
    assert tokenisation_key(request(model="other"), "") != base
    assert tokenisation_key(request(add_generation_prompt=False), "") != base
    assert tokenisation_key(request(chat_template_kwargs={"x": 1}), "") != base
    assert tokenisation_key(request(tools=[{"type": "function"}]), "") != base
    assert tokenisation_key(request(messages=[{"role": "user", "content": "?"}]), "") != base
    assert tokenisation_key(request(Endpoint.COMPLETIONS), "") != base


def test_the_cache_evicts_the_least_recently_used_within_its_token_budget() -> None:
    cache = TokenCache(max_tokens=10)
    cache.put(b"a", [1, 2, 3, 4])
    cache.put(b"b", [5, 6, 7, 8])
    assert cache.get(b"a") is not None  # a is now the most recently used
    cache.put(b"c", [9, 10, 11])
    assert cache.get(b"b") is None
    assert list(cache.get(b"a") or []) == [1, 2, 3, 4]
    assert cache.tokens == 7
    cache.put(b"huge", list(range(11)))  # larger than the budget: returned, not kept
    assert cache.get(b"huge") is None
    assert (cache.hits, cache.misses) == (2, 2)


async def test_identical_prompts_are_tokenised_once_and_alike() -> None:
    tokens = PromptTokens(ProxySettings())
    first = await tokens.of(request(), "")
    again = await tokens.of(request(max_tokens=3), "")
    assert first is not None
    assert list(first) == load_tokenizer().chat_tokens(MESSAGES)
    assert again is first
    assert tokens.cache.hits == 1


async def test_a_long_prompt_is_tokenised_off_the_loop_with_the_same_result() -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 400
    assert len(text) > OFF_LOOP_CHARS
    tokens = PromptTokens(ProxySettings(token_cache_tokens=0))
    long = await tokens.of(request(Endpoint.COMPLETIONS, prompt=text), "")
    assert long is not None
    assert list(long) == load_tokenizer().completion_tokens(text)
    assert tokens.cache.tokens == 0  # a budget of 0 keeps nothing


async def test_a_growing_conversation_tokenises_only_its_new_text() -> None:
    tokenizer = load_tokenizer()
    tokens = PromptTokens(ProxySettings())
    await tokens.of(request(messages=FIRST_TURN), "")
    before = tokens.stats()
    second = await tokens.of(request(messages=SECOND_TURN), "")
    after = tokens.stats()

    assert second is not None
    assert list(second) == tokenizer.chat_tokens(SECOND_TURN)
    system_piece = tokenizer.encode("<|system|>\n" + SYSTEM, add_special_tokens=False)[1:]
    assert after.piece_tokens_reused - before.piece_tokens_reused == len(system_piece)
    tokenised = after.piece_tokens_tokenised - before.piece_tokens_tokenised
    assert 0 < tokenised < len(second) - len(system_piece)
    assert after.piecewise_checks == 2
    assert after.piecewise_differences == 0


LONG_SYSTEM = SYSTEM * 4  # the start a conversation's later turns share
NEXT_QUESTION = "Which blocks does it keep when memory runs short, and for how long? " * 2
FOLLOW_UP = [
    {"role": "system", "content": LONG_SYSTEM},
    {"role": "user", "content": "What does the cache remember?"},
    {"role": "assistant", "content": "What the model has already read. " * 2},
    {"role": "user", "content": NEXT_QUESTION},
]


async def _past_the_checked_uses(tokens: PromptTokens) -> None:
    """Spend the first uses, whose piecewise results are compared with whole ones."""
    for use in range(CHECKED_FIRST_USES):
        await tokens.of(request(messages=[{"role": "user", "content": f"warm-up {use}"}]), "")


async def test_a_prompt_with_a_short_new_end_comes_as_its_start_and_its_rest() -> None:
    tokenizer = load_tokenizer()
    tokens = PromptTokens(ProxySettings())
    await _past_the_checked_uses(tokens)
    await tokens.of(request(messages=FOLLOW_UP[:2]), "")  # the system prompt seen
    whole = tokenizer.chat_tokens(FOLLOW_UP)

    start = await tokens.start(request(messages=FOLLOW_UP), "", defer_rest=True)

    assert start is not None
    assert start.rest is not None
    assert 0 < len(start.ids) < len(whole) <= start.most_tokens
    assert list(start.ids) == whole[: len(start.ids)]
    assert abs(start.estimated_tokens - len(whole)) < (len(whole) - len(start.ids)) / 2
    assert list(start.rest()) == whole
    # The rest is in the caches now: the same prompt again comes whole.
    again = await tokens.start(request(messages=FOLLOW_UP), "", defer_rest=True)
    assert again is not None
    assert again.rest is None
    assert list(again.ids) == whole


async def test_a_prompt_comes_whole_where_its_rest_may_not_wait() -> None:
    tokenizer = load_tokenizer()
    tokens = PromptTokens(ProxySettings())
    assert (await tokens.start(request(messages=FOLLOW_UP), "", defer_rest=True)) is not None
    # Among the first uses, every result is compared with whole tokenisation first.
    checked = await tokens.start(request(messages=FOLLOW_UP[:3]), "", defer_rest=True)
    assert checked is not None
    assert checked.rest is None
    await _past_the_checked_uses(tokens)
    await tokens.of(request(messages=FOLLOW_UP[:2]), "")
    # A new end longer than a quarter of the prompt: a replica seeing a conversation
    # mid-way, whose history is the larger part.
    long_end = [*FOLLOW_UP[:3], {"role": "user", "content": NEXT_QUESTION * 8}]
    assert tokenizer.render_chat(long_end).count(NEXT_QUESTION) * len(NEXT_QUESTION) * (
        DEFERRED_REST_SHARE
    ) > len(tokenizer.render_chat(long_end))
    whole = await tokens.start(request(messages=long_end), "", defer_rest=True)
    assert whole is not None
    assert whole.rest is None
    assert list(whole.ids) == tokenizer.chat_tokens(long_end)
    # A rest that could take the prompt past its limit: counted now.
    near_limit = _asking(FOLLOW_UP, "Once more?")
    exact = tokenizer.chat_tokens(near_limit)
    within = await tokens.start(request(messages=near_limit), "", len(exact), defer_rest=True)
    assert within is not None
    assert within.rest is None
    assert list(within.ids) == exact
    # of() never leaves a rest.
    other = _asking(FOLLOW_UP, "And twice?")
    assert list(await tokens.of(request(messages=other), "") or []) == (
        tokenizer.chat_tokens(other)
    )
    deferred = await tokens.start(
        request(messages=_asking(FOLLOW_UP, "Thrice?")), "", defer_rest=True
    )
    assert deferred is not None
    assert deferred.rest is not None


def _asking(messages: list[dict[str, str]], more: str) -> list[dict[str, str]]:
    last = messages[-1]
    return [*messages[:-1], {**last, "content": last["content"] + more}]


async def test_pieces_are_reused_within_their_scope_only() -> None:
    tokens = PromptTokens(ProxySettings())
    await tokens.of(request(messages=FIRST_TURN), "a-tenants-salt")
    await tokens.of(request(messages=SECOND_TURN), "another-tenants-salt")
    assert tokens.stats().piece_tokens_reused == 0


async def test_a_piecewise_result_that_differs_turns_pieces_off_for_that_tokenizer() -> None:
    tokenizer = load_tokenizer()
    assert tokenizer.pieces is not None
    tokens = PromptTokens(ProxySettings())
    text = tokenizer.render_chat(FIRST_TURN)
    system = next(
        piece for piece in tokenizer.pieces.split(text) if len(piece.text) >= MIN_CACHED_PIECE_CHARS
    )
    tokens.pieces.put(piece_key("", system), [7, 7, 7])  # a corrupted entry

    first = await tokens.of(request(messages=FIRST_TURN), "")
    second = await tokens.of(request(messages=SECOND_TURN), "")

    assert first is not None
    assert list(first) == tokenizer.chat_tokens(FIRST_TURN)  # the whole result wins
    assert second is not None
    assert list(second) == tokenizer.chat_tokens(SECOND_TURN)
    stats = tokens.stats()
    assert stats.piecewise_differences == 1
    assert stats.piece_tokens_reused == 3  # the corrupted entry's, and nothing after it
    assert stats.piecewise_checks == 1


async def test_completions_prompts_get_the_tokenizers_special_tokens_piecewise() -> None:
    tokenizer = load_tokenizer()
    tokens = PromptTokens(ProxySettings())
    for question in ("What does the cache remember?", "And what does it forget?"):
        prompt = f"<|system|>\n{SYSTEM}</s>\n{question}"
        ids = await tokens.of(request(Endpoint.COMPLETIONS, prompt=prompt), "")
        assert ids is not None
        assert list(ids) == tokenizer.completion_tokens(prompt)
    stats = tokens.stats()
    assert stats.piece_tokens_reused > 0
    assert stats.piecewise_differences == 0


async def test_a_long_text_that_starts_as_an_earlier_one_reuses_that_start() -> None:
    """No added token in it (a document, a completions prompt): reused all the same, cut
    between words (kvplane.core.tokenizer_pieces)."""
    tokenizer = load_tokenizer()
    tokens = PromptTokens(ProxySettings())
    document = "The quick brown fox jumps over the lazy dog. " * 100  # 4,500 characters
    for question in ("What did the fox do?", "And the dog?"):
        prompt = document + question
        ids = await tokens.of(request(Endpoint.COMPLETIONS, prompt=prompt), "")
        assert ids is not None
        assert list(ids) == tokenizer.completion_tokens(prompt)
    stats = tokens.stats()
    assert stats.piece_tokens_reused > 0.8 * len(tokenizer.completion_tokens(document))
    assert stats.piecewise_differences == 0
    # Kept both ways: the run whole (a prompt seen before costs one lookup) and its cuts.
    assert tokenizer.pieces is not None
    (run,) = tokenizer.pieces.split(document + "And the dog?")
    segments = tokenizer.pieces.segments(run)
    assert len(segments) > 1
    for piece in (run, *segments[:-1]):
        assert tokens.pieces.get(piece_key("", piece)) is not None


async def test_a_tokenizer_whose_cut_would_move_is_tokenised_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # eats the space before
    PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", chat_template="{{ 'x' }}"
    ).save_pretrained(str(tmp_path))
    tokens = PromptTokens(ProxySettings(tokenizer_dir=tmp_path))
    with caplog.at_level(logging.INFO, logger="router.lifecycle.tokens"):
        tokens.tokenizers.preload()
    assert "tokenised whole" in caplog.text
    assert "strips spaces" in caplog.text

    prompt = SYSTEM + " <mask> " + SYSTEM
    ids = await tokens.of(request(Endpoint.COMPLETIONS, prompt=prompt), "")
    assert ids is not None
    assert list(ids) == load_tokenizer(tmp_path).completion_tokens(prompt)
    assert tokens.stats().piece_tokens_tokenised == 0  # no pieces


async def test_a_prompt_stuffed_with_added_tokens_is_tokenised_whole() -> None:
    prompt = "<s>a" * (MAX_PIECES // 2 + 1)  # two pieces each
    tokens = PromptTokens(ProxySettings())
    ids = await tokens.of(request(Endpoint.COMPLETIONS, prompt=prompt), "")
    assert ids is not None
    assert list(ids) == load_tokenizer().completion_tokens(prompt)
    assert tokens.stats().piece_tokens_tokenised == 0
