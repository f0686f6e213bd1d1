"""One function per fault. Each runs while the load generator keeps the fleet busy, and
returns what it measured and any promise it saw broken; `run_suite` adds the checks
every scenario shares (outcomes, the index against the engines, tenant isolation).

Times: `purge_s` runs from the fault to the moment the registry stops listing the worker
as live (its locations are no longer used by any lookup); `recover_s` from the repair
(restart, heal) to the moment the worker is live again under a new incarnation, or the
router serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx2

from chaos.invariants import (
    CrossScopeLedger,
    IndexComparison,
    RouterResources,
    index_converges,
    resources_grew,
    router_resources,
)
from chaos.load import LoadGenerator, Outcome, prompt
from chaos.stack import ADMIN_HEADERS, MODEL, TENANT_KEYS, ChaosStack, Worker
from chaos.tcp_proxy import Mode


@dataclass(frozen=True, slots=True)
class Profile:
    """How long faults last: `SHORT` in `make test`, `FULL` in `make chaos`."""

    name: str
    warmup_s: float
    hold_s: float  # how long a fault lasts before the repair (beyond what it must wait)
    after_s: float  # load after the repair
    soak_s: float
    concurrency: int


SHORT = Profile("short", warmup_s=1.0, hold_s=0.5, after_s=1.0, soak_s=8.0, concurrency=3)
FULL = Profile("full", warmup_s=3.0, hold_s=3.0, after_s=4.0, soak_s=60.0, concurrency=4)


@dataclass
class Measured:
    """What one fault measured, beyond the request outcomes."""

    purge_s: float | None = None
    recover_s: float | None = None
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class ScenarioResult:
    name: str
    fault: str
    outcomes: Counter[Outcome]
    failure_kinds: Counter[str]
    measured: Measured
    index: list[IndexComparison]
    index_converge_s: float
    cross_tenant_matches: int

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())

    @property
    def passed(self) -> bool:
        return not self.measured.problems


@dataclass
class Chaos:
    fleet: ChaosStack
    load: LoadGenerator
    ledger: CrossScopeLedger
    profile: Profile

    @property
    def lease_s(self) -> float:
        return self.fleet.shape.lease_s

    async def hold(self) -> None:
        await asyncio.sleep(self.profile.hold_s)

    async def not_live(self, worker: Worker) -> float:
        """Seconds until the registry stops listing the worker as live."""

        async def gone() -> bool:
            return (await self.fleet.state_of(worker))[0] != "live"

        return await self.fleet.wait_for(f"{worker.worker_id} is not live", gone, self.lease_s * 4)

    async def live_again(self, worker: Worker, old_incarnation: int) -> float:
        """Seconds until the worker is live under an incarnation other than `old`."""

        async def back() -> bool:
            state, incarnation = await self.fleet.state_of(worker)
            return state == "live" and incarnation != old_incarnation

        return await self.fleet.wait_for(f"{worker.worker_id} is back", back, 30)


Fault = Callable[[Chaos], Awaitable[Measured]]


# -- processes killed -------------------------------------------------------------------


async def engine_killed(chaos: Chaos) -> Measured:
    return await _kill_and_restart(chaos, chaos.fleet.workers[0], engine=True, agent=False)


async def agent_killed(chaos: Chaos) -> Measured:
    return await _kill_and_restart(chaos, chaos.fleet.workers[1], engine=False, agent=True)


async def engine_and_agent_killed(chaos: Chaos) -> Measured:
    return await _kill_and_restart(chaos, chaos.fleet.workers[2], engine=True, agent=True)


async def _kill_and_restart(chaos: Chaos, worker: Worker, *, engine: bool, agent: bool) -> Measured:
    fleet, measured = chaos.fleet, Measured()
    _, incarnation = await fleet.state_of(worker)
    if engine:
        await chaos.ledger.bank(fleet, worker)
        worker.engine.kill()
    if agent:
        worker.agent.kill()
    measured.purge_s = await chaos.not_live(worker)
    await chaos.hold()
    repaired = time.monotonic()
    if engine:
        await fleet.start_engine(worker)
    if agent:
        await fleet.start_agent(worker)
    await chaos.live_again(worker, incarnation)
    measured.recover_s = time.monotonic() - repaired
    if agent and not engine:
        # A new agent knows only what the engine stores from now on; what the engine
        # already held is claimed again as requests store it anew. Start from a clean
        # slate, so that the index can equal the engine again (see docs/reliability.md).
        await _reset_prefix_cache(chaos, worker)
        measured.notes.append("prefix cache reset after the agent restart (blocks it missed)")
    return measured


async def worker_killed_mid_stream(chaos: Chaos) -> Measured:
    """Long streams pinned on one worker (the others drained), then its engine killed:
    each stream must end with an error event, never silently."""
    fleet, measured = chaos.fleet, Measured()
    target = fleet.workers[1]
    others = [worker for worker in fleet.workers if worker is not target]
    router = fleet.routers[1]
    for worker in others:
        await fleet.http.post(
            f"{router.url}/fleet/workers/{worker.worker_id}/drain", headers=ADMIN_HEADERS
        )
    await asyncio.sleep(0.6)  # the drain reaches the other router with the next registry read
    streams = [
        asyncio.create_task(chaos.load.send(tenant, streamed=True, max_tokens=500, router_index=1))
        for tenant in sorted(TENANT_KEYS)[:2]  # two fit in the engine's cache at once
    ]
    await asyncio.sleep(1.0)
    _, incarnation = await fleet.state_of(target)
    await chaos.ledger.bank(fleet, target)
    target.engine.kill()
    for worker in others:
        await fleet.http.post(
            f"{router.url}/fleet/workers/{worker.worker_id}/undrain", headers=ADMIN_HEADERS
        )
    records = await asyncio.gather(*streams)
    chaos.load.records.extend(records)
    cut = [record for record in records if record.worker == target.worker_id]
    measured.notes.append(
        f"{len(cut)} of {len(records)} long streams were on {target.worker_id} when it died: "
        + ", ".join(sorted({record.detail or record.outcome.value for record in cut}))
    )
    if not cut:
        measured.problems.append("no stream was on the killed worker: the fault was not tested")
    measured.problems += [
        f"a stream cut by the kill ended as {record.outcome.value}"
        for record in cut
        if record.outcome is not Outcome.FAILED
    ]
    measured.purge_s = await chaos.not_live(target)
    repaired = time.monotonic()
    await fleet.start_engine(target)
    await chaos.live_again(target, incarnation)
    measured.recover_s = time.monotonic() - repaired
    return measured


async def router_killed(chaos: Chaos) -> Measured:
    """The router the agents report to first, and half the clients use, is killed;
    clients and agents move to the other. Restarted, it must route on the shared index
    from its first request."""
    fleet, measured = chaos.fleet, Measured()
    router = fleet.routers[0]
    incarnations = {w.worker_id: (await fleet.state_of(w))[1] for w in fleet.workers}
    router.child.kill()
    await chaos.hold()
    await asyncio.sleep(chaos.lease_s)  # past a lease: the agents must have moved
    moved = {w.worker_id: await fleet.state_of(w) for w in fleet.workers}
    for worker_id, (state, incarnation) in moved.items():
        if state != "live":
            measured.problems.append(f"{worker_id} was {state} while one router was down")
        elif incarnation != incarnations[worker_id]:
            measured.notes.append(f"{worker_id} re-registered on the other router")
    repaired = time.monotonic()
    await fleet.start_router(router)
    measured.recover_s = time.monotonic() - repaired
    # Its very first request: cache-aware from the shared index (a prompt just served).
    tenant = sorted(TENANT_KEYS)[0]
    probe = LoadGenerator([router.url], concurrency=1, seed=7)
    try:
        warm = await probe.send(tenant, streamed=False)
        first = await probe.send(tenant, streamed=False)
    finally:
        await probe.close()
    chaos.load.records += [warm, first]
    if first.predicted_cached_tokens == 0:
        measured.problems.append("the restarted router predicted no cached prefix (cold start)")
    measured.notes.append(
        f"restarted router's first repeat: predicted {first.predicted_cached_tokens} cached "
        f"tokens, engine reported {first.reported_cached_tokens}"
    )
    return measured


async def redis_restarted_empty(chaos: Chaos) -> Measured:
    fleet, measured = chaos.fleet, Measured()
    fleet.redis.kill()
    await asyncio.sleep(chaos.lease_s + chaos.profile.hold_s)
    ready = (await fleet.http.get(fleet.routers[1].url + "/readyz")).json()
    if ready.get("routing") != "load-only":
        measured.problems.append(f"routers did not degrade to load-only routing: {ready}")
    measured.notes.append(f"during the outage /readyz said routing={ready.get('routing')}")
    repaired = time.monotonic()
    await fleet.redis.start()
    await fleet.wait_for("every worker is live again", fleet.all_live, 30)
    measured.recover_s = time.monotonic() - repaired
    return measured


# -- the network --------------------------------------------------------------------------


async def partition_blackhole(chaos: Chaos) -> Measured:
    return await _partition(chaos, Mode.BLACKHOLE)


async def partition_drop(chaos: Chaos) -> Measured:
    return await _partition(chaos, Mode.DROP)


async def _partition(chaos: Chaos, mode: Mode) -> Measured:
    fleet, measured = chaos.fleet, Measured()
    worker = fleet.workers[2]
    _, incarnation = await fleet.state_of(worker)
    for proxy in worker.proxies:
        proxy.set_mode(mode)
    measured.purge_s = await chaos.not_live(worker)
    await chaos.hold()
    repaired = time.monotonic()
    for proxy in worker.proxies:
        proxy.set_mode(Mode.PASS)
    await chaos.live_again(worker, incarnation)
    measured.recover_s = time.monotonic() - repaired
    return measured


async def partition_delay(chaos: Chaos) -> Measured:
    """300 ms each way on every path of one agent, for longer than a lease: slower
    events, but the worker must stay live and its lease renewed."""
    fleet, measured = chaos.fleet, Measured()
    worker = fleet.workers[0]
    for proxy in worker.proxies:
        proxy.set_mode(Mode.DELAY, delay_s=0.3)
    states = []
    deadline = time.monotonic() + chaos.lease_s * 1.5 + chaos.profile.hold_s
    while time.monotonic() < deadline:
        states.append((await fleet.state_of(worker))[0])
        await asyncio.sleep(0.1)
    for proxy in worker.proxies:
        proxy.set_mode(Mode.PASS)
    if any(state != "live" for state in states):
        measured.problems.append(f"{worker.worker_id} left the live state under delay: {states}")
    measured.notes.append(f"live in {states.count('live')} of {len(states)} registry reads")
    return measured


# -- engine faults ------------------------------------------------------------------------


async def engine_stalled(chaos: Chaos) -> Measured:
    """Longer than the first-byte timeout: requests there fail over before their first
    byte, or end with an error event after it."""
    fleet, measured = chaos.fleet, Measured()
    stall_s = fleet.shape.first_byte_timeout_s + 1.0
    await fleet.fault(fleet.workers[0], stall_s=stall_s)
    await asyncio.sleep(stall_s + chaos.profile.hold_s)
    measured.notes.append(
        f"stalled {stall_s:g} s (first-byte timeout {fleet.shape.first_byte_timeout_s:g} s)"
    )
    return measured


async def event_batches_dropped(chaos: Chaos) -> Measured:
    """Half of one engine's event batches lost on the way (still in its replay buffer)."""
    fleet, measured = chaos.fleet, Measured()
    worker = fleet.workers[1]
    await fleet.fault(worker, drop_event_fraction=0.5)
    await asyncio.sleep(chaos.lease_s + chaos.profile.hold_s)
    await fleet.fault(worker, drop_event_fraction=0.0)
    return measured


