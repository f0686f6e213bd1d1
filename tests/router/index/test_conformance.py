"""The LocationIndex contract, checked against every backend (memory, Redis, Cluster)."""

from __future__ import annotations

import pytest

from kvplane.core.types import (
    MAX_CHAIN_END,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    Tier,
    WorkerInfo,
)
from router.index.base import SequenceMismatch, StaleIncarnation, UnknownWorker, WorkerState
from tests.router.index.conftest import IndexFactory, PassTime

LEASE = 30.0


def info(worker_id: str, incarnation: int = 1) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        incarnation=incarnation,
        base_url=f"http://{worker_id}.local:8000",
        model="tiny",
        block_size=16,
        kv_capacity_blocks=1000,
        engine_kind="engine-sim",
        labels={"zone": "a"},
    )


def chain(start: int, length: int) -> list[int]:
    """Stand-in block keys: any distinct 64-bit values behave alike in the index."""
    return [(start * 1_000_003 + i * 7919 + 2**63) % 2**64 for i in range(length)]


def stored(keys: list[int], tier: Tier = Tier.DEVICE, first_position: int = 0) -> BlocksStored:
    parent = None if first_position == 0 else 12345
    return BlocksStored(keys=keys, tier=tier, first_position=first_position, parent_key=parent)


async def test_lookup_returns_longest_consecutive_prefix_per_worker(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(1, 10)
    await index.register(info("a"), LEASE)
    await index.register(info("b"), LEASE)
    await index.register(info("c"), LEASE)
    await index.apply("a", 1, [stored(prompt[:6])])
    await index.apply("b", 1, [stored(prompt[:3])])
    # c holds later blocks but not the first: a prefix must start at the first key.
    await index.apply("c", 1, [stored(prompt[1:8], first_position=1)])

    matches = await index.lookup(prompt)

    assert {w: m.blocks for w, m in matches.items()} == {"a": 6, "b": 3}
    assert matches["a"].by_tier == {Tier.DEVICE: 6}
    assert matches["a"].incarnation == 1


async def test_a_gap_ends_the_prefix(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(2, 8)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(prompt[:3]), stored(prompt[4:], first_position=4)])

    assert (await index.lookup(prompt))["a"].blocks == 3


async def test_lookup_of_nothing_or_unknown_keys_is_empty(make_index: IndexFactory):
    index = await make_index()
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(chain(3, 4))])

    assert await index.lookup([]) == {}
    assert await index.lookup(chain(4, 4)) == {}


async def test_removal_shortens_the_prefix_and_is_idempotent(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(5, 6)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(prompt)])
    await index.apply("a", 1, [BlocksRemoved(keys=[prompt[4]], tier=Tier.DEVICE)])
    await index.apply("a", 1, [BlocksRemoved(keys=[prompt[4], chain(99, 1)[0]], tier=Tier.DEVICE)])

    assert (await index.lookup(prompt))["a"].blocks == 4
    assert (await index.stats()).entries == 5


async def test_storing_twice_counts_once(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(6, 4)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(prompt), stored(prompt)])

    stats = await index.stats()
    assert (stats.entries, stats.keys, stats.workers) == (4, 4, 1)


async def test_events_in_a_batch_apply_in_order(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(7, 3)
    await index.register(info("a"), LEASE)
    await index.apply(
        "a",
        1,
        [
            stored(prompt),
            BlocksRemoved(keys=prompt, tier=Tier.DEVICE),
            stored(prompt[:2]),
        ],
    )

    assert (await index.lookup(prompt))["a"].blocks == 2


async def test_clear_removes_every_tier_but_keeps_the_worker(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(8, 4)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(prompt), stored(prompt, Tier.HOST)])
    await index.apply("a", 1, [AllBlocksCleared()])

    assert await index.lookup(prompt) == {}
    assert (await index.stats()).entries == 0
    await index.apply("a", 1, [stored(prompt[:1])])
    assert (await index.lookup(prompt))["a"].blocks == 1


