"""A request's way through the cache-loss funnel, and the totals per model and tenant."""

from __future__ import annotations

from router.routing.funnel import CacheFunnel, FunnelStep, Loss, Stage, funnel_step


def step(
    *,
    attainable: int = 800,
    predicted: int = 800,
    off_device: int = 0,
    holder_eligible: bool = True,
    achieved: int | None = 800,
    evicted_meanwhile: bool = False,
    prompt: int = 1000,
) -> FunnelStep:
    return funnel_step(
        prompt_tokens=prompt,
        attainable_tokens=attainable,
        predicted_tokens=predicted,
        predicted_off_device_tokens=off_device,
        holder_eligible=holder_eligible,
        achieved_tokens=achieved,
        evicted_meanwhile=evicted_meanwhile,
    )


def test_a_prediction_borne_out_loses_nothing() -> None:
    done = step()
    assert done.stages == {
        Stage.PROMPT: 1000,
        Stage.ATTAINABLE: 800,
        Stage.PREDICTED: 800,
        Stage.ACHIEVED: 800,
    }
    assert done.losses == {}


def test_each_gap_gets_its_reason() -> None:
    assert step(predicted=300, achieved=300).losses == {Loss.ROUTED_FOR_LOAD: 500}
    passed_over = step(predicted=300, achieved=300, holder_eligible=False)
    assert passed_over.losses == {Loss.HOLDER_UNAVAILABLE: 500}
    # 800 predicted, 200 of them on the host tier; the engine found 500.
    short = step(off_device=200, achieved=500)
    assert short.losses == {Loss.TIER_RESTORE: 200, Loss.PREDICTION_WRONG: 100}
    assert step(achieved=500, evicted_meanwhile=True).losses == {Loss.EVICTED_BEFORE_ARRIVAL: 300}
    unreported = step(achieved=None)
    assert Stage.ACHIEVED not in unreported.stages
    assert unreported.losses == {Loss.UNREPORTED: 800}
    # Events not arrived yet: the engine found more than was believed anywhere.
    better = step(attainable=0, predicted=0, achieved=640)
    assert better.losses == {}
    assert better.stages[Stage.ACHIEVED] == 640


def test_totals_add_up_per_model_and_tenant() -> None:
    funnel = CacheFunnel()
    first = step(predicted=300, achieved=300)
    funnel.add("m", "acme", first)
    funnel.add("m", "acme", step(prompt=500, attainable=0, predicted=0, achieved=None))
    funnel.add("m", "globex", first)
    totals = funnel.totals()
    acme = totals[("m", "acme")]
    assert acme.requests == 2
    assert acme.stages[Stage.PROMPT] == 1500
    assert acme.stages[Stage.ACHIEVED] == 300
    assert (acme.reported_requests, acme.reported_prompt_tokens) == (1, 1000)
    assert acme.losses[Loss.ROUTED_FOR_LOAD] == 500
    assert totals[("m", "globex")].requests == 1
