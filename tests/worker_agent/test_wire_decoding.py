"""Decoding recorded KV event payloads of every wire form into domain events.

The payloads under `wire_samples/` are committed bytes (written once by
`wire_samples/make_samples.py`); the expected events below are literals, so neither a change
to the simulator's encoder nor to its hashing can move what these tests check.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplane.core.types import SkipReason, Tier
from worker_agent.engines.kv_event_wire import DecodedBatch, normalise_hash
from worker_agent.engines.sglang import SglangAdapter
from worker_agent.engines.vllm import VllmAdapter
from worker_agent.events import (
    EngineBlocksOffloaded,
    EngineBlocksRemoved,
    EngineBlocksStored,
    EngineCacheCleared,
    SkippedEvent,
    WireDecodeError,
)

SAMPLES = Path(__file__).parent / "wire_samples"
U64 = 2**64
VLLM = VllmAdapter()
SGLANG = SglangAdapter()
ADAPTERS = pytest.mark.parametrize("adapter", [VLLM, SGLANG], ids=["vllm", "sglang"])


def sample(name: str) -> bytes:
    return (SAMPLES / f"{name}.bin").read_bytes()


def raw(name: str) -> Any:
    """A sample as plain msgpack data, to check what the recording really holds."""
    return msgspec.msgpack.decode(sample(name))


def encode(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


# The recorded chains: tokens 101..108 in two blocks of 4 from token 0, then 109..112.
HEAD_TOKENS = (101, 102, 103, 104, 105, 106, 107, 108)
TAIL_TOKENS = (109, 110, 111, 112)
HEAD = (5151348261606980278, 14502540186477702890)
TAIL = (799972406473635273,)
SALT_HEAD = (4158410062048822797, 16125344268747469981)
SALT_TAIL = (8474515495750409550,)
LORA_HEAD = (9822852531015447958, 6910877311831736294)
LORA_TAIL = (6070722221880235833,)
# SGLang's signed int64 hashes as sent, and what they normalise to.
SG1, SG2, SG3 = -4573782239871013849, -4924068042662368929, 2177822513761690855
SG1_U, SG2_U = 13872961833838537767, 13522676031047182687


def stored(
    hashes: tuple[int, ...],
    parent: int | None,
    tokens: tuple[int, ...],
    *,
    block_size: int = 4,
    tier: Tier = Tier.DEVICE,
    lora: str | None = None,
    salt: str | None = None,
) -> EngineBlocksStored:
    return EngineBlocksStored(
        block_hashes=hashes,
        parent_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        tier=tier,
        lora_name=lora,
        cache_salt=salt,
    )


PLAIN_CHAIN = (stored(HEAD, None, HEAD_TOKENS), stored(TAIL, HEAD[1], TAIL_TOKENS))


# --- The recorded samples -------------------------------------------------------------------


def test_vllm_0_32_maps_with_int_hashes() -> None:
    assert raw("vllm-0.32-int")[1][0]["block_hashes"] == list(HEAD)
    assert VLLM.decode_batch(sample("vllm-0.32-int"))[:2] == (1754000000.25, PLAIN_CHAIN)


def test_vllm_0_32_maps_with_digest_hashes_reduce_to_their_last_8_bytes() -> None:
    events = raw("vllm-0.32-bytes")[1]
    digests = [*events[0]["block_hashes"], *events[1]["block_hashes"]]
    assert [type(d) for d in digests] == [bytes, bytes, bytes]
    assert [len(d) for d in digests] == [32, 32, 32]
    assert [int.from_bytes(d[-8:], "big") for d in digests] == [*HEAD, *TAIL]
    # The same chain as the int form: vLLM's int hash is the digest's low 64 bits.
    assert VLLM.decode_batch(sample("vllm-0.32-bytes"))[:2] == (1754000000.25, PLAIN_CHAIN)


def test_vllm_0_23_positional_arrays() -> None:
    batch = raw("vllm-0.23")
    assert [event[0] for event in batch[1]] == [
        "BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared",
    ]  # fmt: skip
    assert VLLM.decode_batch(sample("vllm-0.23"))[:2] == (
        1754000001.5,
        (*PLAIN_CHAIN, EngineBlocksRemoved(TAIL, Tier.DEVICE), EngineCacheCleared()),
    )


def test_vllm_0_9_arrays_in_a_batch_without_rank() -> None:
    batch = raw("vllm-0.9")
    assert len(batch) == 2  # [ts, events]: no data-parallel rank yet
    assert len(batch[1][0]) == 6  # no medium, LoRA name or extra keys yet
    assert VLLM.decode_batch(sample("vllm-0.9"))[:2] == (
        1754000002.75,
        (*PLAIN_CHAIN, EngineBlocksRemoved(TAIL, Tier.DEVICE), EngineCacheCleared()),
    )


def test_vllm_salted_chain_has_its_salt_on_the_chain_from_token_0_only() -> None:
    assert raw("vllm-0.32-salt")[1][0]["extra_keys"] == [["tenant-a"], None]
    assert VLLM.decode_batch(sample("vllm-0.32-salt"))[:2] == (
        1754000003.0,
        (
            stored(SALT_HEAD, None, HEAD_TOKENS, salt="tenant-a"),
            stored(SALT_TAIL, SALT_HEAD[1], TAIL_TOKENS),
        ),
    )


def test_vllm_lora_and_salted_chain_separates_lora_name_from_salt() -> None:
    assert raw("vllm-0.32-lora-salt")[1][0]["extra_keys"] == [["sql", "tenant-a"], ["sql"]]
    assert VLLM.decode_batch(sample("vllm-0.32-lora-salt"))[:2] == (
        1754000004.0,
        (
            stored(LORA_HEAD, None, HEAD_TOKENS, lora="sql", salt="tenant-a"),
            stored(LORA_TAIL, LORA_HEAD[1], TAIL_TOKENS, lora="sql"),
        ),
    )


def test_vllm_removals() -> None:
    assert VLLM.decode_batch(sample("vllm-0.32-removal"))[:2] == (
        1754000005.0,
        (EngineBlocksRemoved(TAIL, Tier.DEVICE), EngineBlocksRemoved((HEAD[1],), Tier.DEVICE)),
    )


def test_vllm_all_blocks_cleared() -> None:
    assert VLLM.decode_batch(sample("vllm-0.32-cleared"))[:2] == (
        1754000006.0,
        (EngineCacheCleared(),),
    )


def test_reference_document_example() -> None:
    doc_hash = 12752553625335714316
    assert VLLM.decode_batch(sample("vllm-0.32-doc-example"))[:2] == (
        1754000008.0,
        (
            stored((doc_hash,), None, (0, 266, *range(1000, 1030)), block_size=32),
            EngineBlocksRemoved((doc_hash,), Tier.DEVICE),
            EngineCacheCleared(),
        ),
    )


def test_sglang_signed_hashes_mediums_and_cache_salt() -> None:
    events = raw("sglang")[1]
    assert events[0]["block_hashes"] == [SG1, SG2]  # really sent negative
    assert events[1]["cache_salt"] == "tenant-a"  # sent on a continuation too
    assert (SG1_U, SG2_U) == (SG1 + U64, SG2 + U64)
    assert SGLANG.decode_batch(sample("sglang"))[:2] == (
        1754000007.125,
        (
            stored((SG1_U, SG2_U), None, HEAD_TOKENS, tier=Tier.HOST, salt="tenant-a"),
            stored((SG3,), SG2_U, TAIL_TOKENS, lora="sql"),  # no salt: not from token 0
            EngineBlocksRemoved((SG2_U,), Tier.HOST),
            EngineBlocksRemoved((SG3,), Tier.DEVICE),
            EngineCacheCleared(),
        ),
    )


def test_sglang_batch_is_not_vllm() -> None:
    # CPU_PINNED is no vLLM medium: the vLLM adapter skips those events, never misreads
    # them (and never credits them to the device).
    as_sglang = SGLANG.decode_batch(sample("sglang"))
    as_vllm = VLLM.decode_batch(sample("sglang"))
    pinned = [e for e in as_sglang.events if getattr(e, "tier", None) is Tier.HOST]
    assert pinned
    assert all(event not in as_vllm.events for event in pinned)
    assert {s.reason for s in as_vllm.skipped} == {SkipReason.UNKNOWN_MEDIUM}
    assert len(as_vllm.events) + len(as_vllm.skipped) == len(as_sglang.events)


@pytest.mark.parametrize(
    "name", ["vllm-0.32-int", "vllm-0.32-bytes", "vllm-0.32-removal", "vllm-0.32-doc-example"]
)
def test_vllm_map_samples_decode_alike_with_the_sglang_dialect(name: str) -> None:
    # Tagged maps with GPU medium and no cache_salt field read the same under both dialects.
    assert SGLANG.decode_batch(sample(name)) == VLLM.decode_batch(sample(name))


# --- Hash normalisation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (12752553625335714316, 12752553625335714316),
        (U64 - 1, U64 - 1),
        (-1, U64 - 1),
        (-(2**63), 2**63),
        (SG1, SG1_U),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
        (b"\x00\x00\x00\x00\x00\x00\x01\x02", 0x0102),
        (b"\xff" * 64, U64 - 1),
    ],
)
def test_normalise_hash(value: Any, expected: int) -> None:
    assert normalise_hash(value) == expected


@pytest.mark.parametrize(
    "value",
    [True, False, U64, -(2**63) - 1, b"\x01" * 7, b"\x01" * 65, b"", "12", 1.0, None, [1]],
)
def test_normalise_hash_rejects(value: Any) -> None:
    with pytest.raises(WireDecodeError):
        normalise_hash(value)


# --- Hand-built events: tolerance and strictness --------------------------------------------

_ABSENT = object()


def stored_map(**changes: Any) -> dict[str, Any]:
    """A valid vLLM 0.32 BlockStored map with `changes` applied (_ABSENT drops a field)."""
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 0,
    }
    event.update(changes)
    return {key: value for key, value in event.items() if value is not _ABSENT}


def removed_map(**changes: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU"}
    event.update(changes)
    return {key: value for key, value in event.items() if value is not _ABSENT}


def batch(*events: Any, ts: Any = 1.5) -> bytes:
    return encode([ts, list(events), 0])


STORED_11_12 = stored((11, 12), None, (1, 2, 3, 4, 5, 6, 7, 8))


@ADAPTERS
def test_unknown_event_types_are_skipped(adapter: Any) -> None:
    payload = batch(
        {"type": "BlockPinned", "block_hashes": "anything"},
        stored_map(),
        ["BlockPromoted", 1, 2, 3],
        {"type": "AllBlocksCleared"},
    )
    assert adapter.decode_batch(payload)[:2] == (1.5, (STORED_11_12, EngineCacheCleared()))


@ADAPTERS
def test_unknown_map_keys_and_trailing_batch_elements_are_ignored(adapter: Any) -> None:
    newer = stored_map(
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
        locality="local",
        ownership={"owner": 3},
        lookahead_token_ids=[9, 9],
        **{"future field": [1, {"x": None}]},
    )
    payload = encode([2.5, [newer, removed_map(group_idx=1, locality=None)], 0, "future", {}])
    assert adapter.decode_batch(payload)[:2] == (
        2.5,
        (STORED_11_12, EngineBlocksRemoved((11,), Tier.DEVICE, group_idx=1)),
    )


def test_trailing_positional_elements_are_ignored() -> None:
    payload = batch(
        ["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None,
         [None, None], 0, "full_attention", 4096, "local", "mine", "session", [1, 2]],
        ["BlockRemoved", [11], "GPU", 0, "local", "mine"],
        ["AllBlocksCleared", "trailing", 1],
    )  # fmt: skip
    assert VLLM.decode_batch(payload)[:2] == (
        1.5,
        (STORED_11_12, EngineBlocksRemoved((11,), Tier.DEVICE), EngineCacheCleared()),
    )


@ADAPTERS
def test_empty_batch_and_integer_timestamp(adapter: Any) -> None:
    ts, events, _ = adapter.decode_batch(encode([1754000000, []]))
    assert (ts, events) == (1754000000.0, ())
    assert type(ts) is float


@pytest.mark.parametrize(
    ("medium", "tier"), [("GPU", Tier.DEVICE), ("CPU", Tier.HOST), ("STORAGE", Tier.DISK)]
)
def test_vllm_mediums(medium: str, tier: Tier) -> None:
    _, events, _ = VLLM.decode_batch(batch(stored_map(medium=medium), removed_map(medium=medium)))
    assert [event.tier for event in events] == [tier, tier]


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        ("GPU", Tier.DEVICE),
        ("CPU_PINNED", Tier.HOST),
        ("DISK", Tier.DISK),
        ("EXTERNAL", Tier.REMOTE),
    ],
)
def test_sglang_mediums(medium: str, tier: Tier) -> None:
    _, events, _ = SGLANG.decode_batch(batch(stored_map(medium=medium), removed_map(medium=medium)))
    assert [event.tier for event in events] == [tier, tier]


@ADAPTERS
def test_absent_medium_is_the_device(adapter: Any) -> None:
    _, events, _ = adapter.decode_batch(batch(stored_map(medium=_ABSENT), removed_map(medium=None)))
    assert [event.tier for event in events] == [Tier.DEVICE, Tier.DEVICE]


@pytest.mark.parametrize(
    ("changes", "lora", "salt"),
    [
        ({"extra_keys": [["tenant-a"], None]}, None, "tenant-a"),
        # A continuation never carries a salt, whatever its extra keys say.
        ({"parent_block_hash": 10, "extra_keys": [["tenant-a"], None]}, None, None),
        ({"lora_name": "sql", "extra_keys": [["sql"], ["sql"]]}, "sql", None),
        ({"lora_name": "sql", "extra_keys": [["sql", "tenant-a"], ["sql"]]}, "sql", "tenant-a"),
        ({"lora_name": "", "extra_keys": [None, None]}, None, None),
        ({"extra_keys": []}, None, None),
        ({"extra_keys": _ABSENT}, None, None),
        ({"extra_keys": [[], None]}, None, None),
    ],
)
def test_vllm_lora_and_salt(changes: dict[str, Any], lora: str | None, salt: str | None) -> None:
    (event,) = VLLM.decode_batch(batch(stored_map(**changes)))[1]
    assert isinstance(event, EngineBlocksStored)
    assert (event.lora_name, event.cache_salt) == (lora, salt)


@pytest.mark.parametrize(
    ("changes", "salt"),
    [
        ({"cache_salt": "tenant-a"}, "tenant-a"),
        ({"cache_salt": "tenant-a", "parent_block_hash": -5}, None),
        ({"cache_salt": None}, None),
        ({"cache_salt": ""}, None),
        # SGLang has no salt in extra keys: they are just an unknown field to it.
        ({"extra_keys": [["tenant-a"], None]}, None),
    ],
)
def test_sglang_cache_salt_field(changes: dict[str, Any], salt: str | None) -> None:
    (event,) = SGLANG.decode_batch(batch(stored_map(**changes)))[1]
    assert isinstance(event, EngineBlocksStored)
    assert event.cache_salt == salt


MALFORMED_PAYLOADS = {
    "empty": b"",
    "reserved byte": b"\xc1",
    "text": b"not msgpack at all",
    "truncated": sample("vllm-0.32-int")[:-3],
    "trailing bytes": sample("vllm-0.32-int") + b"\x00",
    "map batch": encode({"ts": 1.0, "events": []}),
    "number batch": encode(1.0),
    "one-element batch": encode([1.0]),
    "empty batch": encode([]),
    "string timestamp": encode(["1.0", []]),
    "bool timestamp": encode([True, []]),
    "nil timestamp": encode([None, []]),
    "events map": encode([1.0, {"type": "AllBlocksCleared"}]),
    "events string": encode([1.0, "AllBlocksCleared"]),
}

MALFORMED_EVENTS: dict[str, Any] = {
    "number": 7,
    "string": "BlockStored",
    "nil": None,
    "empty array": [],
    "map without type": {"block_hashes": [1]},
    "integer type": {"type": 1},
    "nil positional tag": [None, [1]],
    "too few tokens": stored_map(token_ids=[1, 2, 3, 4, 5, 6, 7]),
    "too many tokens": stored_map(token_ids=list(range(1, 10))),
    "tokens for one block fewer": stored_map(block_hashes=[11, 12, 13]),
    "no tokens": stored_map(token_ids=[]),
    "tokens missing": stored_map(token_ids=_ABSENT),
    "tokens not an array": stored_map(token_ids=b"\x01\x02"),
    "negative token": stored_map(token_ids=[1, 2, 3, -4, 5, 6, 7, 8]),
    "token over 32 bits": stored_map(token_ids=[1, 2, 3, 2**32, 5, 6, 7, 8]),
    "bool token": stored_map(token_ids=[1, 2, 3, True, 5, 6, 7, 8]),
    "float token": stored_map(token_ids=[1, 2, 3, 4.0, 5, 6, 7, 8]),
    "string token": stored_map(token_ids=[1, 2, 3, "4", 5, 6, 7, 8]),
    "hashes missing": stored_map(block_hashes=_ABSENT),
    "hashes empty": stored_map(block_hashes=[], token_ids=[]),
    "hashes not an array": stored_map(block_hashes=11),
    "bool hash": stored_map(block_hashes=[True, 12]),
    "string hash": stored_map(block_hashes=["11", 12]),
    "float hash": stored_map(block_hashes=[11.0, 12]),
    "nil hash": stored_map(block_hashes=[None, 12]),
    "short digest hash": stored_map(block_hashes=[b"\x01" * 7, 12]),
    "long digest hash": stored_map(block_hashes=[b"\x01" * 65, 12]),
    "bool parent": stored_map(parent_block_hash=False),
    "string parent": stored_map(parent_block_hash="10"),
    "block size missing": stored_map(block_size=_ABSENT),
    "negative block size": stored_map(block_size=-4),
    "bool block size": stored_map(block_size=True, token_ids=[1, 2]),
    "float block size": stored_map(block_size=4.0),
    "string block size": stored_map(block_size="4"),
    "unknown medium": stored_map(medium="TPU"),
    "integer medium": stored_map(medium=1),
    "integer lora name": stored_map(lora_name=3),
    "removal without hashes": removed_map(block_hashes=[]),
    "removal hashes missing": removed_map(block_hashes=_ABSENT),
    "removal bool hash": removed_map(block_hashes=[False]),
    "removal unknown medium": removed_map(medium="TAPE"),
    "positional too short": ["BlockStored", [11]],
    "positional token mismatch": ["BlockStored", [11], None, [1, 2, 3], 4],
    "positional removal empty": ["BlockRemoved"],
}

# Malformed for one dialect only.
VLLM_ONLY_MALFORMED = {
    "sglang medium": stored_map(medium="CPU_PINNED"),
    "extra keys not an array": stored_map(extra_keys="tenant-a"),
    "extra keys entry not an array": stored_map(extra_keys=["tenant-a", None]),
}
SGLANG_ONLY_MALFORMED = {
    "vllm medium": stored_map(medium="CPU"),
    "vllm storage medium": removed_map(medium="STORAGE"),
    "integer cache salt": stored_map(cache_salt=3),
}


@ADAPTERS
@pytest.mark.parametrize("payload", MALFORMED_PAYLOADS.values(), ids=MALFORMED_PAYLOADS)
def test_malformed_payloads_raise(adapter: Any, payload: bytes) -> None:
    with pytest.raises(WireDecodeError):
        adapter.decode_batch(payload)


def assert_skipped_alone(decoded: DecodedBatch, event: Any, name: str) -> None:
    """The batch of the one event decodes, with that event skipped for its reason."""
    assert decoded.events == ()
    (skipped,) = decoded.skipped
    medium = "medium" in name  # the cases named so have an unknown medium
    assert skipped.reason is (SkipReason.UNKNOWN_MEDIUM if medium else SkipReason.MALFORMED)
    tag = (
        event.get("type")
        if isinstance(event, dict)
        else event[0]
        if isinstance(event, list) and event
        else None
    )
    assert skipped.event_type == (tag if isinstance(tag, str) else "?")


@ADAPTERS
@pytest.mark.parametrize(("name", "event"), MALFORMED_EVENTS.items(), ids=MALFORMED_EVENTS)
def test_malformed_events_are_skipped(adapter: Any, name: str, event: Any) -> None:
    assert_skipped_alone(adapter.decode_batch(batch(event)), event, name)


@pytest.mark.parametrize(("name", "event"), VLLM_ONLY_MALFORMED.items(), ids=VLLM_ONLY_MALFORMED)
def test_malformed_for_vllm(name: str, event: Any) -> None:
    assert_skipped_alone(VLLM.decode_batch(batch(event)), event, name)


@pytest.mark.parametrize(
    ("name", "event"), SGLANG_ONLY_MALFORMED.items(), ids=SGLANG_ONLY_MALFORMED
)
def test_malformed_for_sglang(name: str, event: Any) -> None:
    assert_skipped_alone(SGLANG.decode_batch(batch(event)), event, name)


@ADAPTERS
@pytest.mark.parametrize(
    ("tag", "reported"),
    [("BlockPinned", "BlockPinned"), ("Pin\x1b[31m", "?"), ("x" * 65, "?"), (7, "?")],
)
def test_the_type_an_odd_event_is_counted_under_is_a_short_plain_name(
    adapter: Any, tag: Any, reported: str
) -> None:
    (skipped,) = adapter.decode_batch(batch({"type": tag, "block_hashes": [1]})).skipped
    assert skipped.event_type == reported


@ADAPTERS
def test_mediums_are_read_whatever_their_case(adapter: Any) -> None:
    # vLLM 0.32's Mooncake store worker and LMCache send "cpu"; SGLang's are upper case.
    medium = "cpu" if adapter is VLLM else "cpu_pinned"
    decoded = adapter.decode_batch(batch(stored_map(medium=medium), removed_map(medium="Gpu")))
    assert [event.tier for event in decoded.events] == [Tier.HOST, Tier.DEVICE]
    assert decoded.skipped == ()


@ADAPTERS
def test_an_unknown_medium_is_skipped_and_never_credited_as_the_device(adapter: Any) -> None:
    # The long s (U+017F) is upper-cased to "S" by Unicode: only ASCII names are read.
    decoded = adapter.decode_batch(
        batch(stored_map(medium="tape"), stored_map(medium="\u017ftorage"), removed_map())
    )
    assert decoded.events == (EngineBlocksRemoved((11,), Tier.DEVICE),)
    assert decoded.skipped == (SkippedEvent("BlockStored", SkipReason.UNKNOWN_MEDIUM),) * 2


@ADAPTERS
def test_blocks_held_remotely_are_not_the_publishers(adapter: Any) -> None:
    decoded = adapter.decode_batch(
        batch(
            stored_map(locality="REMOTE"),
            removed_map(locality="remote"),
            stored_map(locality="PEER"),  # not plainly local: not the publisher's
            stored_map(locality=2),
            stored_map(locality="local"),
        )
    )
    assert decoded.events == (STORED_11_12,)
    assert [s.reason for s in decoded.skipped] == [SkipReason.REMOTE] * 4


@ADAPTERS
def test_a_store_by_hash_alone_is_an_offload(adapter: Any) -> None:
    # vLLM 0.32's offloading connector: hashes, no tokens, block size 0, no parent.
    placeholder = stored_map(
        token_ids=[], block_size=0, medium="CPU" if adapter is VLLM else "DISK"
    )
    decoded = adapter.decode_batch(batch(placeholder))
    tier = Tier.HOST if adapter is VLLM else Tier.DISK
    assert decoded.events == (EngineBlocksOffloaded((11, 12), tier),)
    # With a parent or tokens it is an ordinary store, and must be whole.
    with_parent = stored_map(token_ids=[], block_size=0, parent_block_hash=10)
    assert decoded_reasons(adapter, with_parent) == ["malformed"]
    with_tokens = stored_map(block_size=0)
    assert decoded_reasons(adapter, with_tokens) == ["malformed"]
    false_size = stored_map(token_ids=[], block_size=False, medium="DISK")
    assert decoded_reasons(adapter, false_size) == ["malformed"]
    # A device block is always stored with its tokens.
    for medium in ("GPU", _ABSENT):
        on_device = stored_map(token_ids=[], block_size=0, medium=medium)
        assert decoded_reasons(adapter, on_device) == ["malformed"]


def decoded_reasons(adapter: Any, event: Any) -> list[str]:
    return [skipped.reason.value for skipped in adapter.decode_batch(batch(event)).skipped]


@ADAPTERS
def test_deeply_nested_payload_raises(adapter: Any) -> None:
    with pytest.raises(WireDecodeError):
        adapter.decode_batch(b"\x91" * 100_000 + b"\xc0")


@ADAPTERS
@pytest.mark.parametrize("tag", [[1], {"type": "BlockStored"}], ids=["array", "map"])
def test_positional_event_led_by_a_container_is_skipped(adapter: Any, tag: Any) -> None:
    assert decoded_reasons(adapter, [tag, [11]]) == ["malformed"]


@ADAPTERS
@pytest.mark.parametrize(
    "payload",
    [
        b"\xa1\xff",
        encode([1.0, [{"type": "AllBlocksCleared"}]]).replace(b"Cleared", b"Clear\xff\xfe"),
    ],
    ids=["string", "event tag"],
)
def test_string_that_is_not_utf8_raises_wire_decode_error(adapter: Any, payload: bytes) -> None:
    with pytest.raises(WireDecodeError):
        adapter.decode_batch(payload)


# --- Fuzzing: decode well formed (odd events skipped), or raise WireDecodeError -----

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _in_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < U64


def assert_well_formed(result: Any) -> None:
    assert isinstance(result, DecodedBatch)
    ts, events, skipped = result
    assert all(isinstance(s, SkippedEvent) and len(s.event_type) <= 64 for s in skipped)
    assert type(ts) is float
    assert isinstance(events, tuple)
    for event in events:
        if isinstance(event, EngineBlocksStored):
            assert event.block_hashes
            assert all(_in_u64(h) for h in event.block_hashes)
            assert event.parent_hash is None or _in_u64(event.parent_hash)
            assert type(event.block_size) is int
            assert event.block_size >= 1
            assert len(event.token_ids) == len(event.block_hashes) * event.block_size
            assert all(type(t) is int and 0 <= t < 2**32 for t in event.token_ids)
            assert isinstance(event.tier, Tier)
            assert event.lora_name is None or (isinstance(event.lora_name, str) and event.lora_name)
            assert event.cache_salt is None or isinstance(event.cache_salt, str)
            assert event.parent_hash is None or event.cache_salt is None
        elif isinstance(event, EngineBlocksRemoved | EngineBlocksOffloaded):
            assert event.block_hashes
            assert all(_in_u64(h) for h in event.block_hashes)
            assert isinstance(event.tier, Tier)
        else:
            assert isinstance(event, EngineCacheCleared)


def assert_decodes_or_rejects(payload: bytes) -> None:
    for adapter in (VLLM, SGLANG):
        try:
            result = adapter.decode_batch(payload)
        except WireDecodeError:
            continue
        assert_well_formed(result)


_FIELD_NAMES = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "cache_salt", "session_id",
]  # fmt: skip
_TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockPinned"]
_MEDIUMS = ["GPU", "CPU", "STORAGE", "CPU_PINNED", "DISK", "EXTERNAL", "TPU"]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=U64 - 1)
    | st.integers(min_value=-2, max_value=40)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40)
    | st.sampled_from(_TAGS + _MEDIUMS + _FIELD_NAMES)
)
_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=4), children, max_size=6)
    ),
    max_leaves=20,
)
_map_events = st.fixed_dictionaries(
    {"type": st.sampled_from(_TAGS)}, optional=dict.fromkeys(_FIELD_NAMES[1:], _values)
)
_positional_events = st.builds(
    lambda tag, rest: [tag, *rest], st.sampled_from(_TAGS) | _values, st.lists(_values, max_size=10)
)
_batches = st.builds(
    lambda ts, events, rest: [ts, events, *rest],
    st.floats() | st.integers(min_value=0, max_value=2**40) | _values,
    st.lists(_map_events | _positional_events | _values, max_size=6),
    st.lists(_values, max_size=2),
)

SAMPLE_NAMES = sorted(path.stem for path in SAMPLES.glob("*.bin"))


def test_every_wire_form_is_recorded() -> None:
    assert SAMPLE_NAMES == [
        "sglang", "vllm-0.23", "vllm-0.32-bytes", "vllm-0.32-cleared", "vllm-0.32-doc-example",
        "vllm-0.32-int", "vllm-0.32-lora-salt", "vllm-0.32-removal", "vllm-0.32-salt", "vllm-0.9",
    ]  # fmt: skip


@FUZZ
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(payload: bytes) -> None:
    assert_decodes_or_rejects(payload)


@pytest.mark.slow
@FUZZ
@given(_values | _batches)
def test_fuzz_random_structures(structure: Any) -> None:
    assert_decodes_or_rejects(encode(structure))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a decoded structure: list indices and map keys, outermost first."""
    found = [prefix]
    if isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, (*prefix, index))
    elif isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    return found