async def odd_events(chaos: Chaos) -> Measured:
    """Every batch of one engine carries events no agent can use (an unknown type, an
    unknown medium, blocks another node holds, a removal that does not decode) among
    its own: they are skipped and the rest applied, so its incarnation never changes
    and its index entries stay exact."""
    fleet, measured = chaos.fleet, Measured()
    worker = fleet.workers[0]
    _, incarnation = await fleet.state_of(worker)
    await fleet.fault(worker, odd_events=True)
    await asyncio.sleep(chaos.lease_s + chaos.profile.hold_s)
    await fleet.fault(worker, odd_events=False)
    _, now = await fleet.state_of(worker)
    if now != incarnation:
        measured.problems.append(f"a new incarnation for odd events ({incarnation} -> {now})")
    return measured


async def sequence_restarted(chaos: Chaos) -> Measured:
    """The engine restarts in place: requests fail, the cache empties, its event
    sequence starts again from 0. The agent must start a new incarnation."""
    fleet, measured = chaos.fleet, Measured()
    worker = fleet.workers[2]
    _, incarnation = await fleet.state_of(worker)
    await chaos.ledger.bank(fleet, worker)
    repaired = time.monotonic()
    await fleet.fault(worker, restart=True)
    await chaos.live_again(worker, incarnation)
    measured.recover_s = time.monotonic() - repaired
    return measured