async def test_tiers_count_each_block_once_on_its_fastest_tier(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(9, 6)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(prompt[:2]), stored(prompt, Tier.HOST)])
    await index.apply("a", 1, [stored(prompt[4:6], Tier.DISK, first_position=4)])

    match = (await index.lookup(prompt))["a"]

    assert match.blocks == 6
    assert dict(match.by_tier) == {Tier.DEVICE: 2, Tier.HOST: 4}
    assert (await index.stats()).entries == 10


async def test_removal_on_one_tier_keeps_the_other(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(10, 3)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(prompt), stored(prompt, Tier.HOST)])
    await index.apply("a", 1, [BlocksRemoved(keys=prompt, tier=Tier.DEVICE)])

    match = (await index.lookup(prompt))["a"]
    assert (match.blocks, dict(match.by_tier)) == (3, {Tier.HOST: 3})


async def test_apply_for_unknown_worker_raises_and_changes_nothing(make_index: IndexFactory):
    index = await make_index()
    with pytest.raises(UnknownWorker):
        await index.apply("ghost", 1, [stored(chain(11, 2))])
    assert (await index.stats()).entries == 0
    assert await index.lookup(chain(11, 2)) == {}


@pytest.mark.parametrize("bad_key", [-1, 2**64, "7"], ids=["negative", "too-large", "string"])
async def test_a_bad_key_fails_the_whole_batch(make_index: IndexFactory, bad_key: object):
    index = await make_index()
    prompt = chain(28, 3)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(prompt[:1])])
    batch = [
        stored(prompt),
        BlocksRemoved(keys=prompt[:1], tier=Tier.DEVICE),
        stored([bad_key], first_position=3),  # type: ignore[list-item]
    ]

    with pytest.raises(ValueError, match="64-bit"):
        await index.apply("a", 1, batch)

    assert (await index.lookup(prompt))["a"].blocks == 1
    assert (await index.stats()).entries == 1


@pytest.mark.parametrize("first_position", [-1, MAX_CHAIN_END], ids=["negative", "past-end"])
async def test_a_bad_position_fails_the_whole_batch(make_index: IndexFactory, first_position: int):
    index = await make_index()
    prompt = chain(29, 2)
    await index.register(info("a"), LEASE)
    batch = [
        stored(prompt),
        BlocksStored(keys=[1, 2], tier=Tier.DEVICE, first_position=first_position, parent_key=3),
    ]

    with pytest.raises(ValueError, match="first_position"):
        await index.apply("a", 1, batch)

    assert await index.lookup(prompt) == {}
    assert (await index.stats()).entries == 0


async def test_new_incarnation_drops_the_old_ones_entries(make_index: IndexFactory):
    index = await make_index()
    old, new = chain(12, 4), chain(13, 4)
    await index.register(info("a", 1), LEASE)
    await index.apply("a", 1, [stored(old)])
    await index.register(info("a", 2), LEASE)
    await index.apply("a", 2, [stored(new)])

    assert await index.lookup(old) == {}
    assert (await index.lookup(new))["a"].incarnation == 2
    assert (await index.stats()).entries == 4


