"""A request's way through the cache-loss funnel, and the totals per model and tenant."""

from __future__ import annotations

from router.routing.funnel import CacheFunnel, Loss, Stage, funnel_step


def test_a_prediction_borne_out_loses_nothing() -> None:
    done = funnel_step(
        prompt_tokens=1000,
        attainable_tokens=800,
        predicted_tokens=800,
        predicted_off_device_tokens=0,
        holder_eligible=True,
        achieved_tokens=800,
        evicted_meanwhile=False,
    )
    assert done.stages == {
        Stage.PROMPT: 1000,
        Stage.ATTAINABLE: 800,
        Stage.PREDICTED: 800,
        Stage.ACHIEVED: 800,
    }
    assert done.losses == {}


def test_each_gap_gets_its_reason() -> None:
    for_load = funnel_step(
        prompt_tokens=1000, attainable_tokens=800, predicted_tokens=300,
        predicted_off_device_tokens=0, holder_eligible=True, achieved_tokens=300,
        evicted_meanwhile=False,
    )  # fmt: skip
    assert for_load.losses == {Loss.ROUTED_FOR_LOAD: 500}
    passed_over = funnel_step(
        prompt_tokens=1000, attainable_tokens=800, predicted_tokens=300,
        predicted_off_device_tokens=0, holder_eligible=False, achieved_tokens=300,
        evicted_meanwhile=False,
    )  # fmt: skip
    assert passed_over.losses == {Loss.HOLDER_UNAVAILABLE: 500}
    # 800 predicted, 200 of them on the host tier; the engine found 500.
    short = funnel_step(
        prompt_tokens=1000, attainable_tokens=800, predicted_tokens=800,
        predicted_off_device_tokens=200, holder_eligible=True, achieved_tokens=500,
        evicted_meanwhile=False,
    )  # fmt: skip
    assert short.losses == {Loss.TIER_RESTORE: 200, Loss.PREDICTION_WRONG: 100}
    evicted = funnel_step(
        prompt_tokens=1000, attainable_tokens=800, predicted_tokens=800,
        predicted_off_device_tokens=0, holder_eligible=True, achieved_tokens=500,
        evicted_meanwhile=True,
    )  # fmt: skip
    assert evicted.losses == {Loss.EVICTED_BEFORE_ARRIVAL: 300}
    unreported = funnel_step(
        prompt_tokens=1000, attainable_tokens=800, predicted_tokens=800,
        predicted_off_device_tokens=0, holder_eligible=True, achieved_tokens=None,
        evicted_meanwhile=False,
    )  # fmt: skip
    assert Stage.ACHIEVED not in unreported.stages
    assert unreported.losses == {Loss.UNREPORTED: 800}
    better = funnel_step(  # events not arrived yet: the engine found more than believed
        prompt_tokens=1000, attainable_tokens=0, predicted_tokens=0,
        predicted_off_device_tokens=0, holder_eligible=True, achieved_tokens=640,
        evicted_meanwhile=False,
    )  # fmt: skip
    assert better.losses == {}
    assert better.stages[Stage.ACHIEVED] == 640


def test_totals_add_up_per_model_and_tenant() -> None:
    funnel = CacheFunnel()
    first = funnel_step(
        prompt_tokens=1000, attainable_tokens=800, predicted_tokens=300,
        predicted_off_device_tokens=0, holder_eligible=True, achieved_tokens=300,
        evicted_meanwhile=False,
    )  # fmt: skip
    unreported = funnel_step(
        prompt_tokens=500, attainable_tokens=0, predicted_tokens=0,
        predicted_off_device_tokens=0, holder_eligible=True, achieved_tokens=None,
        evicted_meanwhile=False,
    )  # fmt: skip
    funnel.add("m", "acme", first)
    funnel.add("m", "acme", unreported)
    funnel.add("m", "globex", first)
    totals = funnel.totals()
    acme = totals[("m", "acme")]
    assert acme.requests == 2
    assert acme.stages[Stage.PROMPT] == 1500
    assert acme.stages[Stage.ACHIEVED] == 300
    assert (acme.reported_requests, acme.reported_prompt_tokens) == (1, 1000)
    assert acme.losses[Loss.ROUTED_FOR_LOAD] == 500
    assert totals[("m", "globex")].requests == 1
