"""What only the Redis backend has: its layout and expiry, several routers sharing one
Redis, fencing beyond 2^53, unreachable servers, script reloads, moved cluster slots,
the searchable-prefix bookkeeping, per-worker eviction and the key-count estimate.

Every test talks to a real Redis server or a real Redis Cluster (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ResponseError

from kvplane.core.config import IndexSettings
from kvplane.core.serving import free_port
from kvplane.core.types import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    Tier,
    WorkerInfo,
)
from router.index import open_index
from router.index.base import (
    IndexUnavailable,
    LocationIndex,
    LocationIndexError,
    StaleIncarnation,
    UnknownWorker,
)
from router.index.memory import MemoryLocationIndex
from router.index.redis import (
    REGISTRY_MAX_AGE_S,
    ROUND_TRIP_TIMEOUT_S,
    KeyLayout,
    RedisLocationIndex,
)
from tests.clock import ManualClock
from tests.redis_servers import stoppable_redis
from tests.router.index.conftest import delete_prefix, redis_url_for

LEASE = 30.0
UNKNOWN_PARENT = b"unknown-parent"  # entries.lua's placeholder for runs without a parent


def info(worker_id: str, incarnation: int = 1) -> WorkerInfo:
    return WorkerInfo(worker_id, incarnation, f"http://{worker_id}:8000", "tiny", 16)


def chain(number: int, length: int) -> list[int]:
    rng = random.Random(number)
    return [rng.getrandbits(64) for _ in range(length)]


def run(keys: list[int], start: int = 0, tier: Tier = Tier.DEVICE) -> BlocksStored:
    """keys[start:] stored as one chained run, with its true parent."""
    parent = keys[start - 1] if start else None
    return BlocksStored(keys[start:], tier, first_position=start, parent_key=parent)


class Redises:
    """Indexes over one Redis (or cluster) and one key prefix, closed and wiped after."""

    def __init__(self, url: str, cluster: bool, directory: bool = False) -> None:
        self.url = url
        self.cluster = cluster
        self.prefix = f"kvptest-{uuid.uuid4().hex[:10]}"
        self.layout = KeyLayout(self.prefix, directory=directory)
        self.opened: list[RedisLocationIndex] = []
        self.admin: aioredis.Redis | RedisCluster = (
            RedisCluster.from_url(url) if cluster else aioredis.Redis.from_url(url)
        )

    def index(self, **options: Any) -> RedisLocationIndex:
        if "groups" in options:  # every index of a test shares one layout
            self.layout = KeyLayout(self.prefix, options["groups"], self.layout.directory)
        opened = RedisLocationIndex.from_url(
            self.url,
            cluster=self.cluster,
            prefix=self.prefix,
            directory=self.layout.directory,
            **options,
        )
        self.opened.append(opened)
        return opened

    def index_over_client(self, **options: Any) -> RedisLocationIndex:
        client = (
            RedisCluster.from_url(self.url) if self.cluster else aioredis.Redis.from_url(self.url)
        )
        opened = RedisLocationIndex(
            client, prefix=self.prefix, directory=self.layout.directory, **options
        )
        self.opened.append(opened)
        return opened

    def worker_key(self, worker_id: str) -> str:
        return self.layout.worker(worker_id).decode()

    async def worker_hash(self, worker_id: str) -> dict[bytes, bytes]:
        return await self._hash(self.layout.worker(worker_id))

    async def member(self, worker_id: str) -> Member:
        """The worker's member record in its group's roster."""
        roster = self.layout.roster_of(worker_id)
        record = await self.admin.hget(roster, self.layout.worker(worker_id))  # type: ignore[misc]
        assert record is not None, f"{worker_id} is not in its group's roster"
        return decode_member(_as_bytes(record))

    async def check_directories(self) -> None:
        """Every group's directory holds exactly its members' held blocks, once the
        retired ones are swept: a block's bit set is the members holding it."""
        for group in range(self.layout.groups):
            roster_key, directory_key, retiring_key = self.layout.group_keys(group)
            assert await self.admin.exists(retiring_key) == 0, "retired members not swept"
            if not self.layout.directory:
                assert await self.admin.exists(directory_key) == 0
                continue
            roster = await self._hash(roster_key)
            expected: dict[bytes, int] = {}
            for name, record in roster.items():
                bit = 1 << decode_member(record).index
                for field, value in (await self._hash(name)).items():
                    if len(field) == 8 and value[0]:  # held, not a placeholder
                        expected[field] = expected.get(field, 0) | bit
            directory = {
                field: int.from_bytes(bits, "little")
                for field, bits in (await self._hash(directory_key)).items()
            }
            assert directory == expected, f"group {group}"

    async def keys(self) -> list[bytes]:
        """Every key under the prefix, on every node."""
        pattern = f"{self.prefix}:*"
        if isinstance(self.admin, RedisCluster):
            found = await self.admin.keys(pattern, target_nodes=RedisCluster.PRIMARIES)
        else:
            found = await self.admin.keys(pattern)
        return sorted(found)

    async def _hash(self, key: bytes) -> dict[bytes, bytes]:
        content = await self.admin.hgetall(key)  # type: ignore[misc]
        return {_as_bytes(field): _as_bytes(value) for field, value in content.items()}

    async def close(self) -> None:
        for opened in self.opened:
            await opened.close()
        await self.admin.aclose()
        await delete_prefix(self.url, self.cluster, self.prefix)


