"""The location index in Redis or Redis Cluster: one view shared by every router replica.

Workers are placed in a fixed number of groups by their id. Each worker is one hash
(its record and its entries); each group has a roster (its members' leases) and, where
the layout says so, a directory (block -> the members holding it), all under the group's
hash tag, so every script that writes touches one hash slot; a small registry set lists
the worker ids. Each write is one EVALSHA (fencing, leases on the server's clock,
all-or-nothing batches); a lookup is one script call per node, reading each group's
roster and then its directory once for all its members, or without one each member's
hash. The layout, the scripts, the eviction policy and the round trips:
docs/redis-layout.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import random
import struct
import sys
import time
import zlib
from array import array
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Any, NamedTuple, NoReturn, assert_never
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterError,
    InvalidResponse,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvplane.core.clock import Clock
from kvplane.core.types import (
    MAX_CHAIN_END,
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    Tier,
    WorkerInfo,
    WorkerRole,
)
from router.index._lookup_reply import read_matches
from router.index.base import (
    MAX_POSITION,
    CounterChanges,
    FlowExchanged,
    IndexStats,
    IndexTimeout,
    IndexUnavailable,
    LocationIndexError,
    PrefixMatch,
    SequenceMismatch,
    StaleIncarnation,
    UnknownWorker,
    WorkerState,
    WorkerStatus,
    blocks_by_tier,
)

log = logging.getLogger(__name__)

DEFAULT_GROUPS = 16
"""Groups the workers are placed in. A lookup reads each group's roster (and directory)
once; more groups spread a cluster's load more evenly, fewer make lookups in a small
fleet cheaper. Every router of a fleet must use the same layout (the count and the
directory are part of the key names: routers that differ share no worker)."""
MAX_GROUPS = 256

DEFAULT_GRACE_S = 60.0
"""How long a worker's keys outlive its lease: a dead worker stays visible (and fenced)
until purged, and if no router purges it Redis expires its keys after this."""

REGISTRY_REFRESH_S = 0.2
"""Age after which a lookup or an apply re-reads the worker registry, inside its own
round trip (the fresh list serves the next call)."""

REGISTRY_MAX_AGE_S = 1.0
"""Age after which a lookup re-reads the registry before it runs (an extra round trip),
so no lookup scores from a list older than this."""

EXACT_KEY_COUNT_LIMIT = 10_000
"""stats() counts distinct keys exactly (every worker's fields read back) while the
workers hold this many blocks or fewer in all, and estimates from samples above. Every
/metrics scrape calls stats(): read back whole, 32,768 entries took a router about
0.2 s, in which its event loop acknowledged no batch (kvplane bench scale)."""

CONNECT_TIMEOUT_S = 1.0
ROUND_TRIP_TIMEOUT_S = 2.0
"""The most one round trip may take, connecting included; then IndexUnavailable."""
ROUND_TRIPS_IN_FLIGHT = 64  # per index (router), below redis-py's 100 connections a pool

_EVICT_HEADROOM = 0.9  # evict down to this share of the cap, so eviction is rare
_EVICT_SAMPLE = 256  # fields per HRANDFIELD round of eviction
_EVICT_BUDGET = 1024  # most entries one evict call removes: bounds how long it blocks
# Estimating the distinct keys: entries sampled (at most), and the most (sampled block,
# worker) checks one estimate makes, whatever the fleet. Every sampled block is checked
# on every worker, inside Redis scripts that cannot be interrupted: with a sample per
# worker, 1,000 workers made tens of millions of checks. With the budget, stats() over
# 1,000 workers and 508,000 entries took about 250 ms in all on the development machine
# (262 sampled entries; the estimate within 1% there).
_KEY_COUNT_SAMPLES = 512
_KEY_COUNT_CHECKS = 262_144
_MAX_INCARNATION = 2**64  # incarnations are uint64 on the wire
_STORE, _REMOVE, _CLEAR = 1, 2, 3  # operation codes of an encoded batch (apply.lua)
_FIRST_BLOCK, _PARENT_KEY, _PARENT_UNKNOWN = 0, 1, 2  # parent kinds of a stored run
_EVENT_HEADER = struct.Struct("<BBHIB")  # operation, tier, first depth, keys, parent kind
_KEYS_NEED_BYTESWAP = sys.byteorder == "big"  # keys are stored little-endian everywhere

Command = tuple[Any, ...]
Client = Redis | RedisCluster

# What redis-py raises (or a pipeline returns as a reply); _raise_mapped sorts it.
_CLIENT_ERRORS = (RedisError, RedisClusterException, OSError)
_TIMEOUTS = (TimeoutError, RedisTimeoutError)  # the round trip's deadline, or the socket's
# The store cannot serve now, and a later call may succeed: nothing was connected or
# answered (refused, reset, a failed or wrong password, loading its data, not speaking
# Redis), the cluster has no node for a slot or is moving one, a failover left a
# replica where a primary was, the server is out of memory or its scripts are gone
# again, or this user may not run our commands (set-up, like a wrong password).
_UNAVAILABLE = (
    OSError,
    RedisConnectionError,
    RedisClusterException,
    ClusterError,
    TryAgainError,
    AskError,
    ReadOnlyError,
    OutOfMemoryError,
    NoScriptError,
    NoPermissionError,
    InvalidResponse,
)
# Replies that redis-py has no class for, with the same meaning: a script runs too long
# (BUSY), writes are refused while persistence fails (MISCONF) or replicas are missing.
_UNAVAILABLE_REPLY_CODES = frozenset({"BUSY", "MISCONF", "NOREPLICAS"})


class _Script:
    """A script of redis_scripts/, sent once with SCRIPT LOAD and then called by SHA."""

    def __init__(self, name: str, *, flags: str = "", includes: Sequence[str] = ()) -> None:
        folder = resources.files("router.index") / "redis_scripts"
        # A shebang makes Redis check the flags before the script starts: a writing
        # script is refused whole on an out-of-memory server instead of failing midway.
        parts = [f"#!lua flags={flags}\n" if flags else "#!lua\n"]
        parts += [(folder / f"{part}.lua").read_text() for part in ("common", *includes, name)]
        self.source = "".join(parts)
        self.sha = hashlib.sha1(self.source.encode(), usedforsecurity=False).hexdigest()

    def call(self, keys: Sequence[bytes], *args: bytes | str | int) -> Command:
        return ("EVALSHA", self.sha, len(keys), *keys, *args)


_REGISTER = _Script("register")
_RENEW = _Script("renew")
_APPLY = _Script("apply", includes=["entries"])
_EVICT = _Script("evict", includes=["entries"])
_DROP = _Script("drop")
_PURGE = _Script("purge")
_ENLIST = _Script("enlist")
_LOOKUP = _Script("lookup", flags="no-writes,allow-cross-slot-keys")
_STATUS = _Script("status", flags="no-writes")
_HOLDERS = _Script("holders", flags="no-writes")
_FLOW = _Script("flow")
_SWEEP = _Script("sweep")
_SCRIPTS = (
    _REGISTER,
    _RENEW,
    _APPLY,
    _EVICT,
    _DROP,
    _PURGE,
    _ENLIST,
    _LOOKUP,
    _STATUS,
    _HOLDERS,
    _FLOW,
    _SWEEP,
)
_FLOW_COUNTERS_KEPT_MS = 24 * 3600 * 1000  # a model's counters, once no router charges them


_CLUSTER_SLOTS = 16384
_GROUP_KEYS = ("roster", "directory", "retiring")  # a group's keys, by suffix (common.lua)


@dataclasses.dataclass(frozen=True)
class KeyLayout:
    """The key names of one index (docs/redis-layout.md, "Keys"): where tools that read
    Redis directly (audits, tests) find a worker's hash and its group's roster."""

    prefix: str
    groups: int = DEFAULT_GROUPS
    directory: bool = False  # groups keep a directory (block -> members holding it)

    def group_of(self, worker_id: str) -> int:
        return zlib.crc32(worker_id.encode()) % self.groups

    def group_base(self, group: int) -> str:
        """`<prefix>:{<tag>}`: every key of the group is this and a suffix."""
        return f"{self.prefix}:{{{_group_tag(group, self.groups, self.directory)}}}"

    def group_keys(self, group: int) -> tuple[bytes, bytes, bytes]:
        """The group's roster, directory and retiring keys, as its scripts take them."""
        base = self.group_base(group)
        roster, directory, retiring = (f"{base}:{name}".encode() for name in _GROUP_KEYS)
        return roster, directory, retiring

    def worker(self, worker_id: str) -> bytes:
        """The worker's hash: its record and entries."""
        return f"{self.group_base(self.group_of(worker_id))}:w:{worker_id}".encode()

    def roster_of(self, worker_id: str) -> bytes:
        """The roster that holds the worker's member record, under its hash's name."""
        return self.group_keys(self.group_of(worker_id))[0]


@cache
def _group_tag(group: int, groups: int, directory: bool) -> str:
    """The group's hash tag: one whose slot lies in the group-th of `groups` equal
    ranges of a cluster's slots, so that groups spread over the masters as evenly as
    the slots do. The count and the directory ('d', which the scripts read) are in the
    tag, so different layouts share no key."""
    low, high = group * _CLUSTER_SLOTS // groups, (group + 1) * _CLUSTER_SLOTS // groups
    attempt = 0
    while True:
        tag = f"g{group}of{groups}{'d' if directory else ''}.{attempt}"
        if low <= key_slot(tag.encode()) < high:
            return tag
        attempt += 1


def member_incarnation(record: bytes) -> int:
    """The incarnation in a roster's member record (common.lua: '>HdB', then the
    incarnation as 20 digits)."""
    return int(record[_MEMBER_HEADER:])


_MEMBER_HEADER = struct.calcsize(">HdB")


class _WorkerKey(NamedTuple):
    name: bytes  # the worker's hash
    group: int
    slot: int  # the group's cluster hash slot
    script_keys: tuple[bytes, bytes, bytes, bytes]  # roster, directory, retiring, worker


class _NodeWorkers(NamedTuple):
    """The known workers whose groups one node holds, as a lookup sends and reads them."""

    node: ClusterNode | None  # None: no node in particular (a single server)
    groups: list[tuple[int, list[tuple[str, _WorkerKey]]]]  # by group, its workers
    worker_ids: list[list[str]]  # by group, in the order of the lookup's reply
    spec: bytes  # per group a line: its base and its workers' key names (lookup.lua)


class RedisLocationIndex:
    """LocationIndex in Redis (a Redis client) or Redis Cluster (a RedisCluster).

    Build it with from_url(); a client passed in directly should have no socket timeout
    (see from_url) and must not decode responses.
    """

    def __init__(
        self,
        client: Client,
        *,
        prefix: str,
        groups: int = DEFAULT_GROUPS,
        directory: bool = False,
        max_entries: int | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        exact_key_count_limit: int = EXACT_KEY_COUNT_LIMIT,
        location: str = "Redis",
        clock: Clock = time.monotonic,
    ) -> None:
        """`clock` ages this router's copy of the registry; leases run on the server's."""
        if max_entries is not None and max_entries < 1:
            raise ValueError("max_entries must be positive")
        # No braces (they would move the hash tag), no spaces or newlines (lookup.lua
        # splits its groups and names on them).
        if not prefix or any(character in prefix for character in "{} \n"):
            raise ValueError(f"invalid key prefix {prefix!r}")
        if not 1 <= groups <= MAX_GROUPS:
            raise ValueError(f"groups must be within 1..{MAX_GROUPS}")
        self._client = client
        self._prefix = prefix
        self._layout = KeyLayout(prefix, groups, directory)
        self._max_entries = max_entries
        self._grace_ms = round(grace_s * 1000)
        self._exact_key_count_limit = exact_key_count_limit
        self._location = location
        self._clock = clock
        self._registry = f"{prefix}:workers".encode()
        self._scopes = f"{prefix}:scopes".encode()  # scope -> generation
        # The registry as last read (plus workers registered here since), with each
        # worker's key; _registry_read_at is None until a read succeeds.
        self._workers: dict[str, _WorkerKey] = {}
        # _workers grouped by node, with the slot map they were grouped by; rebuilt when
        # _workers changes, redis-py reads a new map, or a node refuses a group (built
        # per lookup, they cost a thousand workers' router about a millisecond).
        self._node_workers: tuple[object, list[_NodeWorkers]] | None = None
        self._registry_read_at: float | None = None
        self._registry_reading = False  # so that concurrent calls send one SMEMBERS
        # redis-py refuses a call (MaxConnectionsError, no wait) once a pool has 100
        # connections to a server in use: a fleet's registrations and batches at once
        # would fail. Round trips past this many wait for one to end, within their
        # deadline; each holds at most one connection per server.
        self._round_trips = asyncio.Semaphore(ROUND_TRIPS_IN_FLIGHT)
        self._loading_scripts = asyncio.Lock()
        self._script_loads = 0  # completed: a call that waited for one need not repeat it

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        cluster: bool = False,
        prefix: str = "kvp",
        groups: int = DEFAULT_GROUPS,
        directory: bool = False,
        max_entries: int | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        clock: Clock = time.monotonic,
    ) -> RedisLocationIndex:
        """Connects lazily: nothing is sent until the first call."""
        options: dict[str, Any] = {
            "socket_connect_timeout": CONNECT_TIMEOUT_S,
            # No socket timeout: with one, redis-py sends through asyncio.wait_for, which
            # on Python 3.11 can swallow a cancellation of the calling task (the router
            # could then not stop its tasks). Each round trip has a deadline of its own.
            "socket_timeout": None,
            # Fail fast rather than retry for seconds: callers degrade to load-only
            # routing on IndexUnavailable, which beats waiting.
            "retry": Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=2),
        }
        client: Client
        if cluster:
            client = RedisCluster.from_url(url, **options)
        else:
            client = Redis.from_url(url, **options)
        return cls(
            client,
            prefix=prefix,
            groups=groups,
            directory=directory,
            max_entries=max_entries,
            grace_s=grace_s,
            location=_redacted(url),
            clock=clock,
        )

    # -- workers ---------------------------------------------------------------------

    async def register(self, info: WorkerInfo, lease_s: float) -> int:
        key = self._worker_key(info.worker_id)
        reply, _ = await self._run(
            [
                _REGISTER.call(
                    key.script_keys,
                    _incarnation(info.incarnation),
                    round(lease_s * 1_000_000),
                    self._grace_ms,
                    _info_to_json(info),
                ),
                self._enlist(info.worker_id, lease_s),
            ]
        )
        applied = int(_check(reply, info.worker_id, info.incarnation)[1])
        if info.worker_id not in self._workers:
            self._workers[info.worker_id] = key
            self._node_workers = None
        return applied

    async def renew(
        self,
        worker_id: str,
        incarnation: int,
        lease_s: float,
        *,
        draining: bool = False,
        applied: int | None = None,
    ) -> None:
        # Enlisting again on every heartbeat heals the registry should a concurrent
        # drop or purge have taken the id out while this incarnation registered.
        reply, _ = await self._run(
            [
                _RENEW.call(
                    self._worker_key(worker_id).script_keys,
                    _incarnation(incarnation),
                    round(lease_s * 1_000_000),
                    self._grace_ms,
                    "1" if draining else "0",
                    "" if applied is None else applied,
                ),
                self._enlist(worker_id, lease_s),
            ]
        )
        _check(reply, worker_id, incarnation, applied)

    async def drop_worker(self, worker_id: str, incarnation: int | None = None) -> None:
        expected = "" if incarnation is None else _incarnation(incarnation)
        key = self._worker_key(worker_id)
        (dropped,) = await self._run([_DROP.call(key.script_keys, expected)])
        if dropped:
            # A second round trip: the id must stay listed when the drop did not happen.
            await self._run([("SREM", self._registry, worker_id)])
            self._workers.pop(worker_id, None)
            self._node_workers = None

    async def purge_expired(self, grace_s: float = 0.0) -> list[str]:
        workers = await self._read_registry()
        grace_us = round(grace_s * 1_000_000)
        purges = [_PURGE.call(key.script_keys, grace_us) for _, key in workers]
        # Each group's directory is swept of the members that left it, a bounded
        # amount a call (the drops and purges that retire them sweep too).
        groups = self._groups_in_use() if self._layout.directory else []
        sweeps = [_SWEEP.call(self._layout.group_keys(group)) for group in groups]
        outcomes = (await self._run([*purges, *sweeps]))[: len(purges)]
        purged = [w for (w, _), outcome in zip(workers, outcomes, strict=True) if outcome == 1]
        # -1: an id without a record (its keys expired, or a drop raced a registration).
        unlisted = [w for (w, _), outcome in zip(workers, outcomes, strict=True) if outcome != 0]
        if unlisted:
            await self._run([("SREM", self._registry, *unlisted)])
            for worker_id in unlisted:
                self._workers.pop(worker_id, None)
            self._node_workers = None
        return purged

    async def workers(self) -> list[WorkerStatus]:
        workers = await self._read_registry()
        records = await self._run([_STATUS.call(key.script_keys) for _, key in workers])
        return [
            _status(worker_id, record)
            for (worker_id, _), record in zip(workers, records, strict=True)
            if record is not None
        ]

    def _enlist(self, worker_id: str, lease_s: float) -> Command:
        ttl_ms = max(0, round(lease_s * 1000)) + self._grace_ms
        return _ENLIST.call((self._registry,), worker_id, ttl_ms)

    def _worker_key(self, worker_id: str) -> _WorkerKey:
        """The hash of the worker's record and entries, and its group's keys."""
        key = self._workers.get(worker_id)
        if key is not None:
            return key
        if not _usable_worker_id(worker_id):
            raise ValueError(f"invalid worker id {worker_id!r}")
        group = self._layout.group_of(worker_id)
        roster, directory, retiring = self._layout.group_keys(group)
        name = self._layout.worker(worker_id)
        return _WorkerKey(name, group, key_slot(roster), (roster, directory, retiring, name))

    def _groups_in_use(self) -> list[int]:
        return sorted({key.group for key in self._workers.values()})

    # -- events ----------------------------------------------------------------------

    async def apply(
        self,
        worker_id: str,
        incarnation: int,
        events: Sequence[KvEvent],
        *,
        sequence: int | None = None,
    ) -> None:
        key = self._worker_key(worker_id)
        command = _APPLY.call(
            key.script_keys,
            _incarnation(incarnation),
            self._grace_ms,
            _encode_batch(events),
            "" if sequence is None else sequence,
        )
        # The cap on a worker's entries depends on how many workers there are; keep that
        # count fresh without a round trip of its own.
        refresh = self._max_entries is not None and self._registry_read_due()
        (reply,) = await self._replies_reading_registry([command], (), refresh)
        expected = None if sequence is None else sequence - 1
        entries = int(_check(self._raise_failure(reply), worker_id, incarnation, expected)[1])
        if self._max_entries is not None and entries > self._share(self._max_entries):
            await self._make_room(key, self._max_entries)

    def _share(self, max_entries: int) -> int:
        """Each registered worker's share of max_entries."""
        return max(1, max_entries // max(1, len(self._workers)))

    async def _make_room(self, key: _WorkerKey, max_entries: int) -> None:
        """Bring a worker under its share of max_entries: dead workers go first (a
        purge, which also raises every share), then the worker's deepest blocks."""
        await self.purge_expired()
        cap = self._share(max_entries)
        target = int(cap * _EVICT_HEADROOM)
        limit = cap
        while True:
            ((evicted, left),) = await self._run(
                [_EVICT.call(key.script_keys, limit, target, _EVICT_SAMPLE, _EVICT_BUDGET)]
            )
            if evicted == 0 or left <= target:
                return
            limit = target  # started: carry on down to the target

    # -- lookups ---------------------------------------------------------------------

    lookup_never_waits = False  # every lookup is a round trip to Redis

    async def lookup(self, keys: Sequence[int]) -> dict[str, PrefixMatch]:
        if not keys:
            return {}
        packed_keys = _pack_keys(keys)
        if self._registry_older_than(REGISTRY_MAX_AGE_S):
            await self._read_registry()
        by_node = await self._workers_by_node()
        commands = [_LOOKUP.call((), packed_keys, node.spec) for node in by_node]
        nodes = [node.node for node in by_node]
        replies = await self._replies_reading_registry(commands, nodes, self._registry_read_due())
        matches: dict[str, PrefixMatch] = {}
        misrouted: list[tuple[int, list[tuple[str, _WorkerKey]]]] = []
        for node, reply in zip(by_node, replies, strict=True):
            if isinstance(reply, ResponseError) and isinstance(self._client, RedisCluster):
                # Slots moved since the client last looked: ask per group, which the
                # client routes (and follows redirections) by the declared roster, and
                # group by node again next time, by the slot map those redirections
                # mended.
                misrouted += node.groups
                self._node_workers = None
                continue
            _collect_matches(matches, node.worker_ids, self._raise_failure(reply))
        if misrouted:
            replies = await self._run(
                [
                    _LOOKUP.call(
                        self._layout.group_keys(group)[:1],
                        packed_keys,
                        self._group_spec(group, members),
                    )
                    for group, members in misrouted
                ]
            )
            for (_, members), reply in zip(misrouted, replies, strict=True):
                _collect_matches(matches, [[worker_id for worker_id, _ in members]], reply)
        return matches

    async def _workers_by_node(self) -> list[_NodeWorkers]:
        """The known workers by group, the groups by the node that holds their keys
        (one, for no node in particular, on a single server)."""
        slots: dict[int, list[ClusterNode]] | None = None
        if isinstance(self._client, RedisCluster):
            with self._mapped_errors():
                async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
                    await self._client.initialize()  # a no-op once the slot map is known
            # redis-py builds a new map when it reads the cluster's (a failover found,
            # a migration), and mends the one it has when a call is redirected: a
            # misrouted group (below) forgets the grouping too.
            slots = self._client.nodes_manager.slots_cache
        if self._node_workers is not None and self._node_workers[0] is slots:
            return self._node_workers[1]
        by_group: dict[int, list[tuple[str, _WorkerKey]]] = {}
        for worker in sorted(self._workers.items()):
            by_group.setdefault(worker[1].group, []).append(worker)
        by_node: dict[str | None, tuple[ClusterNode | None, list[int]]] = {}
        for group, members in sorted(by_group.items()):
            owner = None
            if slots is not None:
                slot = members[0][1].slot
                owners = slots.get(slot)
                if not owners:
                    raise IndexUnavailable(f"{self._location}: no node serves hash slot {slot}")
                owner = owners[0]
            by_node.setdefault(owner.name if owner else None, (owner, []))[1].append(group)
        nodes = [
            _NodeWorkers(
                node,
                [(group, by_group[group]) for group in groups],
                [[worker_id for worker_id, _ in by_group[group]] for group in groups],
                b"\n".join(self._group_spec(group, by_group[group]) for group in groups),
            )
            for node, groups in by_node.values()
        ]
        self._node_workers = (slots, nodes)
        return nodes

    def _group_spec(self, group: int, members: list[tuple[str, _WorkerKey]]) -> bytes:
        """One group as lookup.lua reads it: its base and its workers' key names."""
        base = self._layout.group_base(group).encode()
        return b" ".join([base, *(key.name for _, key in members)])

    # -- the registry ----------------------------------------------------------------

    def _registry_older_than(self, age_s: float) -> bool:
        read_at = self._registry_read_at
        return read_at is None or self._clock() - read_at > age_s

    def _registry_read_due(self) -> bool:
        return not self._registry_reading and self._registry_older_than(REGISTRY_REFRESH_S)

    async def _read_registry(self) -> list[tuple[str, _WorkerKey]]:
        """The registry, read now: (worker id, key) by worker id."""
        await self._replies_reading_registry([], (), read_registry=True)
        return sorted(self._workers.items())

    async def _replies_reading_registry(
        self,
        commands: Sequence[Command],
        nodes: Sequence[ClusterNode | None],
        read_registry: bool,
    ) -> list[Any]:
        """_replies() for the commands; with read_registry, the registry is read in the
        same round trip and remembered."""
        if not read_registry:
            return await self._replies(commands, nodes)
        self._registry_reading = True
        started = self._clock()
        try:
            replies = await self._replies(
                [*commands, ("SMEMBERS", self._registry)], [*nodes, None] if nodes else ()
            )
        finally:
            self._registry_reading = False
        listed = {member.decode(errors="replace") for member in self._raise_failure(replies.pop())}
        worker_ids = {worker_id for worker_id in listed if _usable_worker_id(worker_id)}
        if worker_ids != self._workers.keys():
            if len(worker_ids) < len(listed):
                # Not one a router wrote (ids are validated upstream): left out, so that
                # the others are still looked up.
                log.warning(
                    "the worker registry in %s lists %d ids this index cannot use: left out",
                    self._location,
                    len(listed) - len(worker_ids),
                )
            self._workers = {worker_id: self._worker_key(worker_id) for worker_id in worker_ids}
            self._node_workers = None
        self._registry_read_at = started
        return replies

    # -- introspection ---------------------------------------------------------------

    async def stats(self) -> IndexStats:
        workers = await self._read_registry()
        # Without directories a group has its roster only.
        kept = 3 if self._layout.directory else 1
        group_keys = [
            name
            for group in self._groups_in_use()
            for name in self._layout.group_keys(group)[:kept]
        ]
        commands: list[Command] = [("MEMORY USAGE", name) for name in (self._registry, *group_keys)]
        for _, key in workers:
            commands += [_STATUS.call(key.script_keys), ("MEMORY USAGE", key.name)]
        replies = await self._run(commands)
        head = 1 + len(group_keys)
        used_bytes = sum(reply or 0 for reply in replies[:head])
        entries = 0
        holding: list[tuple[bytes, int]] = []  # (worker's key, blocks it holds)
        recorded = 0
        for (_, key), record, worker_bytes in zip(
            workers, replies[head::2], replies[head + 1 :: 2], strict=True
        ):
            used_bytes += worker_bytes or 0
            if record is not None:
                recorded += 1
                entries += int(record[3])
                if int(record[6]):
                    holding.append((key.name, int(record[6])))
        if sum(count for _, count in holding) <= self._exact_key_count_limit:
            distinct = await self._count_distinct_keys([name for name, _ in holding])
        else:
            distinct = await self._estimate_distinct_keys(holding)
        return IndexStats(
            keys=distinct,
            entries=entries,
            workers=recorded,
            bytes=used_bytes,
            server_memory_used=await self._server_memory_used(),
        )

    async def _server_memory_used(self) -> float | None:
        """The fullest server's used_memory over its maxmemory (INFO memory on every
        primary). Optional where the rest of the stats are not: None when a server
        refuses INFO (an ACL without @dangerous) or does not answer."""
        servers: list[ClusterNode | None] = [None]
        try:
            if isinstance(self._client, RedisCluster):
                with self._mapped_errors():
                    async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
                        await self._client.initialize()  # a no-op once the slot map is known
                servers = list(self._client.get_primaries())
            replies = await self._replies([("INFO", "memory")] * len(servers), servers)
        except LocationIndexError as error:
            log.debug("no memory figure from Redis (%s)", type(error).__name__)
            return None
        answered = [reply for reply in replies if isinstance(reply, Mapping)]
        return _fullest(answered) if len(answered) == len(servers) else None

    async def _count_distinct_keys(self, worker_keys: list[bytes]) -> int:
        contents = await self._run([("HGETALL", name) for name in worker_keys])
        return len(
            {
                field
                for content in contents
                for field, value in content.items()
                if _is_block(field) and value[0]  # a mask of 0: a placeholder
            }
        )

    async def _estimate_distinct_keys(self, workers: list[tuple[bytes, int]]) -> int:
        """Entries x the mean of 1 / (workers holding its block) over entries sampled
        uniformly (a worker drawn by its entry count, then one of its fields): summed
        over all entries, 1 / holders counts each block once."""
        samples = max(1, min(_KEY_COUNT_SAMPLES, _KEY_COUNT_CHECKS // len(workers)))
        drawn_from = Counter(
            random.choices(range(len(workers)), weights=[count for _, count in workers], k=samples)
        )
        sources = list(drawn_from)
        drawn = await self._run([("HRANDFIELD", workers[i][0], drawn_from[i]) for i in sources])
        sample = [
            (source, field)
            for source, fields in zip(sources, drawn, strict=True)
            for field in fields
            if _is_block(field)
        ]
        sampled = list(dict.fromkeys(field for _, field in sample))
        if not sampled:
            return 0
        # One byte per sampled block per worker: 1 where the worker holds that block.
        held = await self._run([_HOLDERS.call((name,), b"".join(sampled)) for name, _ in workers])
        position = {key: i for i, key in enumerate(sampled)}
        holders = [sum(column) for column in zip(*held, strict=True)]
        # A sampled field may be a placeholder (see entries.lua), not an entry: skipped.
        shares = [
            1 / holders[position[field]]
            for source, field in sample
            if held[source][position[field]]
        ]
        total = sum(count for _, count in workers)
        return round(total * sum(shares) / len(shares)) if shares else 0

    async def scope_generations(self) -> dict[str, int]:
        (generations,) = await self._run([("HGETALL", self._scopes)])
        return {scope.decode(): int(value) for scope, value in generations.items()}

    async def bump_scope_generation(self, scope: str) -> int:
        (generation,) = await self._run([("HINCRBY", self._scopes, scope, 1)])
        return int(generation)

    async def exchange_flow(
        self,
        router_id: str,
        state: bytes,
        ttl_s: float,
        changes: Mapping[str, CounterChanges],
    ) -> FlowExchanged:
        # Every key in one slot (one node of a cluster), so that one script does it all.
        tag = f"{self._prefix}:{{{self._prefix}:flow}}"
        models = list(changes)
        keys = [f"{tag}:states".encode(), f"{tag}:expiries".encode()]
        keys += [f"{tag}:counters:{model}".encode() for model in models]
        args: list[bytes | str | int] = [
            router_id,
            state,
            max(1, round(ttl_s * 1000)),
            _FLOW_COUNTERS_KEPT_MS,
        ]
        for model in models:
            steps = changes[model]
            args.append(len(steps))
            for step in steps:
                low, high = step.low, step.high
                bounds = ("", "") if low is None or high is None else (repr(low), repr(high))
                args += [step.tenant, repr(float(step.add)), *bounds]
        (reply,) = await self._run([_FLOW.call(keys, *args)])
        states = reply[0]
        return FlowExchanged(
            states={states[i].decode(): bytes(states[i + 1]) for i in range(0, len(states), 2)},
            counters={
                model: {pairs[i].decode(): float(pairs[i + 1]) for i in range(0, len(pairs), 2)}
                for model, pairs in zip(models, reply[1:], strict=True)
            },
        )

    async def close(self) -> None:
        await self._client.aclose()

    # -- talking to Redis ------------------------------------------------------------

    async def _run(
        self, commands: Sequence[Command], nodes: Sequence[ClusterNode | None] = ()
    ) -> list[Any]:
        """Send the commands as one pipeline: one round trip (in a cluster, one per node,
        in parallel). Raises IndexUnavailable for anything Redis could not do."""
        return [self._raise_failure(reply) for reply in await self._replies(commands, nodes)]

    async def _replies(
        self, commands: Sequence[Command], nodes: Sequence[ClusterNode | None] = ()
    ) -> list[Any]:
        """Like _run, but a command that failed has its error as its reply. `nodes`,
        in a cluster, names the node to run each command on (None: route by key)."""
        if not commands:
            return []
        replies = await self._send(commands, nodes)
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            # The server restarted, failed over or flushed its scripts: load them all
            # (on every primary of a cluster) and run those calls again.
            await self._load_scripts()
            again = await self._send(
                [commands[i] for i in lost], [nodes[i] for i in lost] if nodes else ()
            )
            for i, reply in zip(lost, again, strict=True):
                replies[i] = reply
        return replies

    async def _send(
        self, commands: Sequence[Command], nodes: Sequence[ClusterNode | None]
    ) -> list[Any]:
        with self._mapped_errors():
            async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S), self._round_trips:
                if len(commands) == 1:
                    # Alone, a command skips the pipeline's bookkeeping (~0.1 ms a call).
                    return [await self._send_one(commands[0], nodes[0] if nodes else None)]
                pipeline = self._client.pipeline(transaction=False)
                for i, command in enumerate(commands):
                    node = nodes[i] if nodes else None
                    if node is None:
                        pipeline.execute_command(*command)
                    else:
                        pipeline.execute_command(*command, target_nodes=node)
                return list(await pipeline.execute(raise_on_error=False))

    async def _send_one(self, command: Command, node: ClusterNode | None) -> Any:
        """The reply, or the error Redis answered with (as a pipeline reports it)."""
        try:
            if node is None:
                return await self._client.execute_command(*command)
            return await self._client.execute_command(*command, target_nodes=node)
        except ResponseError as error:
            return error

    async def _load_scripts(self) -> None:
        """Load every script (on every primary). Once for all the calls that found
        them gone at the same time: a fleet's worth of loads at once would take more
        connections than a pool has."""
        loaded = self._script_loads
        async with self._loading_scripts:
            if self._script_loads != loaded:
                return  # loaded while this call waited
            with self._mapped_errors():
                async with asyncio.timeout(ROUND_TRIP_TIMEOUT_S):
                    for script in _SCRIPTS:
                        await self._client.script_load(script.source)
            self._script_loads += 1

    @contextlib.contextmanager
    def _mapped_errors(self) -> Iterator[None]:
        """Around every call into redis-py: its errors leave as the index's own."""
        try:
            yield
        except _CLIENT_ERRORS as error:
            self._raise_mapped(error)

    def _raise_failure(self, reply: Any) -> Any:
        """A pipeline's reply, unless it is an error: that is raised, mapped."""
        if isinstance(reply, Exception):
            self._raise_mapped(reply)
        return reply

    def _raise_mapped(self, error: Exception) -> NoReturn:
        """The one place redis-py's errors become the index's: IndexTimeout or
        IndexUnavailable when Redis could not serve the call. Any other error is raised
        as it is: a bug (a script failing, a wrong argument or key type) must not pass
        for an outage, which callers ride out by routing on load alone."""
        if isinstance(error, _TIMEOUTS):
            kind: type[IndexUnavailable] = IndexTimeout
        elif isinstance(error, _UNAVAILABLE) or (
            isinstance(error, ResponseError)
            and str(error).split(" ", 1)[0] in _UNAVAILABLE_REPLY_CODES
        ):
            kind = IndexUnavailable
        else:
            raise error
        raise kind(
            f"the location index in {self._location} is unavailable: "
            f"{type(error).__name__}: {error}"
        ) from error


# -- encoding ------------------------------------------------------------------------


def _incarnation(incarnation: int) -> str:
    """Fixed width, so that the scripts compare incarnations beyond 2^53 exactly."""
    if not 0 <= incarnation < _MAX_INCARNATION:
        raise ValueError(f"incarnation {incarnation} is not an unsigned 64-bit integer")
    return f"{incarnation:020d}"


def _pack_keys(keys: Sequence[int]) -> bytes:
    try:
        packed = array("Q", keys)  # refuses anything but ints in range
    except (OverflowError, TypeError):
        raise ValueError("block keys must be unsigned 64-bit integers") from None
    if _KEYS_NEED_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


def _encode_batch(events: Sequence[KvEvent]) -> bytes:
    """The batch as apply.lua reads it; raises, before anything is sent, if it is bad."""
    parts: list[bytes] = []
    for event in events:
        if isinstance(event, BlocksStored):
            first = event.first_position
            if not 0 <= first <= MAX_CHAIN_END - len(event.keys):
                raise ValueError(f"first_position {first} is outside 0..{MAX_CHAIN_END}")
            depth = min(event.first_position, MAX_POSITION)
            if event.first_position == 0:
                parent_kind, parent = _FIRST_BLOCK, b""
            elif event.parent_key is None:
                parent_kind, parent = _PARENT_UNKNOWN, b""
            else:
                parent_kind, parent = _PARENT_KEY, _pack_keys([event.parent_key])
            header = _EVENT_HEADER.pack(
                _STORE, Tier(event.tier), depth, len(event.keys), parent_kind
            )
            parts += (header, parent, _pack_keys(event.keys))
        elif isinstance(event, BlocksRemoved):
            header = _EVENT_HEADER.pack(_REMOVE, Tier(event.tier), 0, len(event.keys), 0)
            parts += (header, _pack_keys(event.keys))
        elif isinstance(event, AllBlocksCleared):
            parts.append(_EVENT_HEADER.pack(_CLEAR, 0, 0, 0, 0))
        else:
            assert_never(event)
    return b"".join(parts)


def _info_to_json(info: WorkerInfo) -> str:
    # worker_id and incarnation have a key and a field of their own.
    fields = {
        field.name: getattr(info, field.name)
        for field in dataclasses.fields(info)
        if field.name not in ("worker_id", "incarnation")
    }
    fields["labels"] = dict(info.labels)
    return json.dumps(fields, separators=(",", ":"))


_STORED_INFO_FIELDS = frozenset(
    field.name
    for field in dataclasses.fields(WorkerInfo)
    if field.name not in ("worker_id", "incarnation")
)


def _info_fields(stored: bytes) -> dict[str, Any]:
    """A registration as stored, less any field this router does not know (written by a
    newer router sharing the index, during a rolling upgrade)."""
    fields: dict[str, Any] = json.loads(stored)
    known = {name: value for name, value in fields.items() if name in _STORED_INFO_FIELDS}
    if "role" in known:  # stored as its value; one this router does not know reads as BOTH
        known["role"] = next((r for r in WorkerRole if r.value == known["role"]), WorkerRole.BOTH)
    return known


def _status(worker_id: str, record: list[Any]) -> WorkerStatus:
    incarnation, deadline_us, draining, entries, info, now_us, _ = record
    remaining_s = (int(deadline_us) - int(now_us)) / 1_000_000
    if remaining_s <= 0:
        state = WorkerState.DEAD
    else:
        state = WorkerState.DRAINING if draining == b"1" else WorkerState.LIVE
    return WorkerStatus(
        info=WorkerInfo(worker_id=worker_id, incarnation=int(incarnation), **_info_fields(info)),
        state=state,
        lease_remaining_s=max(0.0, remaining_s),
        entries=int(entries),
    )


def _collect_matches(
    matches: dict[str, PrefixMatch], worker_ids: list[list[str]], reply: bytes
) -> None:
    """Add the matches of one lookup.lua reply (a section per group, in order)."""
    read_matches(reply, worker_ids, matches, PrefixMatch, blocks_by_tier)


def _check(
    reply: list[Any], worker_id: str, incarnation: int, expected: int | None = None
) -> list[Any]:
    """The reply of a fenced script, or the error it stands for (`expected`: the
    sequence the script checked the recorded one against)."""
    outcome = reply[0]
    if outcome == b"stale":
        raise StaleIncarnation(worker_id, incarnation, int(reply[1]))
    if outcome == b"unknown":
        raise UnknownWorker(worker_id)
    if outcome == b"sequence":
        assert expected is not None  # the scripts check only a sequence they were given
        raise SequenceMismatch(worker_id, expected, int(reply[1]))
    if outcome == b"full":  # 65,536 members in one group: more groups are needed
        raise IndexUnavailable(f"the group of worker {worker_id} has no member index left")
    return reply


def _usable_worker_id(worker_id: str) -> bool:
    """Ids are validated upstream (kvplane/wire/codec.py); here only what would break
    the layout is refused: a brace moves the hash tag, lookup.lua splits its groups on
    newlines and names on spaces."""
    return bool(worker_id) and not any(character in worker_id for character in "{} \n")


def _is_block(field: bytes) -> bool:
    """Block keys are the 8-byte fields of a worker's hash; its record's fields are not."""
    return len(field) == 8


def _redacted(url: str) -> str:
    """The URL without credentials, for error messages."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or 'localhost'}:{parts.port or 6379}{parts.path}"


def _fullest(memory_infos: Sequence[Mapping[str, Any]]) -> float | None:
    """The highest used_memory / maxmemory among servers with a limit (INFO memory)."""
    shares = [
        int(info["used_memory"]) / int(info["maxmemory"])
        for info in memory_infos
        if int(info.get("maxmemory", 0)) > 0
    ]
    return round(max(shares), 4) if shares else None