def _mutate(structure: Any, path: tuple[Any, ...], change: Callable[[Any, Any], None]) -> Any:
    if not path:
        return structure
    parent = structure
    for step in path[:-1]:
        parent = parent[step]
    change(parent, path[-1])
    return structure


@FUZZ
@given(st.data())
def test_fuzz_valid_batches_with_fields_swapped(data: st.DataObject) -> None:
    structure = raw(data.draw(st.sampled_from(SAMPLE_NAMES), label="sample"))
    for _ in range(data.draw(st.integers(min_value=1, max_value=3), label="mutations")):
        path = data.draw(st.sampled_from(_paths(structure)), label="path")
        if not path:
            structure = data.draw(_values, label="whole")
            break
        if data.draw(st.booleans(), label="delete"):
            structure = _mutate(structure, path, lambda parent, key: parent.pop(key))
        else:
            value = data.draw(_values, label="value")
            structure = _mutate(
                structure, path, lambda parent, key, v=value: parent.__setitem__(key, v)
            )
    assert_decodes_or_rejects(encode(structure))


@FUZZ
@given(st.sampled_from(SAMPLE_NAMES), st.data())
def test_fuzz_samples_with_bytes_changed(name: str, data: st.DataObject) -> None:
    payload = bytearray(sample(name))
    changes = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(payload) - 1), st.integers(0, 255)),
            min_size=1,
            max_size=4,
        )
    )
    for position, byte in changes:
        payload[position] = byte
    assert_decodes_or_rejects(bytes(payload))


