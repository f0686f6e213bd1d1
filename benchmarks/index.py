"""`kvplane bench index`: block keys and the location index in figures, and with
`--against dynamo`, side by side with NVIDIA Dynamo's RadixTree on the same events and
lookups, in this one process.

The fleet (one per worker count): eight shared system prompts of 4,096 tokens; requests
of 8k-32k tokens, each opening with one of them, placed on one worker (every tenth on
two) until the fleet holds about `entries` (block, worker) entries; then a fifth of the
entries evicted, as engines evict: the deepest blocks of some requests, deepest first.
Blocks of 16 tokens; stores in events of 64 blocks and batches of 8 events, as an engine
step announces them. Token ids are random, so the keys are real chained block keys.

Lookups: prompts of 1k-32k tokens, a third a cached request cut anywhere, a third a
cached request's prefix followed by new tokens, a third a system prompt followed by
new tokens. Each is timed with its hashing (from token ids to the lookup's answer) and
for the index alone.

What each side is given. kvplane: its KvEvent objects (what the agent's stream decodes
to) through MemoryLocationIndex.apply, and a prompt's token ids as the router holds them
(an array of uint32). Dynamo: the JSON bytes its `apply_event` takes (encoded before the
clock starts), and `compute_block_hash_for_seq` over a list of ints, the only input its
bindings accept. Dynamo keys a tree node by the block's own token hash under its parent,
kvplane by a chained key: each side stores its own, and every lookup's answers must agree
worker for worker or the benchmark fails.

Memory is the growth of the process's resident set while an index fills, divided by
the entries it then holds (keys and events are built before); Redis' is its
used_memory. Apply rates are medians over `repeats` fresh fills, kvplane's and Dynamo's
interleaved: Dynamo's rate swings widely from one fill to the next.
"""

from __future__ import annotations

import array
import asyncio
import gc
import json
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvplane.core.keys import BlockKey, KeyNamespace, block_keys, chain_keys, root_key
from kvplane.core.types import BlocksRemoved, BlocksStored, KvEvent, Tier, WorkerInfo
from router.index.base import IndexStats, LocationIndex
from router.index.memory import MemoryLocationIndex
from simulations.reporting import percentile

BLOCK_SIZE = 16
SYSTEM_PROMPTS = 8
SYSTEM_TOKENS = 4096
REQUEST_TOKENS = (8192, 32768)
LOOKUP_TOKENS = (1024, 32768)
EVICTED_SHARE = 0.2
EVENT_BLOCKS = 64
BATCH_EVENTS = 8
SMALL_BATCHES = 5000
LEASE_S = 3600.0
VOCABULARY = 128_256
NAMESPACE = KeyNamespace(model="bench", block_size=BLOCK_SIZE)
DYNAMO_VENV = Path(__file__).resolve().parents[1] / ".dynamo-venv"
DYNAMO_HINT = "run `make dynamo-env` (it builds .dynamo-venv with ai-dynamo-runtime)"


class DynamoUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Placement:
    """One request held by one worker: its keys and, for Dynamo, its token hashes."""

    worker: int
    keys: list[BlockKey]
    token_hashes: list[int]


@dataclass
class Fleet:
    workers: int
    placements: list[Placement]
    evictions: list[tuple[int, list[BlockKey]]]  # (worker, keys deepest first)
    lookups: list[array.array[int]]
    entries: int = 0  # after the evictions
    stored_blocks: int = 0
    removed_blocks: int = 0


@dataclass
class IndexFigures:
    index: str
    workers: int
    entries: int
    apply_entries_per_s: float  # median over the fills
    apply_runs: list[float]
    lookup_p50_us: float  # hashing included
    lookup_p99_us: float
    index_lookup_p50_us: float  # the index alone
    index_lookup_p99_us: float
    bytes_per_entry: float = 0.0  # resident growth (Redis: its used_memory)
    apply_small_batches_per_s: float | None = None
    table_bytes_per_entry: float | None = None  # the index's own accounting, where it has one