def _as_bytes(value: bytes | str) -> bytes:
    """The admin clients do not decode replies: this only narrows redis-py's types."""
    assert isinstance(value, bytes)
    return value


@pytest.fixture(params=["redis", "redis-cluster", "redis-directory", "redis-cluster-directory"])
async def redises(request: pytest.FixtureRequest) -> AsyncIterator[Redises]:
    """A Redis or a cluster, in each layout (with and without group directories)."""
    async with _redises(request) as target:
        yield target


@pytest.fixture(params=["redis-directory", "redis-cluster-directory"])
async def directory_redises(request: pytest.FixtureRequest) -> AsyncIterator[Redises]:
    """As `redises`, in the layout with group directories only."""
    async with _redises(request) as target:
        yield target


@contextlib.asynccontextmanager
async def _redises(request: pytest.FixtureRequest) -> AsyncIterator[Redises]:
    backend = str(request.param)
    url = redis_url_for(backend, request)
    assert url is not None
    target = Redises(url, backend.startswith("redis-cluster"), backend.endswith("directory"))
    try:
        yield target
    finally:
        await target.close()


@pytest.fixture(params=["redis", "redis-cluster"])
async def own_redises(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Redises]:
    """As `redises`, but never the machine's shared Redis: for a test that changes a
    server's settings (a single server of its own; the cluster the tests started)."""
    with contextlib.ExitStack() as servers:
        if request.param == "redis-cluster":
            url = request.getfixturevalue("redis_cluster_url")
        else:
            url, _ = servers.enter_context(stoppable_redis(tmp_path))
        target = Redises(url, request.param == "redis-cluster")
        yield target
        await target.close()


@pytest.fixture
async def cluster(redis_cluster_url: str) -> AsyncIterator[Redises]:
    target = Redises(redis_cluster_url, cluster=True)
    yield target
    await target.close()


# -- the worker's record, entries and counters, read back raw -----------------------


class Member(NamedTuple):
    index: int
    deadline: float
    search_tier: int
    incarnation: int


def decode_member(value: bytes) -> Member:
    index, deadline, search_tier = struct.unpack(">HdB", value[:11])
    return Member(index, deadline, search_tier, int(value[11:]))


def check_bookkeeping(content: dict[bytes, bytes], member: Member) -> None:
    """Recompute every counter of entries.lua from the entries themselves."""
    entries = {f: v for f, v in content.items() if len(f) == 8 or f == UNKNOWN_PARENT}
    decoded = {f: (*struct.unpack(">BHI", v[:7]), v[7:]) for f, v in entries.items()}
    held = {f for f, (mask, *_) in decoded.items() if mask}
    children: dict[bytes, int] = {}
    for field in held:
        parent = decoded[field][3]
        if parent:
            children[parent] = children.get(parent, 0) + 1
    orphans = 0
    for field, (mask, _, recorded_children, _) in decoded.items():
        assert recorded_children == children.get(field, 0), field
        if not mask:
            assert recorded_children > 0, "a placeholder without children was kept"
            orphans += recorded_children
    fastest = [0] * 4
    for field in held:
        mask = decoded[field][0]
        fastest[(mask & -mask).bit_length() - 1] += 1
    assert int(content[b"meta.entries"]) == sum(decoded[f][0].bit_count() for f in held)
    assert int(content[b"meta.orphans"]) == orphans
    assert [int(content[f"meta.tier{t}".encode()]) for t in range(1, 5)] == fastest
    searchable = orphans == 0 and sum(1 for count in fastest if count) == 1
    expected_tier = fastest.index(max(fastest)) + 1 if searchable else 0
    assert member.search_tier == expected_tier


def held_prefix(content: dict[bytes, bytes], keys: list[int]) -> int:
    """How many of `keys`, from the first, the worker's hash holds."""
    length = 0
    # A placeholder (mask 0, see entries.lua) is a block the worker does not hold.
    while length < len(keys) and content.get(struct.pack("<Q", keys[length]), b"\0")[0]:
        length += 1
    return length


# -- layout and expiry ---------------------------------------------------------------


async def test_a_worker_is_one_hash_with_a_ttl_beyond_its_lease(redises: Redises) -> None:
    index = redises.index(grace_s=60)
    keys = chain(1, 3)
    await index.register(info("a"), 5)
    await index.apply("a", 1, [run(keys)])

    content = await redises.worker_hash("a")
    blocks = {field for field in content if len(field) == 8}
    assert blocks == {struct.pack("<Q", key) for key in keys}
    assert (await redises.member("a"))[2:] == (Tier.DEVICE, 1)
    ttl_ms = await redises.admin.pttl(redises.worker_key("a"))
    assert 60_000 < ttl_ms <= 65_000
    assert await redises.admin.smembers(f"{redises.prefix}:workers") == {b"a"}
    assert await redises.admin.pttl(f"{redises.prefix}:workers") > 60_000

    await index.renew("a", 1, 20)
    assert 75_000 < await redises.admin.pttl(redises.worker_key("a")) <= 80_000


