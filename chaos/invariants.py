"""The promises checked after every fault.

- The index equals the engines' true block sets: the router's keys recomputed from what
  each engine holds (`/sim/blocks?prefixes=1`) against what the Redis index holds for
  that worker (read as docs/redis-layout.md describes it). A worker that is not live
  claims nothing, whatever its hash still holds.
- Zero cross-tenant matches: every engine simulator counts hits on blocks another cache
  scope filled; counters of engines that are killed or restarted are banked first.
- No growth of the router's memory, file descriptors and asyncio tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx2
import redis.asyncio as aioredis

from chaos.stack import (
    ADMIN_HEADERS,
    MODEL,
    REDIS_PREFIX,
    ChaosStack,
    Router,
    Worker,
    process_resources,
)
from kvplane.core.keys import BlockKey, KeyNamespace, block_keys
from router.index.redis import KeyLayout
from worker_agent.engines.base import metric_samples, total

_KEY_FIELD_BYTES = 8


@dataclass(frozen=True, slots=True)
class IndexComparison:
    worker_id: str
    engine_blocks: int
    missing: int  # held by the engine, not claimed by the index
    stale: int  # claimed by the index, not held by the engine

    @property
    def equal(self) -> bool:
        return self.missing == 0 and self.stale == 0


async def engine_keys(fleet: ChaosStack, worker: Worker) -> set[BlockKey]:
    """The router's keys for every block the engine holds."""
    body = await fleet.engine_blocks(worker, prefixes=True)
    keys = set()
    for block in body["blocks"]:
        lora, _, salt = block["scope"].rpartition("/")
        namespace = KeyNamespace(MODEL, body["block_size"], lora, salt)
        keys.add(block_keys(block["prefix_token_ids"], namespace)[-1])
    return keys


async def index_keys(fleet: ChaosStack, worker: Worker) -> set[int]:
    """The keys the index serves for the worker (none unless it is live)."""
    state, _ = await fleet.state_of(worker)
    if state != "live":
        return set()
    client: aioredis.Redis = aioredis.Redis.from_url(fleet.redis.url)
    try:
        fields: dict[bytes | str, bytes | str] = await client.hgetall(
            KeyLayout(REDIS_PREFIX).worker(worker.worker_id)
        )
    finally:
        await client.aclose()
    return {
        int.from_bytes(name, "little")
        for name, value in fields.items()
        if isinstance(name, bytes)
        and isinstance(value, bytes)
        and len(name) == _KEY_FIELD_BYTES
        and value[0] != 0  # tier mask 0: a placeholder
    }


async def compare_index(fleet: ChaosStack) -> list[IndexComparison]:
    comparisons = []
    for worker in fleet.workers:
        engine, index = await engine_keys(fleet, worker), await index_keys(fleet, worker)
        comparisons.append(
            IndexComparison(worker.worker_id, len(engine), len(engine - index), len(index - engine))
        )
    return comparisons


async def index_converges(
    fleet: ChaosStack, timeout_s: float
) -> tuple[float, list[IndexComparison]]:
    """Seconds until the index equals every engine's block set (load stopped), and the
    last comparison (with what still differs if it never did)."""
    last: list[IndexComparison] = []

    async def equal() -> bool:
        nonlocal last
        last = await compare_index(fleet)
        return all(comparison.equal for comparison in last)

    try:
        seconds = await fleet.wait_for("the index equals the engines", equal, timeout_s, 0.2)
    except TimeoutError:
        return float("nan"), last
    return seconds, last


class CrossScopeLedger:
    """Hits on another scope's blocks, over every engine process the run has seen."""

    def __init__(self) -> None:
        self._banked: dict[str, int] = {}

    async def current(self, fleet: ChaosStack, worker: Worker) -> int:
        return int((await fleet.engine_blocks(worker))["cross_scope_hits"])

    async def bank(self, fleet: ChaosStack, worker: Worker) -> None:
        """Before the engine's counter goes (a kill, a restart)."""
        try:
            count = await self.current(fleet, worker)
        except httpx2.HTTPError:
            return  # already gone: what it had counted is lost, and will be reported as such
        self._banked[worker.worker_id] = self._banked.get(worker.worker_id, 0) + count

    async def total(self, fleet: ChaosStack) -> int:
        live = 0
        for worker in fleet.workers:
            live += await self.current(fleet, worker)
        return sum(self._banked.values()) + live

    async def scopes_seen(self, fleet: ChaosStack) -> int:
        """Distinct cache scopes in the engines now: more than one, or the check is idle."""
        scopes = set()
        for worker in fleet.workers:
            scopes |= {block["scope"] for block in (await fleet.engine_blocks(worker))["blocks"]}
        return len(scopes)


@dataclass(frozen=True, slots=True)
class RouterResources:
    rss_bytes: int
    open_fds: int
    tasks: int


async def router_resources(fleet: ChaosStack, router: Router) -> RouterResources:
    rss, fds = process_resources(router.child.pid)
    text = (await fleet.http.get(router.url + "/metrics", headers=ADMIN_HEADERS)).text
    tasks = total(metric_samples(text, ("kvplane_event_loop_tasks",)), "kvplane_event_loop_tasks")
    if tasks is None:
        raise ValueError(f"{router.child.name} exports no kvplane_event_loop_tasks")
    return RouterResources(rss, fds, int(tasks))


def resources_grew(name: str, old: RouterResources, new: RouterResources) -> tuple[str, bool]:
    """A line for the report, and whether descriptors, tasks or memory grew past noise
    (a few connections in a pool, a few tasks finishing, allocator slack)."""
    line = (
        f"{name}: RSS {old.rss_bytes / 2**20:.1f}→{new.rss_bytes / 2**20:.1f} MiB, "
        f"fds {old.open_fds}→{new.open_fds}, tasks {old.tasks}→{new.tasks}"
    )
    grew = (
        new.open_fds > old.open_fds + 4
        or new.tasks > old.tasks + 2
        or new.rss_bytes - old.rss_bytes > 32 * 2**20
    )
    return line, grew