@dataclass
class FleetReport:
    workers: int
    entries: int
    lookups: int
    agreed_lookups: int | None
    indexes: list[IndexFigures] = field(default_factory=list)


# -- the fleet ------------------------------------------------------------------------


def _tokens(generator: np.random.Generator, count: int) -> array.array[int]:
    ids = generator.integers(0, VOCABULARY, count, dtype=np.uint32)
    return array.array("I", ids.tobytes())


def build_fleet(
    *, workers: int, entries: int, lookups: int, seed: int, token_hashes: bool
) -> Fleet:
    rng = random.Random(seed)
    generator = np.random.default_rng(seed)
    systems = [_tokens(generator, SYSTEM_TOKENS) for _ in range(SYSTEM_PROMPTS)]
    hasher = _dynamo_hasher() if token_hashes else None
    held: list[set[int]] = [set() for _ in range(workers)]  # system prompts per worker
    requests: list[array.array[int]] = []
    placements: list[Placement] = []
    total = 0
    while total < entries / (1 - EVICTED_SHARE):
        system = rng.randrange(SYSTEM_PROMPTS)
        length = rng.randrange(*REQUEST_TOKENS)
        tokens = systems[system] + _tokens(generator, length - SYSTEM_TOKENS)
        requests.append(tokens)
        keys = block_keys(tokens, NAMESPACE)
        hashes = hasher(tokens.tolist()) if hasher else []
        copies = 2 if len(requests) % 10 == 0 else 1
        for worker in rng.sample(range(workers), copies):
            new_system = system not in held[worker]
            held[worker].add(system)
            total += len(keys) - (0 if new_system else SYSTEM_TOKENS // BLOCK_SIZE)
            placements.append(Placement(worker, keys, hashes))
    evictions: list[tuple[int, list[BlockKey]]] = []
    removed = 0
    system_blocks = SYSTEM_TOKENS // BLOCK_SIZE
    for placement in rng.sample(placements, len(placements)):
        if removed >= total * EVICTED_SHARE:
            break
        own = len(placement.keys) - system_blocks
        count = min(own, rng.randrange(1, own + 1), int(total * EVICTED_SHARE) - removed + 1)
        evictions.append((placement.worker, placement.keys[::-1][:count]))
        removed += count
    prompts = _lookups(rng, generator, requests, systems, lookups)
    fleet = Fleet(workers, placements, evictions, prompts)
    fleet.stored_blocks = sum(len(p.keys) for p in placements)
    fleet.removed_blocks = removed
    fleet.entries = total - removed
    return fleet


def _lookups(
    rng: random.Random,
    generator: np.random.Generator,
    requests: list[array.array[int]],
    systems: list[array.array[int]],
    count: int,
) -> list[array.array[int]]:
    prompts = []
    for n in range(count):
        length = rng.randrange(*LOOKUP_TOKENS)
        if n % 3 == 0:  # a cached request, cut anywhere
            tokens = rng.choice(requests)[:length]
        elif n % 3 == 1:  # a cached request's prefix, then new tokens
            cached = rng.choice(requests)
            cut = rng.randrange(SYSTEM_TOKENS, len(cached))
            tokens = cached[: min(cut, length)] + _tokens(generator, max(0, length - cut))
        else:  # only the system prompt is shared
            tokens = rng.choice(systems) + _tokens(generator, max(0, length - SYSTEM_TOKENS))
        prompts.append(tokens[:length])
    return prompts


def _stores(placement: Placement) -> Iterator[BlocksStored]:
    keys = placement.keys
    for start in range(0, len(keys), EVENT_BLOCKS):
        parent = keys[start - 1] if start else None
        yield BlocksStored(keys[start : start + EVENT_BLOCKS], Tier.DEVICE, start, parent)


def _kvplane_batches(fleet: Fleet) -> list[tuple[str, list[KvEvent]]]:
    batches: list[tuple[str, list[KvEvent]]] = []
    for placement in fleet.placements:
        events: list[KvEvent] = list(_stores(placement))
        for start in range(0, len(events), BATCH_EVENTS):
            batches.append((f"worker-{placement.worker}", events[start : start + BATCH_EVENTS]))
    for worker, keys in fleet.evictions:
        removals: list[KvEvent] = [
            BlocksRemoved(keys[start : start + EVENT_BLOCKS], Tier.DEVICE)
            for start in range(0, len(keys), EVENT_BLOCKS)
        ]
        batches.append((f"worker-{worker}", removals))
    return batches


# -- the indexes under test ------------------------------------------------------------


class KvplaneIndex:
    """kvplane's own LocationIndex (the memory one, or Redis), filled by its apply()."""

    def __init__(self, name: str, make: Callable[[], Awaitable[LocationIndex]]) -> None:
        self.name = name
        self._make = make
        self._index: LocationIndex | None = None
        self._batches: list[tuple[str, list[KvEvent]]] = []
        self._root = root_key(NAMESPACE)

    def prepare(self, fleet: Fleet) -> None:
        self._batches = _kvplane_batches(fleet)

    async def fill(self, fleet: Fleet) -> float:
        """A fresh index holding the fleet (close() the last one first); returns the
        seconds spent in apply()."""
        self._index = index = await self._make()
        for worker in range(fleet.workers):
            await index.register(_worker_info(worker), LEASE_S)
        started = time.perf_counter()
        for worker_id, events in self._batches:
            await index.apply(worker_id, 1, events)
        return time.perf_counter() - started

    async def lookup(self, tokens: array.array[int]) -> tuple[dict[str, int], float, float]:
        assert self._index is not None
        started = time.perf_counter_ns()
        keys = chain_keys(self._root, tokens, BLOCK_SIZE)
        hashed = time.perf_counter_ns()
        matches = await self._index.lookup(keys)
        done = time.perf_counter_ns()
        return (
            {w: m.blocks for w, m in matches.items()},
            (done - started) / 1000,
            (done - hashed) / 1000,
        )

    async def small_batches_per_s(self) -> float:
        """Batches a second of decode-time traffic: 4 one-block events a batch, as an
        engine step announces when a few running requests each fill a block."""
        assert self._index is not None
        info = WorkerInfo("worker-small-batches", 1, "http://small:8000", "bench", BLOCK_SIZE)
        await self._index.register(info, LEASE_S)
        rng = random.Random(3)
        batches = [
            [
                BlocksStored([BlockKey(rng.getrandbits(64))], Tier.DEVICE, 1, BlockKey(1))
                for _ in range(4)
            ]
            for _ in range(SMALL_BATCHES)
        ]
        started = time.perf_counter()
        for batch in batches:
            await self._index.apply(info.worker_id, 1, batch)
        seconds = time.perf_counter() - started
        await self._index.drop_worker(info.worker_id)
        return SMALL_BATCHES / seconds

    async def stats(self) -> IndexStats:
        assert self._index is not None
        return await self._index.stats()

    async def close(self) -> None:
        if self._index is not None:
            await self._index.close()
            self._index = None


def _worker_info(worker: int) -> WorkerInfo:
    return WorkerInfo(f"worker-{worker}", 1, f"http://w{worker}:8000", "bench", BLOCK_SIZE)


def _import_dynamo() -> Any:
    """Dynamo's bindings, from their own environment (never the product's)."""
    site = DYNAMO_VENV / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = site / "site-packages"
    if not (site / "dynamo" / "_core.pyi").is_file():
        raise DynamoUnavailable(
            f"Dynamo's bindings are not installed in {DYNAMO_VENV}: {DYNAMO_HINT}"
        )
    if str(site) not in sys.path:
        sys.path.append(str(site))  # after kvplane's own packages: theirs never shadow ours
    os.environ.setdefault("DYN_LOG", "error")
    import dynamo._core

    return dynamo._core


def _dynamo_hasher() -> Callable[[list[int]], list[int]]:
    core = _import_dynamo()
    return lambda tokens: list(core.compute_block_hash_for_seq(tokens, BLOCK_SIZE))


class DynamoIndex:
    """Dynamo's RadixTree through its Python bindings: each event a JSON document."""

    name = "dynamo"

    def __init__(self) -> None:
        self._core = _import_dynamo()
        self._tree: Any = None
        self._events: list[tuple[int, bytes]] = []

    def prepare(self, fleet: Fleet) -> None:
        events: list[tuple[int, bytes]] = []
        for placement in fleet.placements:
            keys, hashes = placement.keys, placement.token_hashes
            for start in range(0, len(keys), EVENT_BLOCKS):
                blocks = [
                    {"block_hash": key, "tokens_hash": token_hash}
                    for key, token_hash in zip(
                        keys[start : start + EVENT_BLOCKS],
                        hashes[start : start + EVENT_BLOCKS],
                        strict=True,
                    )
                ]
                stored = {"parent_hash": keys[start - 1] if start else None, "blocks": blocks}
                events.append((placement.worker, _dynamo_event(len(events), {"stored": stored})))
        for worker, keys in fleet.evictions:
            for start in range(0, len(keys), EVENT_BLOCKS):
                removed = {"block_hashes": keys[start : start + EVENT_BLOCKS]}
                events.append((worker, _dynamo_event(len(events), {"removed": removed})))
        self._events = events

    async def fill(self, fleet: Fleet) -> float:
        self._tree = tree = self._core.RadixTree()
        apply_event = tree.apply_event
        started = time.perf_counter()
        for worker, event in self._events:
            apply_event(worker, event)
        return time.perf_counter() - started

    async def lookup(self, tokens: array.array[int]) -> tuple[dict[str, int], float, float]:
        started = time.perf_counter_ns()
        hashes = self._core.compute_block_hash_for_seq(tokens.tolist(), BLOCK_SIZE)
        hashed = time.perf_counter_ns()
        scores = self._tree.find_matches(hashes).scores
        done = time.perf_counter_ns()
        matched = {f"worker-{worker}": blocks for (worker, _rank), blocks in scores.items()}
        return matched, (done - started) / 1000, (done - hashed) / 1000

    async def close(self) -> None:
        self._tree = None


def _dynamo_event(event_id: int, data: dict[str, object]) -> bytes:
    return json.dumps({"event_id": event_id, "data": data}).encode()


# -- measuring ------------------------------------------------------------------------


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def resident_growth(side: str, *, workers: int, entries: int, seed: int) -> int:
    """Bytes the resident set of a fresh process grows by while `side` ("memory" or
    "dynamo") fills with the fleet these arguments build. A fresh process: in this one,
    memory freed by earlier fills would be reused and hide the growth."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as child:
        return child.submit(_grow, side, workers, entries, seed).result()


def _grow(side_name: str, workers: int, entries: int, seed: int) -> int:
    fleet = build_fleet(
        workers=workers, entries=entries, lookups=0, seed=seed, token_hashes=side_name == "dynamo"
    )
    side = DynamoIndex() if side_name == "dynamo" else KvplaneIndex("memory", _memory_index)
    side.prepare(fleet)
    gc.collect()
    before = _resident_bytes()
    asyncio.run(side.fill(fleet))
    return _resident_bytes() - before


async def compare(
    fleet: Fleet,
    sides: list[KvplaneIndex | DynamoIndex],
    grown: dict[str, int],
    *,
    repeats: int,
) -> FleetReport:
    """Fill every side `repeats` times (interleaved), then run the lookups through each
    in turn, one lookup at a time, checking that they agree. `grown`: each side's
    resident growth (resident_growth)."""
    fills: dict[str, list[float]] = {side.name: [] for side in sides}
    applied = fleet.stored_blocks + fleet.removed_blocks
    for _ in range(repeats):
        for side in sides:
            await side.close()
            gc.collect()
            fills[side.name].append(applied / await side.fill(fleet))
    # The last fill of each side stays for the lookups.
    samples: dict[str, tuple[list[float], list[float]]] = {s.name: ([], []) for s in sides}
    agreed = 0
    for tokens in fleet.lookups:
        answers = []
        for side in sides:
            matched, total_us, index_us = await side.lookup(tokens)
            samples[side.name][0].append(total_us)
            samples[side.name][1].append(index_us)
            answers.append(matched)
        if any(answer != answers[0] for answer in answers[1:]):
            raise RuntimeError(
                f"the indexes disagree on a {len(tokens)}-token lookup: "
                + "; ".join(f"{s.name}: {a}" for s, a in zip(sides, answers, strict=True))
            )
        agreed += 1
    report = FleetReport(fleet.workers, fleet.entries, len(fleet.lookups), agreed)
    for side in sides:
        entries = fleet.entries
        figures = _figures(side.name, fleet.workers, entries, fills[side.name], *samples[side.name])
        figures.bytes_per_entry = grown[side.name] / entries
        if isinstance(side, KvplaneIndex):
            stats = await side.stats()
            if stats.entries != entries:
                raise RuntimeError(
                    f"{side.name} holds {stats.entries:,} entries, the fleet {entries:,}"
                )
            figures.table_bytes_per_entry = stats.bytes / entries
            figures.apply_small_batches_per_s = await side.small_batches_per_s()
        report.indexes.append(figures)
    for side in sides:
        await side.close()
    return report


def _figures(
    name: str,
    workers: int,
    entries: int,
    apply_rates: list[float],
    with_hashing: list[float],
    index_only: list[float],
) -> IndexFigures:
    return IndexFigures(
        index=name,
        workers=workers,
        entries=entries,
        apply_entries_per_s=statistics.median(apply_rates),
        apply_runs=apply_rates,
        lookup_p50_us=statistics.median(with_hashing),
        lookup_p99_us=percentile(with_hashing, 0.99),
        index_lookup_p50_us=statistics.median(index_only),
        index_lookup_p99_us=percentile(index_only, 0.99),
    )


async def _redis_figures(url: str, fleet: Fleet, groups: int, directory: bool) -> IndexFigures:
    """The Redis backend on the same kind of fleet (its own size), in `groups` groups that
    keep directories or not: apply, lookups and Redis' used_memory per entry."""
    import redis.asyncio as aioredis

    from router.index.redis import RedisLocationIndex

    prefix = f"kvpbench-{uuid.uuid4().hex[:8]}"
    admin = aioredis.Redis.from_url(url)

    async def make() -> LocationIndex:
        return RedisLocationIndex.from_url(
            url,
            cluster=False,
            prefix=prefix,
            max_entries=None,
            groups=groups,
            directory=directory,
        )

    name = "redis-directory" if directory else "redis"
    side = KvplaneIndex(name, make)
    side.prepare(fleet)
    try:
        before = int((await admin.info("memory"))["used_memory"])
        seconds = await side.fill(fleet)
        used = int((await admin.info("memory"))["used_memory"]) - before
        with_hashing, index_only = [], []
        for tokens in fleet.lookups:
            _, total_us, index_us = await side.lookup(tokens)
            with_hashing.append(total_us)
            index_only.append(index_us)
        entries = (await side.stats()).entries
        rate = (fleet.stored_blocks + fleet.removed_blocks) / seconds
        figures = _figures(name, fleet.workers, entries, [rate], with_hashing, index_only)
        figures.bytes_per_entry = used / max(1, entries)
        figures.apply_small_batches_per_s = await side.small_batches_per_s()
        return figures
    finally:
        await side.close()
        async for key in admin.scan_iter(match=f"{prefix}:*", count=1000):
            await admin.delete(key)
        await admin.aclose()


def measure_keys_8k_prompt_us(repeats: int = 2000) -> dict[str, float]:
    """Block keys of an 8,192-token prompt (512 blocks): from the array of token ids the
    router holds, and from a list of ints (what an agent's decoded event carries)."""
    tokens = _tokens(np.random.default_rng(7), 8192)
    figures = {}
    for form, prompt in (("array", tokens), ("list", tokens.tolist())):
        block_keys(prompt, NAMESPACE)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter_ns()
            block_keys(prompt, NAMESPACE)
            samples.append((time.perf_counter_ns() - started) / 1000)
        figures[f"from_{form}_p50_us"] = statistics.median(samples)
    return figures


# -- the command ----------------------------------------------------------------------


def _print_fleet(report: FleetReport) -> None:
    agreed = "" if report.agreed_lookups is None else f", {report.agreed_lookups:,} agreed"
    print(
        f"\n{report.workers} workers, {report.entries:,} entries after eviction, "
        f"{report.lookups:,} lookups{agreed}"
    )
    print(
        f"{'index':<8} {'apply entries/s':>15} {'lookup p50':>11} {'p99':>9} "
        f"{'index p50':>10} {'p99':>9} {'bytes/entry':>11}"
    )
    for row in report.indexes:
        print(
            f"{row.index:<8} {row.apply_entries_per_s:>15,.0f} {row.lookup_p50_us:>9.1f}µs "
            f"{row.lookup_p99_us:>7.1f}µs {row.index_lookup_p50_us:>8.1f}µs "
            f"{row.index_lookup_p99_us:>7.1f}µs {row.bytes_per_entry:>11.1f}"
        )
    ours = {row.index: row for row in report.indexes}
    if "memory" in ours and "dynamo" in ours:
        kv, dyn = ours["memory"], ours["dynamo"]
        print(
            f"kvplane/dynamo: apply {kv.apply_entries_per_s / dyn.apply_entries_per_s:.2f}x, "
            f"lookup p50 {kv.lookup_p50_us / dyn.lookup_p50_us:.2f}x, "
            f"p99 {kv.lookup_p99_us / dyn.lookup_p99_us:.2f}x "
            f"(index alone {kv.index_lookup_p50_us / dyn.index_lookup_p50_us:.2f}x, "
            f"{kv.index_lookup_p99_us / dyn.index_lookup_p99_us:.2f}x), "
            f"bytes/entry {kv.bytes_per_entry / dyn.bytes_per_entry:.2f}x"
        )


def run_index_benchmark(
    *,
    json_path: Path | None,
    against: str | None,
    redis_url: str | None,
    entries: int,
    fleet_sizes: list[int],
    lookups: int,
    redis_entries: int,
    repeats: int,
    redis_groups: int,
    redis_directory: bool = False,
    seed: int = 1,
) -> int:
    with_dynamo = against == "dynamo"
    try:
        if with_dynamo:
            _import_dynamo()
    except DynamoUnavailable as error:
        print(f"kvplane bench index: {error}", file=sys.stderr)
        return 2
    keys = measure_keys_8k_prompt_us()
    print(
        f"block keys, 8,192-token prompt (512 blocks of 16): {keys['from_array_p50_us']:.1f} µs "
        f"from an array of token ids, {keys['from_list_p50_us']:.1f} µs from a list"
    )
    report: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "keys_8k_prompt": keys,
        "fleets": [],
    }
    for workers in fleet_sizes:
        fleet = build_fleet(
            workers=workers, entries=entries, lookups=lookups, seed=seed, token_hashes=with_dynamo
        )
        sides: list[KvplaneIndex | DynamoIndex] = [
            KvplaneIndex("memory", _memory_index),
            *([DynamoIndex()] if with_dynamo else []),
        ]
        for side in sides:
            side.prepare(fleet)
        grown = {
            side.name: resident_growth(side.name, workers=workers, entries=entries, seed=seed)
            for side in sides
        }
        fleet_report = asyncio.run(compare(fleet, sides, grown, repeats=repeats))
        if redis_url:
            redis_fleet = build_fleet(
                workers=workers,
                entries=redis_entries,
                lookups=lookups,
                seed=seed,
                token_hashes=False,
            )
            fleet_report.indexes.append(
                asyncio.run(_redis_figures(redis_url, redis_fleet, redis_groups, redis_directory))
            )
        if not with_dynamo:
            fleet_report.agreed_lookups = None
        _print_fleet(fleet_report)
        report["fleets"].append(asdict(fleet_report))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0


async def _memory_index() -> LocationIndex:
    return MemoryLocationIndex()