@pytest.mark.parametrize("groups", [0, 257])
def test_a_group_count_out_of_range_is_refused_by_the_settings_and_the_index(
    redis_url: str, groups: int
) -> None:
    with pytest.raises(ValueError, match="redis_groups"):
        IndexSettings(backend="redis", redis_url=redis_url, redis_groups=groups)
    with pytest.raises(ValueError, match=r"groups must be within 1\.\.256"):
        RedisLocationIndex.from_url(redis_url, prefix="kvptest", groups=groups)


async def test_the_layout_comes_from_the_settings_and_layouts_never_mix(
    redis_url: str,
) -> None:
    prefix = f"kvptest-{uuid.uuid4().hex[:10]}"
    settings = IndexSettings(
        backend="redis",
        redis_url=redis_url,
        redis_prefix=prefix,
        redis_groups=4,
        redis_directory=True,
    )
    index = open_index(settings)
    other = RedisLocationIndex.from_url(redis_url, prefix=prefix, groups=4)  # no directories
    admin = aioredis.Redis.from_url(redis_url)
    try:
        prompt = chain(3, 5)
        await index.register(info("a"), LEASE)
        await index.apply("a", 1, [run(prompt)])

        layout = KeyLayout(prefix, 4, directory=True)
        roster, directory, _ = layout.group_keys(layout.group_of("a"))
        assert await admin.exists(layout.worker("a"), roster, directory) == 3
        assert (await index.lookup(prompt))["a"].blocks == 5
        # A router of another layout lists the worker (one registry) but finds none of
        # its keys: it scores nothing rather than reading a layout it does not write.
        assert await other.lookup(prompt) == {}
    finally:
        await index.close()
        await other.close()
        await admin.aclose()
        await delete_prefix(redis_url, False, prefix)


async def test_every_key_expires_when_no_router_purges(redises: Redises) -> None:
    index = redises.index(grace_s=0.2)
    await index.register(info("a"), 0.2)
    await index.apply("a", 1, [run(chain(2, 4))])

    await asyncio.sleep(0.6)

    assert await redises.admin.exists(redises.worker_key("a")) == 0
    assert await redises.admin.exists(f"{redises.prefix}:workers") == 0
    assert await redises.keys() == []
    assert await index.workers() == []
    assert await index.purge_expired() == []


async def test_clear_keeps_the_record_and_the_ttl(redises: Redises) -> None:
    index = redises.index()
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [run(chain(3, 4)), AllBlocksCleared(), run(chain(4, 2))])

    content = await redises.worker_hash("a")
    assert {field for field in content if len(field) == 8} == {
        struct.pack("<Q", key) for key in chain(4, 2)
    }
    assert await redises.admin.pttl(redises.worker_key("a")) > 0
    (status,) = await index.workers()
    assert (status.info, status.entries) == (info("a"), 2)


# -- several routers, one Redis --------------------------------------------------------


async def test_routers_sharing_a_redis_see_one_fleet(redises: Redises) -> None:
    first, second = redises.index(), redises.index()
    prompt = chain(5, 6)
    await first.register(info("a"), LEASE)
    await first.apply("a", 1, [run(prompt)])

    assert (await second.lookup(prompt))["a"].blocks == 6
    await second.renew("a", 1, 0)
    # The lease lives in Redis: the first router stops scoring "a" at once, although
    # its cached worker list still names it.
    assert await first.lookup(prompt) == {}
    assert await first.purge_expired() == ["a"]
    assert await second.workers() == []


async def test_a_fleet_registering_at_once_is_served_not_refused(redises: Redises) -> None:
    # A router restarted under a big fleet takes every agent's registration and first
    # batch at once: more calls than redis-py's cluster client keeps connections to a
    # node (it refuses the rest with MaxConnectionsError, no wait): they queue instead.
    index = redises.index()
    prompt = chain(7, 4)

    async def join(number: int) -> None:
        await index.register(info(f"w{number}"), LEASE)
        await index.apply(f"w{number}", 1, [run(prompt)])

    await asyncio.gather(*(join(number) for number in range(300)))
    assert len(await index.lookup(prompt)) == 300


async def test_a_worker_registered_elsewhere_is_scored_within_a_second(redises: Redises) -> None:
    clock = ManualClock()  # ages the second router's copy of the registry
    first, second = redises.index(), redises.index(clock=clock)
    prompt = chain(6, 3)
    assert await second.lookup(prompt) == {}  # reads (and caches) the empty registry
    await first.register(info("a"), LEASE)
    await first.apply("a", 1, [run(prompt)])

    clock.advance(REGISTRY_MAX_AGE_S + 0.1)

    assert (await second.lookup(prompt))["a"].blocks == 3


