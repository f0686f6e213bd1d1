"""kvplane block keys: the one scheme the router and the agents hash prompts with.

A key names a full block of tokens together with everything before it, so two workers
holding the same key hold the same prefix. Keys are chained:

    key[-1] = root(namespace)
    key[i]  = xxh3_64(key[i-1] as 8 bytes little-endian || block i's tokens as u32 little-endian)

The root folds in everything that must keep two caches apart: the model, the LoRA
adapter, the cache scope (a tenant's cache salt; empty for the shared scope), the block
size and the scheme version. A partial trailing block has no key. The exact byte layout
and test vectors are in docs/block-keys.md; change nothing here without bumping
SCHEME_VERSION.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NewType, cast

import xxhash

from kvplane.core._chain import chain

BlockKey = NewType("BlockKey", int)
"""kvplane's chained key of one full block, in one namespace: what the index stores and
lookups ask for. Engines' own block hashes are a different thing (the agent translates
them) and must never be mixed with these."""

SCHEME_VERSION = 1
_ROOT_TAG = b"kvplane-block-key\x00"
MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as unsigned 32-bit integers

_hash64 = xxhash.xxh3_64_intdigest
_pack_u32 = struct.Struct("<I").pack
_U32_ARRAYS_ARE_LE = sys.byteorder == "little" and array.array("I").itemsize == 4


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything besides the tokens that decides whether two blocks are the same."""

    model: str
    block_size: int
    lora: str = ""
    cache_scope: str = ""
    scheme_version: int = SCHEME_VERSION

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("namespace model must not be empty")
        if not 1 <= self.block_size <= 65536:
            raise ValueError(f"block_size must be in 1..65536, got {self.block_size}")
        if self.scheme_version != SCHEME_VERSION:
            raise ValueError(
                f"key scheme version {self.scheme_version} is not supported "
                f"(this build hashes with version {SCHEME_VERSION})"
            )


def _field(text: str) -> bytes:
    data = text.encode("utf-8")
    return _pack_u32(len(data)) + data


@lru_cache(maxsize=4096)
def root_key(namespace: KeyNamespace) -> BlockKey:
    """The chain's root, key[-1]; cached because every request of a namespace needs it."""
    encoded = (
        _ROOT_TAG
        + _pack_u32(namespace.scheme_version)
        + _pack_u32(namespace.block_size)
        + _field(namespace.model)
        + _field(namespace.lora)
        + _field(namespace.cache_scope)
    )
    return BlockKey(_hash64(encoded))


def tokens_as_u32le(tokens: Sequence[int]) -> bytes:
    """Token ids as the bytes block keys hash: unsigned 32-bit, little-endian."""
    if isinstance(tokens, bytes | bytearray | memoryview):  # array() would take them as packed
        raise ValueError("token ids must be integers, not bytes")
    try:
        packed = array.array("I", tokens)
    except OverflowError:
        raise ValueError(f"token ids must be in 0..{MAX_TOKEN_ID}") from None
    except TypeError:
        raise ValueError("token ids must be integers") from None
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return packed.tobytes()


def chain_keys(parent: BlockKey, tokens: Sequence[int], block_size: int) -> list[BlockKey]:
    """Keys of the full blocks of `tokens`, continuing the chain after `parent`.

    `parent` is the key of the block before tokens[0], or root_key(namespace) when the
    tokens start the prompt. Trailing tokens that do not fill a block are ignored.
    """
    if not 0 <= parent < 2**64:
        raise ValueError("parent key must be an unsigned 64-bit integer")
    if block_size < 1:
        raise ValueError("block_size must be positive")
    # An array('I') is already the bytes the keys hash (the tokenizer's output is one).
    if isinstance(tokens, array.array) and tokens.typecode == "I" and _U32_ARRAYS_ARE_LE:
        data: bytes | array.array[int] = tokens
    else:
        data = tokens_as_u32le(tokens)
    # The hot path of both routing and ingest: one C loop, one XXH3 call per block.
    # BlockKey is an int at run time: a cast, not a call per key.
    return cast(list[BlockKey], chain(parent, data, block_size))


def block_keys(tokens: Sequence[int], namespace: KeyNamespace) -> list[BlockKey]:
    """Keys of every full block of a prompt that starts at token 0."""
    return chain_keys(root_key(namespace), tokens, namespace.block_size)