# --- A batch decodes whole or not at all -----------------------------------------------------


def _events_of(*names: str) -> list[Any]:
    return [event for name in names for event in raw(name)[1]]


VALID_VLLM_EVENTS = _events_of(
    "vllm-0.32-int", "vllm-0.32-bytes", "vllm-0.23", "vllm-0.9", "vllm-0.32-salt",
    "vllm-0.32-lora-salt", "vllm-0.32-removal", "vllm-0.32-doc-example",
)  # fmt: skip
VALID_SGLANG_EVENTS = _events_of("sglang")
POOLS = pytest.mark.parametrize(
    ("adapter", "valid_events"),
    [(VLLM, VALID_VLLM_EVENTS), (SGLANG, VALID_SGLANG_EVENTS)],
    ids=["vllm", "sglang"],
)


@POOLS
@settings(max_examples=150, deadline=None, database=None)
@given(data=st.data())
def test_one_malformed_event_never_drops_the_others(
    adapter: Any, valid_events: list[Any], data: st.DataObject
) -> None:
    valid = data.draw(st.lists(st.sampled_from(valid_events), max_size=8), label="valid")
    ts = data.draw(st.floats(allow_nan=False, allow_infinity=False), label="ts")
    alone = adapter.decode_batch(encode([ts, valid, 0]))
    assert len(alone.events) == len(valid)
    bad = data.draw(st.sampled_from(list(MALFORMED_EVENTS.values())), label="malformed")
    where = data.draw(st.integers(min_value=0, max_value=len(valid)), label="where")
    mixed = adapter.decode_batch(encode([ts, [*valid[:where], bad, *valid[where:]], 0]))
    assert mixed.events == alone.events
    assert len(mixed.skipped) == 1