async def test_concurrent_purges_report_each_dead_worker_once(redises: Redises) -> None:
    first, second = redises.index(), redises.index()
    for n in range(6):
        await first.register(info(f"w{n}"), LEASE)
        if n % 2:
            await first.renew(f"w{n}", 1, 0)

    purged = await asyncio.gather(first.purge_expired(), second.purge_expired())

    assert sorted(purged[0] + purged[1]) == ["w1", "w3", "w5"]
    assert not set(purged[0]) & set(purged[1])
    assert [s.info.worker_id for s in await second.workers()] == ["w0", "w2", "w4"]


async def test_a_heartbeat_relists_a_worker_a_racing_drop_unlisted(redises: Redises) -> None:
    first, second = redises.index(), redises.index()
    prompt = chain(7, 2)
    await first.register(info("a"), LEASE)
    await first.apply("a", 1, [run(prompt)])
    # What a drop racing this registration can leave: the record without its listing.
    await redises.admin.srem(f"{redises.prefix}:workers", "a")
    assert await second.lookup(prompt) == {}

    await first.renew("a", 1, LEASE)

    assert [s.info.worker_id for s in await second.workers()] == ["a"]
    assert (await second.lookup(prompt))["a"].blocks == 2


async def test_drop_of_an_old_incarnation_keeps_the_listing(redises: Redises) -> None:
    first, second = redises.index(), redises.index()
    await first.register(info("a", 1), LEASE)
    await second.register(info("a", 2), LEASE)

    await first.drop_worker("a", 1)

    assert await redises.admin.smembers(f"{redises.prefix}:workers") == {b"a"}
    assert [s.info.incarnation for s in await first.workers()] == [2]


# -- fencing and validation --------------------------------------------------------


async def test_incarnations_beyond_2_to_the_53_compare_exactly(redises: Redises) -> None:
    index = redises.index()
    big = 2**63 + 1
    await index.register(info("a", big), LEASE)

    with pytest.raises(StaleIncarnation) as raised:
        await index.register(info("a", big - 1), LEASE)
    assert raised.value.current == big
    with pytest.raises(UnknownWorker):
        await index.apply("a", big + 1, [run(chain(8, 1))])
    await index.register(info("a", 2**64 - 1), LEASE)
    assert [s.info.incarnation for s in await index.workers()] == [2**64 - 1]


async def test_values_redis_cannot_hold_are_refused_before_anything_is_sent(
    redises: Redises,
) -> None:
    index = redises.index()
    await index.register(info("a"), LEASE)
    with pytest.raises(ValueError, match="worker id"):
        await index.register(info("a{b}"), LEASE)
    with pytest.raises(ValueError, match="incarnation"):
        await index.register(info("b", 2**64), LEASE)
    with pytest.raises(ValueError, match="incarnation"):
        await index.renew("a", -1, LEASE)
    with pytest.raises(ValueError, match="64-bit"):
        await index.apply("a", 1, [run(chain(9, 2)), BlocksStored([-1], Tier.DEVICE)])
    with pytest.raises(ValueError, match="64-bit"):
        await index.lookup([2**64])

    assert (await index.stats()).entries == 0


# -- failures ------------------------------------------------------------------------


@pytest.mark.parametrize("cluster", [False, True], ids=["redis", "redis-cluster"])
async def test_an_unreachable_redis_raises_index_unavailable(cluster: bool) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    index = RedisLocationIndex.from_url(url, cluster=cluster, prefix="kvptest-down")
    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: index.register(info("a"), LEASE),
        lambda: index.renew("a", 1, LEASE),
        lambda: index.apply("a", 1, [run(chain(10, 2))]),
        lambda: index.drop_worker("a"),
        index.purge_expired,
        lambda: index.lookup(chain(10, 2)),
        index.workers,
        index.stats,
    ]
    try:
        for call in calls:
            started = time.monotonic()
            with pytest.raises(IndexUnavailable, match=url.removesuffix("/0")):
                await call()
            assert time.monotonic() - started < 5
    finally:
        await index.close()


