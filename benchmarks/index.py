"""`kvplane bench index`: block-key hashing and the location index, in figures.

The fleet it builds: `workers` workers, each holding whole 512-block prompts (8,192
tokens in blocks of 16). Every prompt opens with one of a few shared 32-block system
prompts, so a lookup starts with every worker matching and narrows from there, the hard
case for the walk. Lookups mix prompts that are cached somewhere (full and partial
hits) with prompts that share only a system prompt.

Memory is the growth, while the index fills, of what the backend uses (the process's
resident set for the in-process index, Redis' used_memory for Redis) divided by the
entries; the keys are generated on the fly so the index holds the only reference to them.
"""

from __future__ import annotations

import asyncio
import json
import platform
import random
import statistics
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from kvplane.core.keys import BlockKey, KeyNamespace, block_keys
from kvplane.core.types import BlocksStored, Tier, WorkerInfo
from router.index.base import LocationIndex
from router.index.memory import MemoryLocationIndex
from simulations.reporting import percentile

PROMPT_BLOCKS = 512
SYSTEM_BLOCKS = 32
SYSTEM_PROMPTS = 8
EVENT_BLOCKS = 64  # blocks per BlocksStored, as an engine step announces them
BATCH_EVENTS = 8  # events per KvEvents batch
SMALL_BATCHES = 5000
LEASE_S = 3600.0
_pack_pair = struct.Struct("<QQ").pack


@dataclass(frozen=True)
class IndexFigures:
    entries: int
    workers: int
    apply_entries_per_s: float
    apply_small_batches_per_s: float
    lookup_p50_us: float
    lookup_p99_us: float
    bytes_per_entry: float


def _hash(group: int, block: int) -> int:
    """A synthetic key: xxh3 of (group, block), like a real chained key in cost and spread."""
    return xxhash.xxh3_64_intdigest(_pack_pair(group, block))


def prompt_keys(prompt: int) -> list[BlockKey]:
    """The 512 keys of prompt number `prompt`: a shared system prompt, then its own."""
    system = prompt % SYSTEM_PROMPTS
    keys = [BlockKey(_hash(system, j)) for j in range(SYSTEM_BLOCKS)]
    keys += [
        BlockKey(_hash(SYSTEM_PROMPTS + prompt, j)) for j in range(SYSTEM_BLOCKS, PROMPT_BLOCKS)
    ]
    return keys


