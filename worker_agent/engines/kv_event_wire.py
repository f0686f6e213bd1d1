"""Decoding msgpack KV event batches, as vLLM and SGLang publish them, into domain events.

Both engines send `[ts, [event, ...], rank]` (older vLLM: `[ts, [event, ...]]`), and an
event is either a map tagged by `"type"` (vLLM 0.24 and later, SGLang) or a positional
array led by its tag (vLLM before 0.24). The batch is decoded generically and each
event dispatched on its tag; unknown keys and trailing elements are ignored, so newer
engines keep working. What differs between engines (field order of the array form, hash
signedness, where the cache salt is, medium names) is a `WireDialect`, supplied by each
engine's adapter.

Event by event: an event that cannot be used (malformed, of an unknown type, on an
unknown medium, held remotely) is skipped and reported with the batch, and the rest
of the batch goes through. Only a broken envelope (not msgpack, not `[ts, [...]]`)
raises WireDecodeError: the whole message is lost then.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import msgspec

from kvplane.core.types import EVENT_TYPE_PATTERN, SkipReason, Tier
from worker_agent.events import (
    EngineBlockHash,
    EngineBlocksOffloaded,
    EngineBlocksRemoved,
    EngineBlocksStored,
    EngineCacheCleared,
    EngineEvent,
    SkippedEvent,
    WireDecodeError,
)

_U64 = 2**64
_decoder = msgspec.msgpack.Decoder()


@dataclass(frozen=True, slots=True)
class WireDialect:
    """What one engine's events look like on the wire."""

    stored_fields: tuple[str, ...]  # field names of BlockStored's array form, in order
    removed_fields: tuple[str, ...]
    # Medium name, upper case (engines send either case) -> tier; absent: the device.
    mediums: Mapping[str, Tier]
    salt_field: str | None  # where a chain's cache salt is; None: extra_keys[0] (vLLM)


class DecodedBatch(NamedTuple):
    timestamp: float
    events: tuple[EngineEvent, ...]
    skipped: tuple[SkippedEvent, ...] = ()  # events that could not be used


def decode_batch(payload: bytes, dialect: WireDialect) -> DecodedBatch:
    """The batch's timestamp, its usable events and the skipped ones; WireDecodeError
    if its envelope is broken."""
    try:
        batch = _decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as error:
        raise WireDecodeError(f"not msgpack: {type(error).__name__}") from None
    if not isinstance(batch, list) or len(batch) < 2:
        raise WireDecodeError("a batch is an array [ts, events, ...]")
    timestamp, events = batch[0], batch[1]
    if not _is_number(timestamp):
        raise WireDecodeError("the batch timestamp is not a number")
    if not isinstance(events, list):
        raise WireDecodeError("the batch's events are not an array")
    decoded: list[EngineEvent] = []
    skipped: list[SkippedEvent] = []
    for raw in events:
        try:
            decoded.append(_decode_event(raw, dialect))
        except WireDecodeError as error:
            skipped.append(SkippedEvent(_tag_of(raw), error.reason))
    return DecodedBatch(float(timestamp), tuple(decoded), tuple(skipped))


def normalise_hash(value: Any) -> EngineBlockHash:
    """An engine hash as an unsigned 64-bit integer: vLLM sends the low 64 bits unsigned
    or the raw digest as bytes (its last 8 bytes, big-endian); SGLang sends signed."""
    if isinstance(value, bool):
        raise WireDecodeError("a block hash is not a boolean")
    if isinstance(value, int):
        if not -(2**63) <= value < _U64:
            raise WireDecodeError("a block hash is out of 64-bit range")
        return EngineBlockHash(value % _U64)
    if isinstance(value, bytes) and 8 <= len(value) <= 64:
        return EngineBlockHash(int.from_bytes(value[-8:], "big"))
    raise WireDecodeError("a block hash is neither an integer nor a digest")


def _tag_of(raw: Any) -> str:
    """The event's type tag as reported (a metric label and a log word): "?" unless
    it is a short plain name."""
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        tag = None
    return tag if isinstance(tag, str) and EVENT_TYPE_PATTERN.fullmatch(tag) else "?"