async def test_a_server_that_stops_answering_raises_index_unavailable() -> None:
    async def accept_and_say_nothing(reader: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        await reader.read()  # holds the connection open until the client goes

    server = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    index = RedisLocationIndex.from_url(f"redis://127.0.0.1:{port}/0", prefix="kvptest-mute")
    try:
        started = time.monotonic()
        with pytest.raises(IndexUnavailable):
            await index.lookup(chain(14, 2))
        assert time.monotonic() - started < ROUND_TRIP_TIMEOUT_S + 1
    finally:
        await index.close()
        server.close()


async def test_a_server_that_cannot_serve_now_raises_index_unavailable(tmp_path: Path) -> None:
    """Replies that mean "not now" (out of memory, busy with a script) are outages."""
    with stoppable_redis(tmp_path) as (url, _):
        index = RedisLocationIndex.from_url(url, prefix="kvptest-busy")
        admin = aioredis.Redis.from_url(url)
        busy = aioredis.Redis.from_url(url)
        try:
            await admin.config_set("maxmemory", 1)  # every write refused: OOM
            with pytest.raises(IndexUnavailable, match="OutOfMemoryError"):
                await index.register(info("a"), LEASE)
            await admin.config_set("maxmemory", 0)
            await admin.config_set("lua-time-limit", 10)  # BUSY after 10 ms of a script
            spinning = asyncio.create_task(busy.eval("while true do end", 0))
            await asyncio.sleep(0.1)
            with pytest.raises(IndexUnavailable, match="BUSY"):
                await index.workers()
            await admin.script_kill()
            with pytest.raises(ResponseError):
                await spinning
            assert await index.workers() == []
        finally:
            await index.close()
            await admin.aclose()
            await busy.aclose()


async def test_a_key_of_another_type_is_a_bug_not_an_outage(redises: Redises) -> None:
    """What Redis refuses as wrong (here a key another program wrote under our prefix) is
    raised as it is: callers must not route around it as if Redis were down."""
    index = redises.index()
    await redises.admin.set(f"{redises.prefix}:workers", "not a set")
    with pytest.raises(ResponseError, match="WRONGTYPE") as raised:
        await index.workers()
    assert not isinstance(raised.value, LocationIndexError)


async def test_a_task_waiting_on_the_index_can_always_be_cancelled(redises: Redises) -> None:
    """The router stops its tasks by cancelling them: no Redis call may swallow that."""
    index = redises.index()
    await index.register(info("a"), LEASE)
    rng = random.Random(15)

    async def busy() -> None:
        while True:
            await index.purge_expired()

    for _ in range(100):
        task = asyncio.create_task(busy())
        await asyncio.sleep(rng.random() * 0.005)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=1)
        assert done, "a cancellation was swallowed"


async def test_scripts_flushed_from_the_servers_are_loaded_again(cluster: Redises) -> None:
    index = cluster.index()
    prompt = chain(11, 3)
    await index.register(info("a"), LEASE)
    await cluster.admin.script_flush()

    await index.apply("a", 1, [run(prompt)])
    await cluster.admin.script_flush()

    assert (await index.lookup(prompt))["a"].blocks == 3


async def test_a_lookup_follows_a_slot_moved_to_another_node(cluster: Redises) -> None:
    index = cluster.index()
    prompt = chain(12, 5)
    for n in range(6):
        await index.register(info(f"w{n}"), LEASE)
        await index.apply(f"w{n}", 1, [run(prompt[: n + 1])])
    expected = {f"w{n}": n + 1 for n in range(1, 5)} | {"w0": 1, "w5": 5}
    assert {w: m.blocks for w, m in (await index.lookup(prompt)).items()} == expected

    # Move w3's slot to another node behind the index's back: its cached slot map now
    # sends w3 to the wrong node.
    slot = key_slot(cluster.worker_key("w3").encode())
    await _move_slot(cluster, slot)
    try:
        assert {w: m.blocks for w, m in (await index.lookup(prompt)).items()} == expected
        # Grouped again by the slot map the redirections mended: no worker is asked on
        # its own (those calls go through _run; a node's group does not).
        asked_alone = 0
        run_commands = index._run

        async def counting_run(*args: Any, **kwargs: Any) -> list[Any]:
            nonlocal asked_alone
            asked_alone += 1
            return await run_commands(*args, **kwargs)

        index._run = counting_run  # type: ignore[method-assign]
        assert {w: m.blocks for w, m in (await index.lookup(prompt)).items()} == expected
        assert asked_alone == 0
    finally:
        await _move_slot(cluster, slot)


async def test_an_id_in_the_registry_no_router_wrote_is_left_out(redises: Redises) -> None:
    writer = redises.index()
    prompt = chain(7, 4)
    await writer.register(info("w1"), LEASE)
    await writer.apply("w1", 1, [run(prompt)])
    # A brace would move the hash tag; lookup.lua splits names on spaces, groups on
    # newlines.
    await redises.admin.sadd(f"{redises.prefix}:workers", "a b", "{c}", "", "d\ne")
    reader = redises.index()  # reads the registry at its first lookup
    assert {w: m.blocks for w, m in (await reader.lookup(prompt)).items()} == {"w1": 4}


async def _move_slot(cluster: Redises, slot: int) -> None:
    """Migrate one hash slot, with its keys, to another primary (redis-cli's steps)."""
    admin = cluster.admin
    assert isinstance(admin, RedisCluster)
    await admin.initialize()
    source = admin.nodes_manager.slots_cache[slot][0]
    target = next(node for node in admin.get_primaries() if node.name != source.name)

    async def node_id(node: Any) -> str:
        reply = await admin.execute_command("CLUSTER MYID", target_nodes=node)
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    source_id, target_id = await node_id(source), await node_id(target)
    await admin.execute_command(
        "CLUSTER SETSLOT", slot, "IMPORTING", source_id, target_nodes=target
    )
    await admin.execute_command(
        "CLUSTER SETSLOT", slot, "MIGRATING", target_id, target_nodes=source
    )
    keys = await admin.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000, target_nodes=source)
    if keys:
        await admin.execute_command(
            "MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys, target_nodes=source
        )
    for node in admin.get_primaries():
        await admin.execute_command("CLUSTER SETSLOT", slot, "NODE", target_id, target_nodes=node)
    await admin.nodes_manager.initialize()


# -- lookups against the reference ---------------------------------------------------


