"""Who goes next, and whom a full queue sheds."""

from __future__ import annotations

from collections.abc import Callable

from router.flow_control.queue import ModelQueue, Waiting


def counters(**values: float) -> Callable[[str], float]:
    return lambda tenant: values.get(tenant, 0.0)


def queued(
    queue: ModelQueue, tenant: str, band: int = 0, deadline_at: float | None = None
) -> Waiting:
    waiting = queue.new(tenant, band, 0.0, deadline_at)
    queue.push(waiting)
    return waiting


def drained(queue: ModelQueue, counter: Callable[[str], float] | None = None) -> list[Waiting]:
    counter = counter or counters()
    order = []
    while queue:
        waiting = queue.next(counter)
        assert waiting is not None
        assert queue.remove(waiting)
        order.append(waiting)
    return order


def test_a_higher_band_goes_first_whatever_its_tenant_was_served() -> None:
    queue = ModelQueue()
    low = [queued(queue, "acme") for _ in range(3)]
    high = queued(queue, "globex", band=5)
    sheddable = queued(queue, "initech", band=-1)
    assert drained(queue, counters(globex=1e9)) == [high, *low, sheddable]


def test_within_a_band_the_least_served_tenant_goes_first_ties_to_the_earlier() -> None:
    queue = ModelQueue()
    acme_first = queued(queue, "acme")
    globex = queued(queue, "globex")
    acme_second = queued(queue, "acme")
    assert queue.next(counters(acme=10, globex=5)) is globex
    assert queue.next(counters(acme=5, globex=5)) is acme_first
    queue.remove(acme_first)
    assert queue.next(counters(acme=5, globex=5)) is globex
    queue.remove(globex)
    assert queue.next(counters()) is acme_second


def test_deadline_order_serves_a_tenants_earliest_deadline_first_and_none_last() -> None:
    queue = ModelQueue("deadline")
    none = queued(queue, "acme")
    late = queued(queue, "acme", deadline_at=9.0)
    soon = queued(queue, "acme", deadline_at=2.0)
    assert drained(queue) == [soon, late, none]
    fcfs = ModelQueue("fcfs")
    order = [queued(fcfs, "acme", deadline_at=d) for d in (9.0, 2.0, None)]
    assert drained(fcfs) == order


def test_a_removed_request_is_never_next_and_sizes_follow() -> None:
    queue = ModelQueue()
    first, second = queued(queue, "acme"), queued(queue, "acme", band=2)
    assert queue.remove(first)
    assert not queue.remove(first)
    assert (len(queue), queue.sizes(), queue.backlogged(0)) == (1, {2: 1}, [])
    assert queue.waits("acme", 2)
    assert not queue.waits("acme", 0)
    assert drained(queue) == [second]
    assert list(queue.waiting()) == []


def test_a_full_queue_sheds_the_newest_of_the_most_served_tenant_in_the_lowest_band() -> None:
    queue = ModelQueue()
    noisy = [queued(queue, "noisy") for _ in range(3)]
    queued(queue, "acme")
    counter = counters(noisy=100, acme=10)
    # A less served tenant's request displaces the flood's newest ...
    assert queue.victim(queue.new("globex", 0, 0.0, None), counter) is noisy[-1]
    # ... the flood's own new request is shed itself, as is one no less served.
    assert queue.victim((own := queue.new("noisy", 0, 0.0, None)), counter) is own
    rich = queue.new("rich", 0, 0.0, None)
    assert queue.victim(rich, counters(noisy=1, rich=2)) is rich


def test_sheddable_bands_are_shed_first_and_a_lower_band_never_displaces_a_higher() -> None:
    queue = ModelQueue()
    queued(queue, "acme", band=3)
    sheddable = queued(queue, "batch", band=-1)
    assert queue.victim(queue.new("acme", 3, 0.0, None), counters(batch=0, acme=99)) is sheddable
    lower = queue.new("batch", -2, 0.0, None)
    assert queue.victim(lower, counters()) is lower