async def cache_reset(chaos: Chaos) -> Measured:
    measured = Measured()
    attempts = await _reset_prefix_cache(chaos, chaos.fleet.workers[0])
    measured.notes.append(f"reset accepted at attempt {attempts} (refused while busy)")
    return measured


async def _reset_prefix_cache(chaos: Chaos, worker: Worker) -> int:
    """vLLM refuses a reset while requests hold blocks: try until an idle moment."""
    for attempt in range(1, 400):
        answer = await chaos.fleet.http.post(worker.engine_url + "/reset_prefix_cache")
        if answer.status_code == 200:
            return attempt
        await asyncio.sleep(0.025)
    raise TimeoutError(f"{worker.worker_id} never accepted a prefix cache reset")


# -- clients ------------------------------------------------------------------------------


async def slow_and_vanishing_clients(chaos: Chaos) -> Measured:
    """Clients that read a stream slowly, leave mid-stream, or leave before the first
    byte. After each round no engine may still run a request and no router may count
    one; two identical rounds (the first one warms the routers' connection pools) must
    leave the routers with the same descriptors and tasks."""
    fleet, measured = chaos.fleet, Measured()
    await chaos.load.stop()  # the steady load would keep engines busy
    before: list[RouterResources] = []
    for round_number in (1, 2):
        clients = [
            _abusive_client(router.url, behaviour, n)
            for n in range(2)
            for router in fleet.routers
            for behaviour in ("slow", "leave-mid-stream", "leave-before-first-byte")
        ]
        results = Counter(await asyncio.gather(*clients))
        measured.notes.append(
            f"round {round_number}: " + ", ".join(f"{k} {v}" for k, v in results.items())
        )
        try:
            seconds = await fleet.wait_for("engines and routers are idle", _idle(fleet), 10)
            measured.notes.append(f"engines and routers idle {seconds:.2f} s after the clients")
        except TimeoutError:
            measured.problems.append("a request outlived its client (engine or router busy)")
        if not before:
            before = [await router_resources(fleet, router) for router in fleet.routers]
    await _check_router_resources(chaos, before, measured)
    chaos.load.start()
    return measured


