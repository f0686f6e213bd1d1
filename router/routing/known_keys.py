"""Block keys of prefixes this router has keyed before: a prompt that shares most of its
tokens with an earlier one pays for its new blocks only.

Keying a prompt costs a step of Python a block (kvplane.core.keys.chain_keys, about a
microsecond each: 2 ms for 32k tokens), which every prompt that merely shares a prefix
with an earlier one would pay again. Here a prompt is cut into segments of
SEGMENT_BLOCKS blocks, and each segment's keys are remembered under a 128-bit hash
chained over the segments before it from the namespace's root key. Like a block key,
a segment's hash names its whole prefix, in its namespace (the tenant's cache scope
included, so no scope finds another's); unlike block keys it costs one hash call for a
whole segment. A prompt takes the keys of its longest run of remembered segments and
keys only the blocks after it: the keys are those chain_keys computes for the same
tokens, or the cache would not have them.
"""

from __future__ import annotations

import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

import xxhash

from kvplane.core.keys import BlockKey, KeyNamespace, chain_keys, root_key, tokens_as_u32le

SEGMENT_BLOCKS = 32
"""Blocks a segment: a prompt keys at most this many blocks of a prefix seen before (the
part of its last segment that the cache holds), and each remembered segment costs one
entry of bookkeeping (about 100 bytes) beside its keys (8 bytes each)."""


class KnownPrefixKeys:
    """Least recently used segments of keyed prompts, up to `max_blocks` keys."""

    def __init__(self, max_blocks: int) -> None:
        self.max_segments = max_blocks // SEGMENT_BLOCKS
        self.reused_blocks = 0  # keys taken from the cache
        self.keyed_blocks = 0  # keys computed
        self._segments: OrderedDict[bytes, array.array[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._segments)

    def keys(self, tokens: Sequence[int], namespace: KeyNamespace) -> list[BlockKey]:
        """The block keys of a prompt that starts at token 0, as block_keys gives them."""
        root = root_key(namespace)
        data = tokens_as_u32le(tokens)
        segment_tokens = SEGMENT_BLOCKS * namespace.block_size
        stride = segment_tokens * 4
        hashes = []
        chained = root.to_bytes(8, "little")
        for start in range(0, (len(tokens) // segment_tokens) * stride, stride):
            chained = xxhash.xxh3_128_digest(chained + data[start : start + stride])
            hashes.append(chained)
        keys: list[int] = []
        for segment_hash in hashes:
            segment = self._segments.get(segment_hash)
            if segment is None:
                break
            keys.extend(segment)
        known = len(keys)
        parent = BlockKey(keys[-1]) if keys else root
        new = chain_keys(parent, tokens[known * namespace.block_size :], namespace.block_size)
        keys.extend(new)
        self.reused_blocks += known
        self.keyed_blocks += len(new)
        if self.max_segments:
            self._remember(hashes, keys)
        return cast(list[BlockKey], keys)

    def _remember(self, hashes: list[bytes], keys: list[int]) -> None:
        """Keep the prompt's segments, its first the most recently used: a segment is
        found only after every one before it, so the deepest go first when the cache is
        full (evicting the first would leave the rest unreachable)."""
        segments = self._segments
        for at in reversed(range(len(hashes))):
            segment_hash = hashes[at]
            if segment_hash in segments:
                segments.move_to_end(segment_hash)
            else:
                segments[segment_hash] = array.array(
                    "Q", keys[at * SEGMENT_BLOCKS : (at + 1) * SEGMENT_BLOCKS]
                )
        while len(segments) > self.max_segments:
            segments.popitem(last=False)
