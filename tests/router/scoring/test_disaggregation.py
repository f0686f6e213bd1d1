"""Whole or split (router/scoring/disaggregation.py): the costs compared, term by term,
and what each model's live workers allow."""

from __future__ import annotations

import pytest

from kvplane.core.config import DisaggregationSettings, ScoringSettings
from kvplane.core.types import WorkerInfo, WorkerRole
from router.scoring.disaggregation import (
    LegPlan,
    LegReason,
    LegSide,
    model_legs,
    plan_legs,
)
from tests.router.conftest import worker

WEIGHTS = ScoringSettings()  # 12,500 prefill tokens/s, 131,072 KV bytes a token
CONDITIONAL = DisaggregationSettings()  # 25 GB/s links, 3 ms a leg, 0.05 a running stream
RATE = WEIGHTS.prefill_tokens_per_s
KV_BYTES = WEIGHTS.kv_bytes_per_token
LINK = CONDITIONAL.link_bytes_per_s
OVERHEAD = CONDITIONAL.leg_overhead_s
LONG = 8000  # prompt tokens


def scored(worker_id: str, cached: int = 0, queue: float = 0.0) -> LegSide:
    """A prefill worker holding `cached` of the prompt, `queue` prompt tokens queued."""
    return LegSide(worker_id, cached, queue, 0.0)


def decode_side(cached: int = 0, running: float = 0.0, queued: float = 0.0) -> LegSide:
    return LegSide("d", cached, queued, running)


def plan(
    decode: LegSide,
    prefill: LegSide | None,
    settings: DisaggregationSettings = CONDITIONAL,
    prompt_tokens: int = LONG,
) -> LegPlan:
    return plan_legs(prompt_tokens, decode, prefill, WEIGHTS, settings)


def test_the_defaults_the_costs_below_are_computed_with() -> None:
    assert (RATE, KV_BYTES, LINK, OVERHEAD) == (12_500.0, 131_072, 25e9, 0.003)
    assert CONDITIONAL.decode_stall_weight == 0.05
    assert CONDITIONAL.mode == "conditional"


# -- plan_legs ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["conditional", "always", "never"])
def test_without_a_prefill_worker_the_request_is_whole_with_no_transfer(mode: str) -> None:
    settings = DisaggregationSettings(mode=mode)  # type: ignore[arg-type]
    assert plan(decode_side(), None, settings) == LegPlan("d", None, LegReason.NO_TRANSFER)


def test_mode_never_serves_whole_without_pricing_the_legs() -> None:
    never = DisaggregationSettings(mode="never")
    result = plan(decode_side(), scored("p", cached=LONG), never)
    assert result == LegPlan("d", None, LegReason.NEVER)
    assert not result.split
    assert (result.whole_s, result.split_s, result.transfer_bytes) == (None, None, 0)


def test_a_decode_worker_holding_most_of_a_long_prompt_computes_the_rest_itself() -> None:
    result = plan(decode_side(cached=7000), scored("p"))
    assert result.reason is LegReason.WHOLE_CHEAPER
    assert result.decode_worker == "d"
    assert result.prefill_worker is None
    assert not result.split
    # whole: the 1,000 tokens the decode worker lacks, nothing running there.
    assert result.whole_s == pytest.approx(1000 / 12_500)  # 0.08 s
    # split: all 8,000 on the prefill worker, 1,000 tokens' KV pulled, one leg's overhead.
    assert result.transfer_bytes == 1000 * 131_072
    assert result.split_s == pytest.approx(8000 / 12_500 + 131_072_000 / 25e9 + 0.003)


def test_an_uncached_long_prompt_goes_to_the_idle_prefill_worker_holding_it() -> None:
    result = plan(decode_side(), scored("p", cached=7984))
    assert result.reason is LegReason.SPLIT_CHEAPER
    assert (result.decode_worker, result.prefill_worker) == ("d", "p")
    assert result.split
    assert result.whole_s == pytest.approx(8000 / 12_500)  # 0.64 s
    assert result.transfer_bytes == 8000 * 131_072  # the decode worker holds none of it
    assert result.split_s == pytest.approx(16 / 12_500 + 1_048_576_000 / 25e9 + 0.003)