def placement(entries: int, workers: int, seed: int) -> dict[int, list[int]]:
    """Which prompts each worker holds: about entries / 512 placements, some prompts on
    more than one worker, as a cache-aware router leaves a fleet."""
    rng = random.Random(seed)
    # A worker's system-prompt blocks are entries once, however many prompts use them.
    own_blocks = PROMPT_BLOCKS - SYSTEM_BLOCKS
    per_worker = max(1, (entries // workers - SYSTEM_PROMPTS * SYSTEM_BLOCKS) // own_blocks)
    distinct = max(per_worker, int(per_worker * workers * 0.8))
    return {w: rng.sample(range(distinct), per_worker) for w in range(workers)}


def _batches(prompts: list[int]) -> Iterator[list[BlocksStored]]:
    batch: list[BlocksStored] = []
    for prompt in prompts:
        keys = prompt_keys(prompt)
        for start in range(0, PROMPT_BLOCKS, EVENT_BLOCKS):
            batch.append(
                BlocksStored(
                    keys=keys[start : start + EVENT_BLOCKS],
                    tier=Tier.DEVICE,
                    first_position=start,
                    parent_key=keys[start - 1] if start else None,
                )
            )
            if len(batch) == BATCH_EVENTS:
                yield batch
                batch = []
    if batch:
        yield batch


async def _fill(index: LocationIndex, layout: dict[int, list[int]]) -> tuple[int, float]:
    """Register every worker and apply its prompts; return entries and seconds spent in
    apply() alone (key generation excluded)."""
    applied, seconds = 0, 0.0
    for worker, prompts in layout.items():
        info = WorkerInfo(f"worker-{worker}", 1, f"http://w{worker}:8000", "bench", 16)
        await index.register(info, LEASE_S)
        for batch in _batches(prompts):
            started = time.perf_counter()
            await index.apply(info.worker_id, 1, batch)
            seconds += time.perf_counter() - started
            applied += sum(len(event.keys) for event in batch)
    return applied, seconds


async def _small_batches(index: LocationIndex, count: int) -> float:
    """Batches per second for decode-time traffic: 4 one-block events per batch, as an
    engine step announces when a few running requests each fill a block."""
    info = WorkerInfo("worker-small-batches", 1, "http://small:8000", "bench", 16)
    await index.register(info, LEASE_S)
    batches = []
    for n in range(count):
        keys = [BlockKey(_hash(2**40 + n, j)) for j in range(4)]
        batches.append(
            [
                BlocksStored([key], Tier.DEVICE, first_position=1, parent_key=BlockKey(1))
                for key in keys
            ]
        )
    started = time.perf_counter()
    for batch in batches:
        await index.apply(info.worker_id, 1, batch)
    seconds = time.perf_counter() - started
    await index.drop_worker(info.worker_id)
    return count / seconds


async def _lookups(
    index: LocationIndex, layout: dict[int, list[int]], count: int, seed: int
) -> list[float]:
    rng = random.Random(seed + 1)
    held = [prompt for prompts in layout.values() for prompt in prompts]
    unseen = max(held) + 1
    requests: list[list[BlockKey]] = []
    for n in range(count):
        kind = n % 3
        if kind == 0:  # a prompt cached on some worker
            requests.append(prompt_keys(rng.choice(held)))
        elif kind == 1:  # its first part, then a new turn
            keys = prompt_keys(rng.choice(held))
            cut = rng.randrange(SYSTEM_BLOCKS, PROMPT_BLOCKS)
            requests.append(keys[:cut] + prompt_keys(unseen + n)[cut:])
        else:  # only the system prompt is shared
            requests.append(prompt_keys(unseen + n))
    for keys in requests[:20]:  # warm caches and connections
        await index.lookup(keys)
    samples = []
    for keys in requests:
        started = time.perf_counter_ns()
        await index.lookup(keys)
        samples.append((time.perf_counter_ns() - started) / 1000)
    return samples


async def measure_index(
    index: LocationIndex,
    *,
    entries: int,
    workers: int,
    lookups: int,
    seed: int,
    used_memory: Callable[[], Awaitable[int]],
) -> IndexFigures:
    """Fill `index`, then time lookups; `used_memory` reads the bytes the backend uses."""
    layout = placement(entries, workers, seed)
    memory_before = await used_memory()
    applied, seconds = await _fill(index, layout)
    memory_bytes = await used_memory() - memory_before
    stats = await index.stats()
    samples = await _lookups(index, layout, lookups, seed)
    return IndexFigures(
        entries=stats.entries,
        workers=workers,
        apply_entries_per_s=applied / seconds,
        apply_small_batches_per_s=await _small_batches(index, SMALL_BATCHES),
        lookup_p50_us=statistics.median(samples),
        lookup_p99_us=percentile(samples, 0.99),
        bytes_per_entry=memory_bytes / max(1, stats.entries),
    )


def measure_keys_8k_prompt_us(repeats: int = 2000) -> float:
    rng = random.Random(7)
    tokens = [rng.randrange(128_256) for _ in range(8192)]
    namespace = KeyNamespace(model="bench", block_size=16)
    block_keys(tokens, namespace)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter_ns()
        block_keys(tokens, namespace)
        samples.append((time.perf_counter_ns() - started) / 1000)
    return statistics.median(samples)


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


async def _measure_memory(*, entries: int, workers: int, lookups: int, seed: int) -> IndexFigures:
    async def resident_bytes() -> int:
        return _resident_bytes()  # /proc answers from memory: nothing waits on a disk

    return await measure_index(
        MemoryLocationIndex(),
        entries=entries,
        workers=workers,
        lookups=lookups,
        seed=seed,
        used_memory=resident_bytes,
    )


async def _measure_redis(
    url: str, *, entries: int, workers: int, lookups: int, seed: int
) -> IndexFigures:
    import redis.asyncio as aioredis

    from router.index.redis import RedisLocationIndex

    prefix = f"kvpbench-{uuid.uuid4().hex[:8]}"
    admin = aioredis.Redis.from_url(url)
    index = RedisLocationIndex.from_url(url, cluster=False, prefix=prefix, max_entries=None)

    async def used_memory() -> int:
        return int((await admin.info("memory"))["used_memory"])

    try:
        return await measure_index(
            index,
            entries=entries,
            workers=workers,
            lookups=lookups,
            seed=seed,
            used_memory=used_memory,
        )
    finally:
        for worker in range(workers):
            await index.drop_worker(f"worker-{worker}")
        async for key in admin.scan_iter(match=f"{prefix}:*", count=1000):
            await admin.delete(key)
        await index.close()
        await admin.aclose()


def _print_table(report: dict[str, object]) -> None:
    keys_us = report["keys_8k_prompt_us"]
    print(f"block keys, 8,192-token prompt (512 blocks of 16): {keys_us:.1f} µs")
    header = f"{'backend':<8} {'entries':>11} {'workers':>7} {'apply entries/s':>15} "
    header += f"{'small batches/s':>15} {'lookup p50':>11} {'lookup p99':>11} {'bytes/entry':>11}"
    print(header)
    for name in ("memory", "redis"):
        figures = report.get(name)
        if not isinstance(figures, dict):
            continue
        print(
            f"{name:<8} {figures['entries']:>11,} {figures['workers']:>7} "
            f"{figures['apply_entries_per_s']:>15,.0f} "
            f"{figures['apply_small_batches_per_s']:>15,.0f} "
            f"{figures['lookup_p50_us']:>9.1f}µs {figures['lookup_p99_us']:>9.1f}µs "
            f"{figures['bytes_per_entry']:>11.1f}"
        )


def run_index_benchmark(
    *,
    json_path: Path | None,
    redis_url: str | None,
    entries: int,
    workers: int,
    lookups: int,
    redis_entries: int,
    seed: int = 1,
) -> int:
    report: dict[str, object] = {
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "keys_8k_prompt_us": measure_keys_8k_prompt_us(),
    }
    memory = asyncio.run(
        _measure_memory(entries=entries, workers=workers, lookups=lookups, seed=seed)
    )
    report["memory"] = asdict(memory)
    if redis_url:
        report["redis"] = asdict(
            asyncio.run(
                _measure_redis(
                    redis_url, entries=redis_entries, workers=workers, lookups=lookups, seed=seed
                )
            )
        )
    _print_table(report)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0