@pytest.mark.parametrize(("seed", "groups"), [(1, 1), (2, 1), (3, 16)])
async def test_lookups_and_bookkeeping_match_the_memory_index(
    redises: Redises, seed: int, groups: int
) -> None:
    """Random runs, removals, gaps, orphans adopted later, tiers, clears and restarts:
    every lookup (searched or walked) and every count equal the reference's, and the
    directories hold exactly what the workers do (one group: every worker shares it)."""
    rng = random.Random(seed)
    index, reference = redises.index(groups=groups), MemoryLocationIndex()
    workers = ["a", "b", "c", "d"]
    incarnations = dict.fromkeys(workers, 1)
    chains = [chain(100 * seed + n, 40) for n in range(3)]
    for worker in workers:
        for backend in (index, reference):
            await backend.register(info(worker), LEASE)
    for _ in range(40):
        worker = rng.choice(workers)
        if rng.random() < 0.1:  # a restart: the old incarnation's entries retire
            incarnations[worker] += 1
            for backend in (index, reference):
                await backend.register(info(worker, incarnations[worker]), LEASE)
        batch = [_random_event(rng, chains) for _ in range(rng.randint(1, 3))]
        for backend in (index, reference):
            await backend.apply(worker, incarnations[worker], batch)
        await _assert_same_lookups(rng, chains, index, reference)
        check_bookkeeping(await redises.worker_hash(worker), await redises.member(worker))
        await redises.check_directories()
    stats, expected = await index.stats(), await reference.stats()
    assert (stats.keys, stats.entries, stats.workers) == (
        expected.keys,
        expected.entries,
        expected.workers,
    )


async def test_a_dropped_workers_index_is_reused_only_once_swept(
    directory_redises: Redises,
) -> None:
    redises = directory_redises
    # One group, so that the workers share a directory; a cache larger than one sweep
    # (SWEEP_BUDGET in common.lua), so that the drop leaves bits to sweep later.
    index = redises.index(groups=1)
    cached, other = chain(60, 3000), chain(61, 4)
    await index.register(info("a"), LEASE)
    await index.apply("a", 1, [run(cached)])
    await index.register(info("b"), LEASE)
    await index.apply("b", 1, [run(other)])

    await index.drop_worker("a")
    _, _, retiring = redises.layout.group_keys(0)
    assert await redises.admin.hkeys(retiring) == [b"0"]  # type: ignore[misc]
    # While a's bits are being swept its index is not given out again.
    await index.register(info("c"), LEASE)
    await index.apply("c", 1, [run(cached[:3])])
    assert (await redises.member("c")).index == 2
    assert {w: m.blocks for w, m in (await index.lookup(cached)).items()} == {"c": 3}

    for _ in range(5):
        await index.purge_expired()  # sweeps as it purges
    await redises.check_directories()
    await index.register(info("d"), LEASE)
    assert (await redises.member("d")).index == 0
    await index.apply("d", 1, [run(cached[:7])])
    assert {w: m.blocks for w, m in (await index.lookup(cached)).items()} == {"c": 3, "d": 7}


async def test_a_groups_keys_share_one_expiry(directory_redises: Redises) -> None:
    # A directory that outlived its roster would hand a new member old bits.
    redises = directory_redises
    index = redises.index(groups=1, grace_s=60)
    await index.register(info("a"), 5)
    await index.apply("a", 1, [run(chain(63, 3000))])  # the directory made after the roster
    await index.register(info("b"), 40)  # extends the group (past the quarter more)
    await index.drop_worker("a")  # leaves a sweep to do: the retiring list made last

    keys = redises.layout.group_keys(0)
    ttls = [await redises.admin.pttl(key) for key in keys]
    assert min(ttls) > 60_000
    assert max(ttls) - min(ttls) < 100, ttls  # milliseconds apart at most


async def test_a_directory_its_roster_left_behind_is_not_inherited(
    directory_redises: Redises,
) -> None:
    redises = directory_redises
    cached = chain(64, 40)
    index = await _one_group_holding(redises, ["a"], cached)
    # What a roster expiring before its directory would leave: bits, and no record of
    # whose they are.
    roster, directory, _ = redises.layout.group_keys(0)
    await redises.admin.delete(roster)

    await index.register(info("b"), LEASE)
    await index.apply("b", 1, [run(cached[:3])])

    assert (await redises.member("b")).index == 0
    assert {w: m.blocks for w, m in (await index.lookup(cached)).items()} == {"b": 3}
    assert await redises.admin.hlen(directory) == 3  # type: ignore[misc]


async def test_bits_of_a_retired_cache_that_expired_are_found_in_the_directory(
    directory_redises: Redises,
) -> None:
    redises = directory_redises
    cached = chain(62, 3000)
    index = await _one_group_holding(redises, ["a", "b"], cached)
    await index.drop_worker("a")
    # What a retired cache's expiry leaves: its bits, and nothing that names them.
    await redises.admin.delete(f"{redises.layout.group_base(0)}:retired:0")

    for _ in range(30):
        await index.purge_expired()
    await redises.check_directories()
    await index.register(info("c"), LEASE)
    assert (await redises.member("c")).index == 0
    assert {w: m.blocks for w, m in (await index.lookup(cached)).items()} == {"b": 3000}


