"""The default tokenizer is reproducible, and any Hugging Face tokenizer directory works."""

from __future__ import annotations

import filecmp
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from kvplane.core.tokenizer import DEFAULT_TOKENIZER_DIR, build_default_tokenizer, load_tokenizer
from tests.engine_sim.conftest import engine_sim


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
