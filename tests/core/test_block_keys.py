"""The block-key scheme: published vectors, chaining, namespaces and bad input."""

from __future__ import annotations

import array
import json
import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvplane.core.keys import SCHEME_VERSION, KeyNamespace, block_keys, chain_keys, root_key

VECTORS = json.loads((Path(__file__).parents[2] / "docs" / "block-key-vectors.json").read_text())


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["name"])
def test_published_vectors(vector: dict[str, object]) -> None:
    namespace = KeyNamespace(
        model=str(vector["model"]),
        lora=str(vector["lora"]),
        cache_scope=str(vector["cache_scope"]),
        block_size=int(str(vector["block_size"])),
    )
    tokens = vector["tokens"]
    assert isinstance(tokens, list)
    assert root_key(namespace) == vector["root"]
    assert block_keys(tokens, namespace) == vector["keys"]


def test_vectors_are_for_this_scheme() -> None:
    assert VECTORS["scheme_version"] == SCHEME_VERSION


def test_namespaces_never_share_keys() -> None:
    tokens = list(range(64))
    namespaces = [
        KeyNamespace(model="m", block_size=16),
        KeyNamespace(model="m2", block_size=16),
        KeyNamespace(model="m", block_size=16, lora="adapter"),
        KeyNamespace(model="m", block_size=16, cache_scope="tenant"),
        # Length-prefixed fields: moving a character between fields changes the root.
        KeyNamespace(model="m", block_size=16, lora="a", cache_scope="b"),
        KeyNamespace(model="m", block_size=16, lora="ab", cache_scope=""),
    ]
    all_keys = [set(block_keys(tokens, ns)) for ns in namespaces]
    for i, keys in enumerate(all_keys):
        for other in all_keys[i + 1 :]:
            assert not keys & other


tokens_strategy = st.lists(st.integers(0, 2**32 - 1), max_size=200)


@given(tokens=tokens_strategy, split=st.integers(0, 12), block_size=st.integers(1, 17))
def test_chain_continues_from_any_block_boundary(
    tokens: list[int], split: int, block_size: int
) -> None:
    namespace = KeyNamespace(model="m", block_size=block_size)
    whole = block_keys(tokens, namespace)
    cut = min(split, len(whole)) * block_size
    head = block_keys(tokens[:cut], namespace)
    parent = head[-1] if head else root_key(namespace)
    assert head + chain_keys(parent, tokens[cut:], block_size) == whole


@given(tokens=tokens_strategy, extra=st.lists(st.integers(0, 2**32 - 1), max_size=15))
def test_partial_trailing_block_has_no_key(tokens: list[int], extra: list[int]) -> None:
    namespace = KeyNamespace(model="m", block_size=16)
    full = tokens[: len(tokens) // 16 * 16]
    assert block_keys(full + extra, namespace) == block_keys(full, namespace)
    assert len(block_keys(full, namespace)) == len(full) // 16


def test_a_changed_token_changes_its_block_and_every_later_one() -> None:
    namespace = KeyNamespace(model="m", block_size=4)
    tokens = list(range(20))
    changed = tokens.copy()
    changed[9] = 999
    before, after = block_keys(tokens, namespace), block_keys(changed, namespace)
    assert before[:2] == after[:2]
    assert all(a != b for a, b in zip(before[2:], after[2:], strict=True))


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([-1], "token ids must be in"),
        ([2**32], "token ids must be in"),
        (["7"], "integers"),
        (b"\x01\x00\x00\x00", "not bytes"),
    ],
)
def test_bad_tokens_are_refused(tokens: list[object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        block_keys(tokens, KeyNamespace(model="m", block_size=1))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "", "block_size": 16}, "model must not be empty"),
        ({"model": "m", "block_size": 0}, "block_size must be in"),
        ({"model": "m", "block_size": 16, "scheme_version": SCHEME_VERSION + 1}, "not supported"),
    ],
)
def test_bad_namespaces_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KeyNamespace(**kwargs)  # type: ignore[arg-type]


def test_bad_parent_is_refused() -> None:
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        chain_keys(2**64, [1, 2], 2)


def _chain_in_python(parent: int, tokens: list[int], block_size: int) -> list[int]:
    """The scheme as docs/block-keys.md writes it, one block at a time."""
    keys, previous = [], parent
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        block = struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
        previous = xxh3_64_intdigest(struct.pack("<Q", previous) + block)
        keys.append(previous)
    return keys


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300),
    parent=st.integers(0, 2**64 - 1),
    block_size=st.sampled_from([1, 2, 3, 16, 64, 1025, 1100]),
)
def test_the_native_chain_is_the_scheme_for_every_form_of_tokens(
    tokens: list[int], parent: int, block_size: int
) -> None:
    # 1025 tokens and up are hashed from a heap buffer rather than the stack's.
    tokens = tokens * (1 + 2 * block_size // (len(tokens) + 1))
    expected = _chain_in_python(parent, tokens, block_size)
    for form in (tokens, tuple(tokens), array.array("I", tokens)):
        assert chain_keys(parent, form, block_size) == expected  # type: ignore[arg-type]