def test_the_prefill_workers_queue_is_paid_by_the_split() -> None:
    # The same prompt, its prefill worker with 10,000 tokens queued ahead.
    result = plan(decode_side(), scored("p", cached=7984, queue=10_000.0))
    assert result.reason is LegReason.WHOLE_CHEAPER
    assert result.prefill_worker is None
    assert result.split_s == pytest.approx((16 + 10_000) / 12_500 + 1_048_576_000 / 25e9 + 0.003)
    assert result.whole_s == pytest.approx(0.64)


def test_a_prefill_worker_holding_more_than_the_prompt_computes_nothing() -> None:
    result = plan(decode_side(), scored("p", cached=LONG + 100), prompt_tokens=LONG)
    assert result.split_s == pytest.approx(1_048_576_000 / 25e9 + 0.003)


def test_mode_always_splits_even_where_whole_costs_less() -> None:
    always = DisaggregationSettings(mode="always")
    result = plan(decode_side(cached=7000), scored("p"), always)
    assert result.reason is LegReason.ALWAYS
    assert result.prefill_worker == "p"
    assert result.split
    assert result.whole_s is not None
    assert result.split_s is not None
    assert result.whole_s < result.split_s  # the conditional plan would have kept it whole
    assert result.whole_s == pytest.approx(0.08)
    assert result.transfer_bytes == 131_072_000


@pytest.mark.parametrize(
    ("running", "reason"),
    [(0, LegReason.WHOLE_CHEAPER), (1, LegReason.WHOLE_CHEAPER), (2, LegReason.SPLIT_CHEAPER)],
)
def test_running_streams_stalled_by_a_prompt_tip_a_borderline_request_to_split(
    running: int, reason: LegReason
) -> None:
    # Uncached everywhere: split = 0.64 + 0.0419 + 0.003 = 0.6849 s; whole = 0.64 s times
    # (1 + 0.05 x running): 0.64, 0.672, 0.704.
    result = plan(decode_side(running=running), scored("p"))
    assert result.reason is reason
    assert result.whole_s == pytest.approx(8000 * (1 + 0.05 * running) / 12_500)
    assert result.split_s == pytest.approx(0.64 + 1_048_576_000 / 25e9 + 0.003)


def test_with_no_stall_weight_running_streams_are_free() -> None:
    free = DisaggregationSettings(decode_stall_weight=0.0)
    result = plan(decode_side(running=10), scored("p"), free)
    assert result.reason is LegReason.WHOLE_CHEAPER
    assert result.whole_s == pytest.approx(0.64)
    heavy = DisaggregationSettings(decode_stall_weight=0.5)
    assert plan(decode_side(running=1), scored("p"), heavy).reason is LegReason.SPLIT_CHEAPER


def test_a_slow_link_keeps_a_request_whole() -> None:
    slow = DisaggregationSettings(link_bytes_per_s=1e9)  # 1.05 s to move 8,000 tokens' KV
    result = plan(decode_side(), scored("p", cached=7984), slow)
    assert result.reason is LegReason.WHOLE_CHEAPER
    assert result.split_s == pytest.approx(16 / 12_500 + 1_048_576_000 / 1e9 + 0.003)


# -- model_legs ---------------------------------------------------------------------------


def w(
    worker_id: str, role: WorkerRole = WorkerRole.BOTH, connector: str = "", **fields: object
) -> WorkerInfo:
    return worker(worker_id, role=role, kv_connector=connector, **fields)


NIXL = "NixlConnector"