async def test_stale_incarnation_is_refused_everywhere(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(14, 3)
    await index.register(info("a", 5), LEASE)
    await index.apply("a", 5, [stored(prompt)])

    with pytest.raises(StaleIncarnation) as raised:
        await index.register(info("a", 4), LEASE)
    assert raised.value.current == 5
    with pytest.raises(StaleIncarnation):
        await index.apply("a", 4, [BlocksRemoved(keys=prompt, tier=Tier.DEVICE)])
    with pytest.raises(StaleIncarnation):
        await index.renew("a", 4, LEASE)

    assert (await index.lookup(prompt))["a"].blocks == 3
    (status,) = await index.workers()
    assert status.info.incarnation == 5


async def test_writes_for_a_newer_unregistered_incarnation_are_refused(make_index: IndexFactory):
    index = await make_index()
    await index.register(info("a", 1), LEASE)
    with pytest.raises(UnknownWorker):
        await index.apply("a", 2, [stored(chain(15, 2))])
    assert (await index.stats()).entries == 0


async def test_same_incarnation_registers_again_without_losing_entries(
    make_index: IndexFactory,
):
    index = await make_index()
    prompt = chain(16, 3)
    await index.register(info("a", 3), LEASE)
    await index.apply("a", 3, [stored(prompt)])
    await index.register(info("a", 3), LEASE)

    assert (await index.lookup(prompt))["a"].blocks == 3


async def test_the_index_records_where_a_reconnecting_agent_resumes(make_index: IndexFactory):
    index = await make_index()
    assert await index.register(info("a"), LEASE) == 0
    await index.apply("a", 1, [stored(chain(30, 4))], sequence=1)
    await index.apply("a", 1, [], sequence=2)  # an empty batch is recorded too

    assert await index.register(info("a"), LEASE) == 2  # a reconnect, through any router
    await index.apply("a", 1, [stored(chain(31, 2))], sequence=3)
    assert await index.register(info("a", incarnation=2), LEASE) == 0  # a new life


async def test_a_batch_out_of_sequence_is_refused_whole(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(32, 6)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(prompt[:3])], sequence=1)

    for sequence in (1, 3):  # one already recorded, one past a batch the index never saw
        with pytest.raises(SequenceMismatch) as refused:
            await index.apply("a", 1, [stored(prompt[3:], first_position=3)], sequence=sequence)
        assert (refused.value.expected, refused.value.recorded) == (sequence - 1, 1)

    assert (await index.lookup(prompt))["a"].blocks == 3
    await index.apply("a", 1, [stored(prompt[3:], first_position=3)], sequence=2)
    assert (await index.lookup(prompt))["a"].blocks == 6


async def test_a_renewal_is_refused_unless_the_index_holds_what_the_caller_applied(
    make_index: IndexFactory,
):
    index = await make_index()
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(chain(33, 2))], sequence=1)

    with pytest.raises(SequenceMismatch) as refused:
        await index.renew("a", 1, LEASE, applied=2)
    assert (refused.value.expected, refused.value.recorded) == (2, 1)
    await index.renew("a", 1, LEASE, applied=1)
    await index.renew("a", 1, LEASE)  # a caller without a stream checks nothing


async def test_writes_without_a_sequence_leave_the_recorded_one(make_index: IndexFactory):
    index = await make_index()
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(chain(34, 2))], sequence=1)
    await index.apply("a", 1, [AllBlocksCleared(), stored(chain(35, 2))])

    assert await index.register(info("a"), LEASE) == 1


async def test_an_incarnation_whose_lease_ran_out_resumes_until_it_is_purged(
    make_index: IndexFactory,
):
    index = await make_index()
    prompt = chain(36, 3)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [stored(prompt)], sequence=1)
    await index.renew("a", 1, 0)  # its lease ends (its agent could not renew)
    assert await index.lookup(prompt) == {}

    assert await index.register(info("a"), LEASE) == 1  # back before a purge: all kept
    assert (await index.lookup(prompt))["a"].blocks == 3
    await index.renew("a", 1, 0)
    assert await index.purge_expired() == ["a"]
    assert await index.register(info("a"), LEASE) == 0  # purged: nothing to resume
    assert await index.lookup(prompt) == {}


async def test_a_purge_spares_leases_that_ran_out_within_its_grace(
    make_index: IndexFactory, pass_time: PassTime
):
    index = await make_index()
    await index.register(info("a"), LEASE)
    await index.renew("a", 1, 0)

    assert await index.purge_expired(grace_s=LEASE) == []
    assert [s.state for s in await index.workers()] == [WorkerState.DEAD]
    await pass_time(0.3)
    assert await index.purge_expired(grace_s=0.2) == ["a"]


