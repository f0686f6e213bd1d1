"""The engine's own block hash, computed as vLLM computes it.

SHA-256 over the pickled tuple (parent hash, block token ids, extra keys), chained from a
root `NONE_HASH`; on the wire the hash is the digest's low 64 bits. It is deliberately NOT
kvplane's block key (`kvplane.core.keys`): agents must translate the engine's hashes into
kvplane keys, as they must for real engines, and nothing in kvplane may rely on them.

Extra keys follow vLLM: the LoRA name on every block, then the cache salt on the first
block only, which changes every later hash through the chain. A block without extra keys
hashes `None` in their place.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

ExtraKeys = tuple[str, ...] | None


def none_hash(seed: str = "") -> bytes:
    """The parent hash of a chain's first block. vLLM derives it from PYTHONHASHSEED (or a
    fixed string); a different seed makes replicas hash the same prompt differently."""
    return hashlib.sha256(f"kvplane-engine-sim:{seed}".encode()).digest()


def block_extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> ExtraKeys:
    keys: list[str] = []
    if lora_name:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: ExtraKeys) -> bytes:
    """The 32-byte digest of one full block."""
    payload = pickle.dumps((parent, tuple(token_ids), extra_keys), protocol=5)
    return hashlib.sha256(payload).digest()


def wire_hash(digest: bytes) -> int:
    """The hash as vLLM sends it by default: the digest's low 64 bits, unsigned."""
    return int.from_bytes(digest[-8:], "big")


class BlockHasher:
    """The chained hashes of one request's full blocks, extended as its tokens grow."""

    __slots__ = ("_cache_salt", "_lora_name", "_root", "block_size", "digests")

    def __init__(
        self, block_size: int, root: bytes, lora_name: str | None, cache_salt: str | None
    ) -> None:
        self.block_size = block_size
        self._root = root
        self._lora_name = lora_name
        self._cache_salt = cache_salt
        self.digests: list[bytes] = []

    def extra_keys(self, block_index: int) -> ExtraKeys:
        return block_extra_keys(block_index, self._lora_name, self._cache_salt)

    def update(self, token_ids: Sequence[int]) -> None:
        """Hash every block of `token_ids` (the request's tokens so far) that is full and
        not hashed yet."""
        size = self.block_size
        for index in range(len(self.digests), len(token_ids) // size):
            parent = self.digests[-1] if self.digests else self._root
            block = token_ids[index * size : (index + 1) * size]
            self.digests.append(hash_block(parent, block, self.extra_keys(index)))