@pytest.mark.parametrize(
    ("live", "legs"),
    [
        ([w("a"), w("b")], "whole"),
        ([w("p", WorkerRole.PREFILL, NIXL), w("d", WorkerRole.DECODE, NIXL)], "split"),
        ([w("a", connector=NIXL), w("b", connector=NIXL)], "split"),
        ([w("p", WorkerRole.PREFILL, NIXL), w("b", connector=NIXL)], "split"),
        ([w("d", WorkerRole.DECODE, NIXL)], "no_prefill_worker"),
        ([w("d", WorkerRole.DECODE, NIXL), w("a")], "no_prefill_worker"),
        ([w("p", WorkerRole.PREFILL, NIXL)], "no_decode_worker"),
        ([w("p", WorkerRole.PREFILL, NIXL), w("q", WorkerRole.PREFILL, NIXL)], "no_decode_worker"),
        ([w("p", WorkerRole.PREFILL, NIXL), w("a")], "whole"),  # no peer to hand KV to
    ],
    ids=[
        "no-connector",
        "prefill-and-decode",
        "two-both-with-connector",
        "prefill-and-both",
        "decode-only",
        "decode-and-plain-both",
        "prefill-only",
        "two-prefill",
        "prefill-and-plain-both",
    ],
)
def test_a_models_live_workers_say_whether_it_splits(live: list[WorkerInfo], legs: str) -> None:
    assert model_legs(live) == {"test-model": legs}


def test_one_both_worker_with_a_connector_alone_has_no_peer_to_split_with() -> None:
    # The planner serves its requests whole (no peer shares its connector): so must the
    # fleet API report it.
    assert model_legs([w("a", connector=NIXL)]) == {"test-model": "whole"}


def test_workers_of_different_connectors_cannot_split() -> None:
    # A prefill leg is handed only to a decode worker with the same connector
    # (router/routing/decide.py): these two never split.
    live = [w("p", WorkerRole.PREFILL, NIXL), w("d", WorkerRole.DECODE, "LMCacheConnectorV1")]
    assert model_legs(live) != {"test-model": "split"}


def test_each_model_is_judged_by_its_own_workers() -> None:
    live = [
        w("p", WorkerRole.PREFILL, NIXL, model="big"),
        w("d", WorkerRole.DECODE, NIXL, model="big"),
        w("a", model="small"),
        w("x", WorkerRole.DECODE, NIXL, model="lonely"),
    ]
    legs = model_legs(live)
    assert legs == {"big": "split", "small": "whole", "lonely": "no_prefill_worker"}
    assert list(legs) == ["big", "lonely", "small"]


def test_no_live_worker_no_model() -> None:
    assert model_legs([]) == {}


def test_the_prompts_queued_on_the_decode_worker_are_paid_by_the_whole_request() -> None:
    # 1,000 tokens to compute either way; 5,000 queued on the decode worker ahead of it.
    whole = plan(decode_side(cached=7000), scored("p", cached=7000))
    assert whole.reason is LegReason.WHOLE_CHEAPER
    busy = plan(decode_side(cached=7000, queued=5000.0), scored("p", cached=7000))
    assert busy.reason is LegReason.SPLIT_CHEAPER
    assert busy.whole_s == pytest.approx((5000 + 1000) / RATE)
    assert busy.split_s == pytest.approx(1000 / RATE + 1000 * KV_BYTES / LINK + OVERHEAD)


def test_a_both_worker_holding_no_more_of_the_prompt_is_not_split_onto() -> None:
    # The decode worker is busy; the other worker is idle and takes whole requests too.
    busy = decode_side(cached=2000, queued=50_000.0)
    idle_peer = LegSide("p", 2000, 0.0, 0.0, takes_whole=True)
    result = plan(busy, idle_peer)
    assert result == LegPlan("d", None, LegReason.NO_PREFIX_GAIN)
    # A prefill-only worker is priced: there, splitting is the only way to use it.
    assert plan(busy, LegSide("p", 2000, 0.0, 0.0)).reason is LegReason.SPLIT_CHEAPER
    # One holding more of it is priced too, and mode always splits regardless.
    holder = LegSide("p", 7984, 0.0, 0.0, takes_whole=True)
    assert plan(busy, holder).reason is LegReason.SPLIT_CHEAPER
    always = DisaggregationSettings(mode="always")
    assert plan(busy, idle_peer, always).reason is LegReason.ALWAYS