@pytest.mark.parametrize(
    ("release", "event", "salt"),
    [
        ("0.5.17", ["BlockStored", [11, 12], None, list(range(1, 9)), 4, None, "GPU"], None),
        (
            "0.5.18",
            ["BlockStored", [11, 12], None, list(range(1, 9)), 4, None, "GPU", {"cache_salt": "t"}],
            "t",
        ),
        (
            "0.5.19",
            ["BlockStored", [11, 12], None, list(range(1, 9)), 4, None, "GPU", {"cache_salt": "u"}],
            "u",
        ),
        ("0.5.20", stored_map(cache_salt="t"), "t"),
    ],
)
def test_every_sglang_releases_stores_decode_with_their_salt(
    release: str, event: Any, salt: str | None
) -> None:
    (stored_event,) = SGLANG.decode_batch(batch(event)).events
    assert isinstance(stored_event, EngineBlocksStored)
    assert stored_event.block_hashes == (11, 12)
    assert stored_event.cache_salt == salt


def test_a_metadata_map_without_a_salt_is_not_taken_for_an_unsalted_store() -> None:
    # Only salted stores carry the map: one without a salt would key the chain in the
    # shared scope, where the engine's own hashes say it does not belong.
    event = ["BlockStored", [11, 12], None, list(range(1, 9)), 4, None, "GPU", {"other": 1}]
    assert decoded_reasons(SGLANG, event) == ["malformed"]