async def _one_group_holding(
    redises: Redises, workers: list[str], cached: list[int]
) -> RedisLocationIndex:
    """An index whose workers all share one group (and its directory), each of
    `workers` registered and holding `cached`."""
    index = redises.index(groups=1)
    for worker in workers:
        await index.register(info(worker), LEASE)
        await index.apply(worker, 1, [run(cached)])
    return index


def _random_event(rng: random.Random, chains: list[list[int]]) -> KvEvent:
    keys = rng.choice(chains)
    start = rng.choice([0, 0, 0, rng.randrange(40)])
    end = rng.randint(start + 1, 40)
    tier = Tier.DEVICE if rng.random() < 0.8 else Tier.HOST
    roll = rng.random()
    if roll < 0.55:
        parent = keys[start - 1] if start else None
        if start and rng.random() < 0.2:
            parent = None  # an engine that does not say: the run's parent is unknown
        return BlocksStored(keys[start:end], tier, first_position=start, parent_key=parent)
    if roll < 0.95:
        return BlocksRemoved(rng.sample(keys[start:end], rng.randint(1, end - start)), tier)
    return AllBlocksCleared()


async def _assert_same_lookups(
    rng: random.Random, chains: list[list[int]], index: LocationIndex, reference: LocationIndex
) -> None:
    requests = [list(keys) for keys in chains]
    requests += [keys[:length] for keys in chains for length in (1, 2)]  # the shortest spans
    requests += [keys[: rng.randint(1, 40)] + chain(rng.randrange(10**6), 5) for keys in chains]
    for request in requests:
        assert await index.lookup(request) == await reference.lookup(request)


@pytest.mark.parametrize("groups", [1, 16])  # all in one directory, or mostly alone
async def test_many_workers_ending_at_different_places_on_one_long_prompt(
    redises: Redises, groups: int
) -> None:
    index = redises.index(groups=groups)
    prompt = chain(13, 600)
    ends = [600, 600, 1, 2, 3, 32, 32, 32, 33, 299, 300, 301, 511, 512, 513, 599, 0, 32]
    for n, end in enumerate(ends):
        await index.register(info(f"w{n}"), LEASE)
        # Stored in runs of 64, as an engine announces them.
        pieces = [run(prompt[: min(start + 64, end)], start) for start in range(0, end, 64)]
        await index.apply(f"w{n}", 1, pieces)

    matches = await index.lookup(prompt)

    assert {w: m.blocks for w, m in matches.items()} == {
        f"w{n}": end for n, end in enumerate(ends) if end
    }
    assert all(m.by_tier == {Tier.DEVICE: m.blocks} for m in matches.values())


# -- eviction ------------------------------------------------------------------------


async def test_each_worker_is_capped_at_its_share_of_max_entries(redises: Redises) -> None:
    index = redises.index(max_entries=100)
    await index.register(info("a"), LEASE)
    await index.register(info("b"), LEASE)
    for worker, start in (("a", 20), ("b", 30)):
        await index.apply(worker, 1, [run(chain(start + n, 40)) for n in range(2)])

    statuses = await index.workers()
    assert all(status.entries <= 50 for status in statuses)
    for worker, start in (("a", 20), ("b", 30)):
        for n in range(2):
            assert (await index.lookup(chain(start + n, 40)))[worker].blocks >= 10


async def test_eviction_keeps_heads_and_exact_lookups(redises: Redises) -> None:
    index = redises.index(max_entries=300)
    await index.register(info("a"), LEASE)
    prompts = [chain(40 + n, 100) for n in range(6)]
    for prompt in prompts:
        await index.apply("a", 1, [run(prompt)])

    content = await redises.worker_hash("a")
    check_bookkeeping(content, await redises.member("a"))
    assert int(content[b"meta.entries"]) <= 300
    for prompt in prompts:
        prefix = held_prefix(content, prompt)
        assert prefix >= 10  # the deep ends went, not the heads
        assert (await index.lookup(prompt))["a"].blocks == prefix


async def test_eviction_larger_than_one_call_budget_completes(redises: Redises) -> None:
    index = redises.index(max_entries=1000)
    await index.register(info("a"), LEASE)
    keys = chain(50, 12_000)

    await index.apply("a", 1, [run(keys)])

    (status,) = await index.workers()
    assert status.entries <= 1000
    prefix = held_prefix(await redises.worker_hash("a"), keys)
    assert prefix >= status.entries // 2  # mostly the deep end went
    assert (await index.lookup(keys))["a"].blocks == prefix


# -- stats ---------------------------------------------------------------------------


async def test_distinct_keys_are_estimated_above_the_exact_limit(redises: Redises) -> None:
    index = redises.index_over_client(exact_key_count_limit=0)
    shared = chain(60, 500)
    for n in range(8):
        await index.register(info(f"w{n}"), LEASE)
        await index.apply(f"w{n}", 1, [run(shared), run(chain(61 + n, 500))])

    stats = await index.stats()

    assert stats.entries == 8 * 1000
    assert 0.8 * 4500 <= stats.keys <= 1.2 * 4500
    assert stats.bytes > 8 * 1000 * 8


