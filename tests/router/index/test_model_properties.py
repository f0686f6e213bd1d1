"""Every backend against a plain-Python model of the index, through random sequences of
event batches, incarnation changes, lease expiries, drops and purges (hypothesis)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvplane.core.types import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEvent,
    Tier,
    WorkerInfo,
)
from router.index.base import LocationIndex, StaleIncarnation, UnknownWorker
from router.index.memory import MemoryLocationIndex
from tests.router.index.conftest import delete_prefix, open_redis_index, redis_url_for

T = TypeVar("T")
WORKERS = ["w0", "w1", "w2"]
CHAINS = 3
CHAIN_LENGTH = 6
LEASE = 60.0


def chain(number: int) -> list[int]:
    return [(number + 1) * 2**40 + position for position in range(CHAIN_LENGTH)]


@dataclass
class ModelWorker:
    incarnation: int
    alive: bool = True
    held: dict[int, set[Tier]] = field(default_factory=dict)  # key -> tiers

    def entries(self) -> int:
        return sum(len(tiers) for tiers in self.held.values())


class IndexModel(RuleBasedStateMachine):
    """Subclasses build the backend under test in `open_index`."""

    async def open_index(self) -> LocationIndex:
        raise NotImplementedError

    async def close_backend(self) -> None:
        return None

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.index = self.run(self.open_index())
        self.model: dict[str, ModelWorker] = {}

    def run(self, awaitable: Awaitable[T]) -> T:
        async def wrapper() -> T:
            return await awaitable

        return self.loop.run_until_complete(wrapper())

    def teardown(self) -> None:
        self.run(self.index.close())
        self.run(self.close_backend())
        self.loop.close()

    def expect(self, error: type[Exception] | None, awaitable: Awaitable[Any]) -> None:
        if error is None:
            self.run(awaitable)
        else:
            with pytest.raises(error):
                self.run(awaitable)

    def _error_for_write(self, worker_id: str, incarnation: int) -> type[Exception] | None:
        current = self.model.get(worker_id)
        if current is None:
            return UnknownWorker
        if incarnation < current.incarnation:
            return StaleIncarnation
        if incarnation > current.incarnation or not current.alive:
            return UnknownWorker
        return None

    @initialize()
    def register_everyone(self) -> None:
        # Writes to unregistered workers only test refusal; start where most succeed.
        for worker in WORKERS:
            self.run(self.index.register(WorkerInfo(worker, 1, "http://e:8000", "m", 16), LEASE))
            self.model[worker] = ModelWorker(1)

    @rule(worker=st.sampled_from(WORKERS), step=st.sampled_from([-1, 0, 0, 1]))
    def register(self, worker: str, step: int) -> None:
        current = self.model.get(worker)
        incarnation = max(1, (current.incarnation if current else 1) + step)
        info = WorkerInfo(worker, incarnation, "http://e:8000", "m", 16)
        if current is not None and incarnation < current.incarnation:
            self.expect(StaleIncarnation, self.index.register(info, LEASE))
            return
        self.run(self.index.register(info, LEASE))
        if current is not None and incarnation == current.incarnation:
            current.alive = True  # a reconnect, its lease running or not: all kept
            return
        self.model[worker] = ModelWorker(incarnation)

    @rule(
        worker=st.sampled_from(WORKERS),
        stale=st.sampled_from([False, False, False, True]),
        events=st.lists(
            st.tuples(
                st.sampled_from(["store", "store", "store", "remove", "remove", "clear"]),
                st.integers(0, CHAINS - 1),
                st.integers(0, CHAIN_LENGTH - 1),
                st.integers(1, CHAIN_LENGTH),
                st.sampled_from([Tier.DEVICE, Tier.DEVICE, Tier.HOST]),
            ),
            max_size=4,
        ),
    )
    def apply(
        self, worker: str, stale: bool, events: list[tuple[str, int, int, int, Tier]]
    ) -> None:
        current = self.model.get(worker)
        incarnation = (current.incarnation if current else 1) - (1 if stale else 0)
        batch: list[KvEvent] = []
        for kind, number, start, length, tier in events:
            keys = chain(number)[start : start + length]
            if kind == "store":
                parent = chain(number)[start - 1] if start else None
                batch.append(BlocksStored(keys, tier, first_position=start, parent_key=parent))
            elif kind == "remove":
                batch.append(BlocksRemoved(keys, tier))
            else:
                batch.append(AllBlocksCleared())
        error = self._error_for_write(worker, incarnation)
        self.expect(error, self.index.apply(worker, incarnation, batch))
        if error is not None or current is None:
            return
        for event in batch:
            if isinstance(event, BlocksStored):
                for key in event.keys:
                    current.held.setdefault(key, set()).add(event.tier)
            elif isinstance(event, BlocksRemoved):
                for key in event.keys:
                    current.held.get(key, set()).discard(event.tier)
                    if not current.held.get(key, True):
                        del current.held[key]
            else:
                current.held.clear()

    @rule(worker=st.sampled_from(WORKERS))
    def expire(self, worker: str) -> None:
        current = self.model.get(worker)
        incarnation = current.incarnation if current else 1
        error = self._error_for_write(worker, incarnation)
        self.expect(error, self.index.renew(worker, incarnation, 0))
        if current is not None and error is None:
            current.alive = False

    @rule(worker=st.sampled_from(WORKERS))
    def drop(self, worker: str) -> None:
        self.run(self.index.drop_worker(worker))
        self.model.pop(worker, None)

    @rule()
    def purge(self) -> None:
        purged = self.run(self.index.purge_expired())
        dead = {w for w, m in self.model.items() if not m.alive}
        assert set(purged) == dead
        for worker in dead:
            del self.model[worker]

    @invariant()
    def lookups_match_the_model(self) -> None:
        for number in range(CHAINS):
            keys = chain(number)
            expected: dict[str, tuple[int, dict[Tier, int]]] = {}
            for worker, state in self.model.items():
                if not state.alive:
                    continue
                length = 0
                by_tier: dict[Tier, int] = {}
                while length < len(keys) and state.held.get(keys[length]):
                    best = min(state.held[keys[length]])
                    by_tier[best] = by_tier.get(best, 0) + 1
                    length += 1
                if length:
                    expected[worker] = (length, by_tier)
            actual = {
                worker: (match.blocks, dict(match.by_tier))
                for worker, match in self.run(self.index.lookup(keys)).items()
            }
            assert actual == expected

    @invariant()
    def stats_match_the_model(self) -> None:
        stats = self.run(self.index.stats())
        assert stats.workers == len(self.model)
        assert stats.entries == sum(m.entries() for m in self.model.values())
        statuses = {s.info.worker_id: s for s in self.run(self.index.workers())}
        assert set(statuses) == set(self.model)
        for worker, state in self.model.items():
            assert statuses[worker].info.incarnation == state.incarnation
            assert statuses[worker].entries == state.entries()


def _machine_for(backend: str, url: str | None) -> type[IndexModel]:
    class Machine(IndexModel):
        prefix = f"kvpprop-{uuid.uuid4().hex[:8]}-{backend}"

        async def open_index(self) -> LocationIndex:
            if backend == "memory":
                return MemoryLocationIndex()
            assert url is not None
            # A fresh prefix per run keeps hypothesis' examples from seeing each other.
            self.run_prefix = f"{self.prefix}-{uuid.uuid4().hex[:6]}"
            # Directories in one group, so that lookups search several members at once
            # (the model's few workers would fall in groups of their own).
            groups = {"groups": 1} if backend.endswith("directory") else {}
            return open_redis_index(backend, url, self.run_prefix, **groups)

        async def close_backend(self) -> None:
            if backend != "memory":
                assert url is not None
                await delete_prefix(url, backend.startswith("redis-cluster"), self.run_prefix)

    return Machine


EXAMPLES = {"memory": 600, "redis": 40, "redis-cluster": 20, "redis-directory": 40}


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(EXAMPLES))
def test_index_matches_model(backend: str, request: pytest.FixtureRequest) -> None:
    url = redis_url_for(backend, request)
    machine = _machine_for(backend, url)
    machine.TestCase.settings = settings(
        max_examples=EXAMPLES[backend],
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