async def test_expired_lease_scores_nothing_and_is_purged(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(17, 3)
    await index.register(info("a"), LEASE)
    await index.register(info("b"), LEASE)
    await index.apply("a", 1, [stored(prompt)])
    await index.apply("b", 1, [stored(prompt)])
    await index.renew("a", 1, 0)  # lease ends now

    assert set(await index.lookup(prompt)) == {"b"}
    states = {s.info.worker_id: s.state for s in await index.workers()}
    assert states == {"a": WorkerState.DEAD, "b": WorkerState.LIVE}
    with pytest.raises(UnknownWorker):
        await index.apply("a", 1, [stored(chain(18, 1))])
    with pytest.raises(UnknownWorker):
        await index.renew("a", 1, LEASE)

    assert await index.purge_expired() == ["a"]
    assert [s.info.worker_id for s in await index.workers()] == ["b"]
    assert (await index.stats()).entries == 3


async def test_lease_runs_out_with_time(make_index: IndexFactory, pass_time: PassTime):
    index = await make_index()
    prompt = chain(19, 2)
    await index.register(info("a"), 0.3)
    await index.apply("a", 1, [stored(prompt)])
    assert set(await index.lookup(prompt)) == {"a"}

    await pass_time(0.5)

    assert await index.lookup(prompt) == {}
    assert await index.purge_expired() == ["a"]


async def test_a_lease_renewed_shorter_runs_out_at_its_new_end(
    make_index: IndexFactory, pass_time: PassTime
):
    index = await make_index()
    prompt = chain(21, 2)
    await index.register(info("a"), 30.0)
    await index.register(info("b"), 30.0)
    await index.apply("a", 1, [stored(prompt)])
    await index.apply("b", 1, [stored(prompt)])
    assert set(await index.lookup(prompt)) == {"a", "b"}
    await index.renew("b", 1, 30.0)  # a heartbeat between lookups changes nothing
    assert set(await index.lookup(prompt)) == {"a", "b"}

    await index.renew("a", 1, 0.3)
    await pass_time(0.5)

    assert set(await index.lookup(prompt)) == {"b"}


async def test_renew_keeps_a_worker_alive_and_marks_draining(
    make_index: IndexFactory, pass_time: PassTime
):
    index = await make_index()
    prompt = chain(20, 2)
    await index.register(info("a"), 0.4)
    await index.apply("a", 1, [stored(prompt)])
    for _ in range(3):
        await pass_time(0.2)
        await index.renew("a", 1, 0.4)
    await index.renew("a", 1, 0.4, draining=True)

    (status,) = await index.workers()
    assert status.state is WorkerState.DRAINING
    assert 0 < status.lease_remaining_s <= 0.4 + 1e-9  # a manual clock: all of it, rounded
    assert status.entries == 2
    # Draining workers still hold their cache; the scorer decides what to do with it.
    assert set(await index.lookup(prompt)) == {"a"}


async def test_dead_worker_can_register_a_new_incarnation(make_index: IndexFactory):
    index = await make_index()
    await index.register(info("a", 1), LEASE)
    await index.apply("a", 1, [stored(chain(21, 2))])
    await index.renew("a", 1, 0)
    await index.register(info("a", 2), LEASE)

    assert await index.lookup(chain(21, 2)) == {}
    (status,) = await index.workers()
    assert (status.info.incarnation, status.state, status.entries) == (2, WorkerState.LIVE, 0)


async def test_drop_worker_forgets_it(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(22, 3)
    await index.register(info("a"), LEASE)
    await index.register(info("b"), LEASE)
    await index.apply("a", 1, [stored(prompt)])
    await index.apply("b", 1, [stored(prompt[:1])])
    await index.drop_worker("a")
    await index.drop_worker("never-registered")

    assert {w: m.blocks for w, m in (await index.lookup(prompt)).items()} == {"b": 1}
    stats = await index.stats()
    assert (stats.workers, stats.entries, stats.keys) == (1, 1, 1)
    with pytest.raises(UnknownWorker):
        await index.apply("a", 1, [stored(prompt)])


async def test_drop_for_an_old_incarnation_keeps_the_new_one(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(27, 2)
    await index.register(info("a", 1), LEASE)
    await index.register(info("a", 2), LEASE)
    await index.apply("a", 2, [stored(prompt)])
    await index.drop_worker("a", 1)

    assert (await index.lookup(prompt))["a"].incarnation == 2
    await index.drop_worker("a", 2)
    assert await index.workers() == []


async def test_registration_is_reported(make_index: IndexFactory):
    index = await make_index()
    await index.register(info("a", 7), LEASE)

    (status,) = await index.workers()
    assert status.info == info("a", 7)
    assert status.state is WorkerState.LIVE


async def test_stats_count_keys_entries_workers_and_bytes(make_index: IndexFactory):
    index = await make_index()
    shared = chain(23, 4)
    await index.register(info("a"), LEASE)
    await index.register(info("b"), LEASE)
    await index.apply("a", 1, [stored(shared)])
    await index.apply("b", 1, [stored(shared[:2]), stored(chain(24, 3))])

    stats = await index.stats()
    assert (stats.keys, stats.entries, stats.workers) == (7, 9, 2)
    assert stats.bytes > 0


async def test_many_workers_share_one_walk(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(25, 40)
    for n in range(40):
        await index.register(info(f"w{n}"), LEASE)
        await index.apply(f"w{n}", 1, [stored(prompt[:n])])

    matches = await index.lookup(prompt)

    assert {w: m.blocks for w, m in matches.items()} == {f"w{n}": n for n in range(1, 40)}


async def test_more_workers_than_one_mask_word(make_index: IndexFactory):
    index = await make_index()
    prompt = chain(26, 3)
    for n in range(130):
        await index.register(info(f"w{n}"), LEASE)
    await index.apply("w129", 1, [stored(prompt)])
    await index.apply("w64", 1, [stored(prompt[:2])])
    await index.apply("w0", 1, [stored(prompt[:1])])

    matches = await index.lookup(prompt)

    assert {w: m.blocks for w, m in matches.items()} == {"w129": 3, "w64": 2, "w0": 1}


async def test_max_entries_evicts_the_deepest_blocks(make_index: IndexFactory):
    index = await make_index(max_entries=100)
    await index.register(info("a"), LEASE)
    for start in range(6):
        await index.apply("a", 1, [stored(chain(100 + start, 30))])

    stats = await index.stats()
    assert stats.entries <= 100
    # The shallow head of every chain survives; eviction took from the deep ends.
    for start in range(6):
        assert (await index.lookup(chain(100 + start, 30)))["a"].blocks >= 5


async def test_max_entries_evicts_dead_workers_first(make_index: IndexFactory):
    index = await make_index(max_entries=100)
    live_prompt, dead_prompt = chain(200, 40), chain(201, 50)
    await index.register(info("dead"), LEASE)
    await index.register(info("live"), LEASE)
    await index.apply("dead", 1, [stored(dead_prompt)])
    await index.apply("live", 1, [stored(live_prompt)])
    await index.renew("dead", 1, 0)
    await index.apply("live", 1, [stored(chain(202, 20))])

    assert (await index.lookup(live_prompt))["live"].blocks == 40
    assert (await index.stats()).entries <= 100
    assert [s.info.worker_id for s in await index.workers()] == ["live"]


async def test_scope_generations_count_up_per_scope(make_index: IndexFactory):
    index = await make_index()
    assert await index.scope_generations() == {}
    assert await index.bump_scope_generation("acme") == 1
    assert await index.bump_scope_generation("acme") == 2
    assert await index.bump_scope_generation("globex") == 1
    assert await index.scope_generations() == {"acme": 2, "globex": 1}