def _decode_event(raw: Any, dialect: WireDialect) -> EngineEvent:
    if isinstance(raw, dict):
        tag, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = {
            "BlockStored": dialect.stored_fields,
            "BlockRemoved": dialect.removed_fields,
        }.get(tag, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise WireDecodeError("an event is neither a tagged map nor a tagged array")
    if tag == "BlockStored":
        _refuse_remote(fields)
        return _stored(fields, dialect)
    if tag == "BlockRemoved":
        _refuse_remote(fields)
        return EngineBlocksRemoved(
            block_hashes=_hashes(fields.get("block_hashes")),
            tier=_tier(fields.get("medium"), dialect),
            group_idx=_group(fields.get("group_idx")),
        )
    if tag == "AllBlocksCleared":
        return EngineCacheCleared()
    if isinstance(tag, str):  # an event type from a newer engine: not ours to interpret
        raise WireDecodeError("an event of an unknown type", reason=SkipReason.UNKNOWN_TYPE)
    raise WireDecodeError("an event has no type tag")


def _refuse_remote(fields: Mapping[str, Any]) -> None:
    """A block another node holds (vLLM's `locality`: LOCAL or REMOTE) is not the
    publisher's to claim; a locality that is not plainly local is taken as remote."""
    locality = fields.get("locality")
    if locality is not None and not (isinstance(locality, str) and locality.upper() == "LOCAL"):
        raise WireDecodeError("a block not held locally", reason=SkipReason.REMOTE)


def _stored(
    fields: Mapping[str, Any], dialect: WireDialect
) -> EngineBlocksStored | EngineBlocksOffloaded:
    hashes = _hashes(fields.get("block_hashes"))
    block_size = fields.get("block_size")
    if (  # exactly what vLLM's offloading connector sends: nothing else is guessed at
        fields.get("token_ids") == []
        and type(block_size) is int
        and block_size == 0
        and fields.get("parent_block_hash") is None
    ):
        tier = _tier(fields.get("medium"), dialect)
        if tier is Tier.DEVICE:  # a device block is stored with its tokens, always
            raise WireDecodeError("a store by hash alone on the device")
        return EngineBlocksOffloaded(hashes, tier, _group(fields.get("group_idx")))
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise WireDecodeError("BlockStored has no valid block_size")
    raw_tokens = fields.get("token_ids")
    if not isinstance(raw_tokens, list) or not set(map(type, raw_tokens)) <= {int}:
        raise WireDecodeError("BlockStored token_ids is not an array of integers")
    try:
        # Checked and packed in C: the hot path of ingest (unsigned 32-bit, as the keys).
        tokens = tuple(array("I", raw_tokens))
    except (TypeError, OverflowError):
        raise WireDecodeError("BlockStored token_ids are not token ids") from None
    if len(tokens) != len(hashes) * block_size:
        raise WireDecodeError(
            f"BlockStored has {len(tokens)} tokens for {len(hashes)} blocks of {block_size}"
        )
    parent_raw = fields.get("parent_block_hash")
    parent = None if parent_raw is None else normalise_hash(parent_raw)
    lora_name = _optional_str(fields.get("lora_name"), "lora_name")
    if dialect.salt_field is not None:
        salt_value = fields.get(dialect.salt_field)
        if isinstance(salt_value, dict):  # SGLang 0.5.18-0.5.19: a metadata map there
            salt_value = salt_value.get("cache_salt")
            if not isinstance(salt_value, str):  # on salted stores only: else unknown
                raise WireDecodeError("the metadata map has no cache_salt")
        salt = _optional_str(salt_value, dialect.salt_field)
    else:
        salt = _salt_from_extra_keys(fields.get("extra_keys"), lora_name)
    return EngineBlocksStored(
        block_hashes=hashes,
        parent_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        tier=_tier(fields.get("medium"), dialect),
        lora_name=lora_name or None,
        cache_salt=(salt or None) if parent is None else None,
        group_idx=_group(fields.get("group_idx")),
    )


def _salt_from_extra_keys(extra_keys: Any, lora_name: str | None) -> str | None:
    """vLLM puts a request's extra keys per block: LoRA name, multimodal hashes, then the
    cache salt, the salt on the chain's first block only."""
    if extra_keys is None:
        return None
    if not isinstance(extra_keys, list):
        raise WireDecodeError("BlockStored extra_keys is not an array")
    if not extra_keys or extra_keys[0] is None:
        return None
    first = extra_keys[0]
    if not isinstance(first, list):
        raise WireDecodeError("BlockStored extra_keys entries are not arrays")
    keys = first[1:] if lora_name and first and first[0] == lora_name else first
    return keys[-1] if keys and isinstance(keys[-1], str) else None


def _hashes(value: Any) -> tuple[EngineBlockHash, ...]:
    if not isinstance(value, list) or not value:
        raise WireDecodeError("an event has no block_hashes")
    if set(map(type, value)) == {int}:
        try:  # the usual case (vLLM's unsigned integers), checked in C
            # EngineBlockHash is an int at run time: a cast, not a call per hash.
            return cast(tuple[EngineBlockHash, ...], tuple(array("Q", value)))
        except OverflowError:
            pass  # signed (SGLang) or out of range: one by one
    return tuple(normalise_hash(item) for item in value)


def _tier(medium: Any, dialect: WireDialect) -> Tier:
    if medium is None:
        return Tier.DEVICE  # before vLLM 0.10.2 there was only the device
    tier = (
        dialect.mediums.get(medium.upper())
        if isinstance(medium, str) and medium.isascii()
        else None
    )
    if tier is None:
        raise WireDecodeError("an event names an unknown medium", reason=SkipReason.UNKNOWN_MEDIUM)
    return tier


def _group(value: Any) -> int:
    if value is None:
        return 0  # before vLLM 0.20 there was one group
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**16:
        raise WireDecodeError("group_idx is not a small integer")
    return value


def _optional_str(value: Any, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise WireDecodeError(f"{name} is not a string")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