def _idle(fleet: ChaosStack) -> Callable[[], Awaitable[bool]]:
    async def idle() -> bool:
        running = [await fleet.engine_running(worker) for worker in fleet.workers]
        in_flight = 0
        for router in fleet.routers:
            rows = (await fleet.fleet_workers(router)).values()
            in_flight += sum(row["router_in_flight"] for row in rows)
        return sum(running) == 0 and in_flight == 0

    return idle


async def _check_router_resources(
    chaos: Chaos, before: list[RouterResources], measured: Measured
) -> None:
    for router, old in zip(chaos.fleet.routers, before, strict=True):
        line, grew = resources_grew(
            router.child.name, old, await router_resources(chaos.fleet, router)
        )
        measured.notes.append(line)
        if grew:
            measured.problems.append(f"{router.child.name} kept memory, connections or tasks")


async def _abusive_client(url: str, behaviour: str, n: int) -> str:
    tenant = sorted(TENANT_KEYS)[n % len(TENANT_KEYS)]
    body = {
        "model": MODEL,
        "messages": prompt(tenant, random.Random(n)),
        "max_tokens": 200,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {TENANT_KEYS[tenant]}"}
    timeout = 0.005 if behaviour == "leave-before-first-byte" else 20.0
    async with httpx2.AsyncClient(timeout=timeout) as client:
        try:
            async with client.stream(
                "POST", url + "/v1/chat/completions", json=body, headers=headers
            ) as answer:
                chunks = 0
                async for _ in answer.aiter_raw():
                    chunks += 1
                    if behaviour == "leave-mid-stream" and chunks == 3:
                        return "left mid-stream"
                    if behaviour == "slow":
                        await asyncio.sleep(0.05)
                return "read slowly to the end"
        except httpx2.TimeoutException:
            return "left before the first byte"


async def soak(chaos: Chaos) -> Measured:
    """Steady load for a while: the routers' memory, descriptors and tasks must not grow."""
    fleet, measured = chaos.fleet, Measured()
    await asyncio.sleep(chaos.profile.warmup_s)
    before = [await router_resources(fleet, router) for router in fleet.routers]
    await asyncio.sleep(chaos.profile.soak_s)
    await chaos.load.stop()
    await asyncio.sleep(0.5)
    await _check_router_resources(chaos, before, measured)
    chaos.load.start()
    return measured


SCENARIOS: list[tuple[str, str, Fault]] = [
    ("engine-killed", "SIGKILL an engine, restart it", engine_killed),
    ("agent-killed", "SIGKILL an agent, restart it", agent_killed),
    (
        "engine-and-agent-killed",
        "SIGKILL an engine and its agent, restart both",
        engine_and_agent_killed,
    ),
    ("killed-mid-stream", "SIGKILL an engine with streams in flight", worker_killed_mid_stream),
    ("router-killed", "SIGKILL one of two routers sharing Redis, restart it", router_killed),
    ("redis-restarted-empty", "stop Redis, restart it empty", redis_restarted_empty),
    ("partition-blackhole", "agent's paths blackholed, then healed", partition_blackhole),
    ("partition-drop", "agent's connections reset and refused, then healed", partition_drop),
    ("partition-delay", "300 ms added each way on an agent's paths", partition_delay),
    (
        "engine-stalled",
        "an engine takes no step for longer than the first-byte timeout",
        engine_stalled,
    ),
    ("event-batches-dropped", "half of an engine's event batches lost", event_batches_dropped),
    ("odd-events", "events no agent can use in every batch of an engine", odd_events),
    (
        "sequence-restarted",
        "an engine restarts in place (sequence from 0, cache empty)",
        sequence_restarted,
    ),
    ("cache-reset", "an engine's prefix cache reset", cache_reset),
    (
        "slow-and-vanishing-clients",
        "slow readers; clients leaving mid-stream, before the first byte",
        slow_and_vanishing_clients,
    ),
    ("soak", "steady load: router memory, descriptors and tasks", soak),
]


async def run_scenario(chaos: Chaos, name: str, fault: str, act: Fault) -> ScenarioResult:
    fleet, load = chaos.fleet, chaos.load
    first_record = len(load.records)
    load.start()
    await asyncio.sleep(chaos.profile.warmup_s)
    try:
        measured = await act(chaos)
        await asyncio.sleep(chaos.profile.after_s)
    finally:
        await load.stop()
    records = load.records[first_record:]
    outcomes = Counter(record.outcome for record in records)
    failure_kinds = Counter(
        f"{record.outcome.value}: {record.detail}" for record in records if record.detail
    )
    if outcomes[Outcome.LOST]:
        measured.problems.append(f"{outcomes[Outcome.LOST]} requests lost")
    if not outcomes[Outcome.OK] + outcomes[Outcome.RETRIED]:
        measured.problems.append("no request succeeded during the scenario")
    await fleet.wait_for("every worker is live", fleet.all_live, 30)
    converge_s, comparisons = await index_converges(fleet, timeout_s=10)
    if math.isnan(converge_s):
        measured.problems.append(
            "index differs from the engines: "
            + "; ".join(
                f"{c.worker_id} missing {c.missing} stale {c.stale}"
                for c in comparisons
                if not c.equal
            )
        )
    cross = await chaos.ledger.total(fleet)
    if cross:
        measured.problems.append(f"{cross} cross-tenant matches")
    return ScenarioResult(
        name, fault, outcomes, failure_kinds, measured, comparisons, converge_s, cross
    )


async def run_suite(
    fleet: ChaosStack,
    profile: Profile,
    only: set[str] | None = None,
    log: Callable[[str], None] = print,
) -> list[ScenarioResult]:
    load = LoadGenerator([router.url for router in fleet.routers], profile.concurrency)
    chaos = Chaos(fleet, load, CrossScopeLedger(), profile)
    results = []
    try:
        for name, fault, act in SCENARIOS:
            if only is not None and name not in only:
                continue
            started = time.monotonic()
            result = await run_scenario(chaos, name, fault, act)
            verdict = "ok" if result.passed else "FAILED: " + "; ".join(result.measured.problems)
            log(f"{name}: {result.sent} requests, {time.monotonic() - started:.1f} s, {verdict}")
            results.append(result)
        scopes = await chaos.ledger.scopes_seen(fleet)
        if scopes < 2 and results:
            results[-1].measured.problems.append(
                f"only {scopes} cache scope in the engines: tenant isolation was not exercised"
            )
    finally:
        with contextlib.suppress(Exception):
            await load.stop()
        await load.close()
    return results
