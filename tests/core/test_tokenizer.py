"""The default tokenizer is reproducible, and any Hugging Face tokenizer directory works."""

from __future__ import annotations

import copy
import filecmp
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvplane.core.tokenizer import (
    CUT_SLACK_TOKENS,
    DEFAULT_TOKENIZER_DIR,
    MIN_COUNT_CHUNK_CHARS,
    build_default_tokenizer,
    load_tokenizer,
)
from tests.simulations.engine_sim.conftest import engine_sim


def test_the_shipped_tokenizer_is_what_the_build_produces(tmp_path: Path) -> None:
    build_default_tokenizer(tmp_path)
    shipped = sorted(path.name for path in DEFAULT_TOKENIZER_DIR.iterdir())
    assert sorted(path.name for path in tmp_path.iterdir()) == shipped
    _, mismatch, errors = filecmp.cmpfiles(DEFAULT_TOKENIZER_DIR, tmp_path, shipped, shallow=False)
    assert not errors
    assert not mismatch, "run build_default_tokenizer(DEFAULT_TOKENIZER_DIR)"


def test_completions_get_bos_and_chat_uses_the_template_once() -> None:
    tokenizer = load_tokenizer()
    prompt = tokenizer.completion_tokens("Hello there")
    assert prompt[0] == 1  # <s>
    assert tokenizer.completion_tokens([5, 6, 7]) == [5, 6, 7]
    chat = tokenizer.chat_tokens([{"role": "user", "content": "Hello there"}])
    assert chat.count(1) == 1  # the template writes BOS; encoding adds no second one
    assert "Hello there" in tokenizer.decode(chat)
    without = tokenizer.chat_tokens(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=False
    )
    assert chat[: len(without)] == without
    assert len(chat) > len(without)


def write_word_tokenizer(directory: Path, *, chat_template: str | None) -> None:
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "user": 4, ":": 5}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=word_level,
        unk_token="[UNK]",
        eos_token="</s>",
        chat_template=chat_template,
    ).save_pretrained(str(directory))


async def test_the_simulator_serves_with_another_tokenizer_directory(tmp_path: Path) -> None:
    write_word_tokenizer(
        tmp_path,
        chat_template="{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}",
    )
    async with (
        engine_sim(tokenizer=tmp_path) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        completion = await client.post(
            "/v1/completions", json={"prompt": "hello world hello", "max_tokens": 2}
        )
        chat = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
        )
    assert completion.json()["usage"]["prompt_tokens"] == 3
    assert chat.json()["usage"]["prompt_tokens"] == 3  # user : hello


async def test_a_tokenizer_without_a_chat_template_refuses_chat(tmp_path: Path) -> None:
    write_word_tokenizer(tmp_path, chat_template=None)
    async with (
        engine_sim(tokenizer=tmp_path) as sim,
        httpx.AsyncClient(base_url=sim.base_url) as client,
    ):
        chat = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]}
        )
    assert chat.status_code == 400
    assert "chat template" in chat.json()["error"]["message"]


def test_a_missing_tokenizer_directory_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer directory"):
        load_tokenizer(tmp_path / "missing")


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(
        st.sampled_from(["the", "cache", " ", "\n", "blocks", "<s>", "é", "0123", "==", "  "]),
        min_size=1,
        max_size=3000,
    ),
    limit=st.integers(min_value=1, max_value=40_000),
)
def test_counting_past_a_limit_never_finds_more_tokens_than_there_are(
    words: list[str], limit: int
) -> None:
    tokenizer = load_tokenizer()
    text = "".join(words) * 8  # up to about 100k characters: several chunks, several cuts
    tokens = len(tokenizer.encode(text, add_special_tokens=False))
    past = tokenizer.counts_past(text, limit)
    if past is None:
        # Within the limit by the count; slack per cut may hide up to that much more.
        assert tokens <= limit + CUT_SLACK_TOKENS * (len(text) // MIN_COUNT_CHUNK_CHARS + 1)
    else:
        assert limit < past <= tokens


def test_counting_stops_once_past_the_limit() -> None:
    tokenizer = load_tokenizer()
    chunk = "blocks of sixteen tokens " * 1000  # about 25k characters
    seen: list[int] = []
    encode = tokenizer.encode

    def counting_encode(text: str, *, add_special_tokens: bool) -> list[int]:
        seen.append(len(text))
        return encode(text, add_special_tokens=add_special_tokens)

    tokenizer_copy = copy.copy(tokenizer)
    tokenizer_copy.encode = counting_encode  # type: ignore[method-assign]
    huge = chunk * 400  # 10 MB
    past = tokenizer_copy.counts_past(huge, 8192)
    assert past is not None
    assert past > 8192
    assert sum(seen) < 4 * MIN_COUNT_CHUNK_CHARS  # a few chunks read, not 10 MB


_THREADS_AFTER_TOKENISING = """
import os
from kvplane.core.tokenizer import load_tokenizer
tokenizer = load_tokenizer()
before = len(os.listdir("/proc/self/task"))
pieces = tokenizer.pieces.split("<|user|>\\nHello there<|assistant|>\\nGeneral Kenobi")
tokenizer.pieces.encode([piece for piece in pieces if piece.token_id is None])
tokenizer.completion_tokens("the whole of a completions prompt")
print(before, len(os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_tokenising_starts_no_thread_pool() -> None:
    # The library's pool would cost a router two spinning threads under load.
    environment = {
        name: value for name, value in os.environ.items() if name != "TOKENIZERS_PARALLELISM"
    }
    counts = subprocess.run(
        [sys.executable, "-c", _THREADS_AFTER_TOKENISING],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    before, after = (int(count) for count in counts)
    assert after == before
