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
    evicted_from_fleet: int = 0,
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
        evicted_from_fleet_tokens=evicted_from_fleet,
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


def test_what_the_fleet_evicted_is_told_apart_from_what_it_never_held() -> None:
    # 800 of 1000 attainable; of the 200 past it, 128 were evicted lately.
    evicted = step(evicted_from_fleet=128)
    assert evicted.losses == {Loss.EVICTED_FROM_FLEET: 128}
    assert evicted.stages[Stage.ATTAINABLE] == 800  # the stages are as they were
    gone = step(attainable=0, predicted=0, achieved=0, evicted_from_fleet=992)
    assert gone.losses == {Loss.EVICTED_FROM_FLEET: 992}
    both = step(predicted=300, achieved=300, evicted_from_fleet=64)
    assert both.losses == {Loss.EVICTED_FROM_FLEET: 64, Loss.ROUTED_FOR_LOAD: 500}


def test_totals_add_up_per_model_and_tenant_and_worker() -> None:
    funnel = CacheFunnel()
    first = step(predicted=300, achieved=200)
    funnel.add("m", "acme", "w1", first)
    funnel.add("m", "acme", "w2", step(prompt=500, attainable=0, predicted=0, achieved=None))
    funnel.add("m", "globex", "w1", first)
    totals = funnel.totals()
    acme = totals[("m", "acme")]
    assert acme.requests == 2
    assert acme.stages[Stage.PROMPT] == 1500
    assert acme.stages[Stage.ACHIEVED] == 200
    assert (acme.reported_requests, acme.reported_prompt_tokens) == (1, 1000)
    assert acme.reported_predicted_tokens == 300
    assert acme.losses[Loss.ROUTED_FOR_LOAD] == 500
    assert totals[("m", "globex")].requests == 1
    assert totals[("m", "globex")].copied_tokens == 500
    w1 = funnel.worker_totals("w1")
    assert w1 is not None
    assert (w1.requests, w1.reported_prompt_tokens, w1.stages[Stage.ACHIEVED]) == (2, 2000, 400)
    assert w1.reported_predicted_tokens == 600
    w2 = funnel.worker_totals("w2")
    assert w2 is not None
    # Not reported: its prediction is not one the engine's figure can check.
    assert (w2.requests, w2.reported_requests, w2.reported_predicted_tokens) == (1, 0, 0)


def test_copies_are_the_attainable_tokens_prefilled_where_they_were_not_held() -> None:
    funnel = CacheFunnel()
    funnel.add("m", "acme", "w1", step(predicted=300, achieved=300))  # 500 for load
    funnel.add("m", "acme", "w2", step(predicted=0, achieved=0, holder_eligible=False))
    funnel.add("m", "acme", "w2", step(attainable=0, predicted=0, evicted_from_fleet=640))
    acme = funnel.totals()[("m", "acme")]
    assert acme.copied_tokens == 500 + 800
    assert acme.losses[Loss.EVICTED_FROM_FLEET] == 640  # evicted: no copy of anything
    w1, w2 = funnel.worker_totals("w1"), funnel.worker_totals("w2")
    assert w1 is not None
    assert w2 is not None
    assert (w1.copied_tokens, w2.copied_tokens) == (500, 800)
    assert (w1.losses[Loss.EVICTED_FROM_FLEET], w2.losses[Loss.EVICTED_FROM_FLEET]) == (0, 640)


def test_workers_that_left_the_fleet_are_forgotten() -> None:
    funnel = CacheFunnel()
    for worker_id in ("w1", "w2"):
        funnel.add("m", "acme", worker_id, step())
    funnel.retain_workers(["w2", "w3"])
    assert funnel.worker_totals("w1") is None
    assert funnel.worker_totals("w2") is not None
    assert funnel.worker_totals("w3") is None
    assert funnel.totals()[("m", "acme")].requests == 2  # the model's and tenant's stay