async def test_the_key_estimate_stays_cheap_in_a_large_fleet(redises: Redises) -> None:
    # Every sampled block is checked on every worker: with a sample per worker, 1,000
    # workers made a million checks per estimate, past the round-trip timeout (and
    # Redis runs the scripts to the end even when the caller gave up).
    index = redises.index_over_client(exact_key_count_limit=0)
    shared = chain(70, 8)
    for n in range(1000):
        await index.register(info(f"w{n}"), LEASE)
        await index.apply(f"w{n}", 1, [run(shared), run(chain(1000 + n, 8))])

    stats = await index.stats()

    assert stats.entries == 16_000
    # 262 sampled entries here (the check budget over 1,000 workers): a standard error
    # of about 6%, so 30% is five of them.
    assert 0.7 * 8008 <= stats.keys <= 1.3 * 8008


# -- round trips ---------------------------------------------------------------------


async def test_a_batch_and_a_lookup_are_one_script_call_each(redis_url: str) -> None:
    """The issue's budget: one round trip per event batch and one per lookup, however
    many events and workers: one script call, counted by the server itself (commands a
    script runs inside are counted too, so only the calls themselves are compared)."""
    prefix = f"kvproundtrip-{uuid.uuid4().hex[:8]}"
    index = RedisLocationIndex.from_url(redis_url, cluster=False, prefix=prefix)
    admin = aioredis.Redis.from_url(redis_url)

    async def script_calls() -> int:
        stats = await admin.info("commandstats")
        names = ("cmdstat_evalsha", "cmdstat_evalsha_ro", "cmdstat_eval", "cmdstat_script")
        return sum(int(stats[name]["calls"]) for name in names if name in stats)

    async def commands_during(action: Callable[[], Awaitable[object]]) -> int:
        before = await script_calls()
        await action()
        return await script_calls() - before

    try:
        prompt = chain(90, 64)
        for worker in ("a", "b", "c"):
            await index.register(info(worker), 30)
        await index.lookup(prompt)  # scripts are loaded on first use: not counted here
        batch = [
            run(prompt[:32]),
            run(prompt, start=32),
            BlocksRemoved(prompt[60:], Tier.DEVICE),
        ]

        assert await commands_during(lambda: index.apply("a", 1, batch)) == 1
        assert await commands_during(lambda: index.lookup(prompt)) == 1
        assert (await index.lookup(prompt))["a"].blocks == 60
    finally:
        await index.close()
        await delete_prefix(redis_url, False, prefix)
        await admin.aclose()


async def test_stats_say_how_full_the_fullest_server_is(own_redises: Redises) -> None:
    """used_memory over maxmemory of the fullest server (every primary of a cluster); None
    while no server has a limit. The limits are set for the test and put back after."""
    redises = own_redises
    admin = redises.admin
    nodes: list[Any] = [None]
    if isinstance(admin, RedisCluster):
        await admin.initialize()
        nodes = list(admin.get_primaries())

    async def on(node: Any, *command: str) -> Any:
        if node is None:
            return await admin.execute_command(*command)
        return await admin.execute_command(*command, target_nodes=node)

    async def memory(field: str) -> list[int]:
        return [int((await on(node, "INFO", "memory"))[field]) for node in nodes]

    async def set_limits(limits: list[int]) -> None:
        for node, limit in zip(nodes, limits, strict=True):
            await on(node, "CONFIG", "SET", "maxmemory", str(limit))

    index = redises.index()
    await index.register(info("w1"), LEASE)
    before = await memory("maxmemory")
    try:
        await set_limits([0] * len(nodes))
        assert (await index.stats()).server_memory_used is None
        used = max(await memory("used_memory"))
        # Well above what any server uses; the last server's limit the tightest.
        await set_limits([40 * used] * (len(nodes) - 1) + [4 * used])
        share = (await index.stats()).server_memory_used
        assert share is not None
        assert 0.8 * (await memory("used_memory"))[-1] / (4 * used) < share < 1.2 / 4
    finally:
        await set_limits(before)


async def test_stats_without_leave_to_run_info_lack_only_the_memory_figure(
    redis_url: str,
) -> None:
    """INFO is in Redis' @dangerous category, which a router's ACL user may well lack:
    the stats come without Redis' memory figure, not as an unavailable index."""
    user, password = f"kvptest-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = aioredis.Redis.from_url(redis_url)
    await admin.execute_command(
        "ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all", "-@dangerous"
    )
    host_and_port = redis_url.split("://", 1)[1].rsplit("/", 1)[0].rsplit("@", 1)[-1]
    prefix = f"kvptest-{uuid.uuid4().hex[:10]}"
    index = RedisLocationIndex.from_url(
        f"redis://{user}:{password}@{host_and_port}/0", cluster=False, prefix=prefix
    )
    try:
        await index.register(info("w1"), LEASE)
        stats = await index.stats()
        assert (stats.workers, stats.server_memory_used) == (1, None)
    finally:
        await index.close()
        await admin.execute_command("ACL", "DELUSER", user)
        await admin.aclose()
        await delete_prefix(redis_url, False, prefix)
