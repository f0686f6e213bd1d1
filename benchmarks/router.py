"""`kvplane bench router`: the router's routing decision and its proxy, in figures.

Decisions. For each prompt length (1k, 8k, 32k tokens) and fleet size (16, 64, 256
workers) a fresh index (in-process, and Redis where asked) is filled as a serving
fleet would leave it: eight prompts of that length share their first eighth (a system
prompt); worker w holds a prefix of prompt w % 8 whose length is spread evenly over
the fleet from one block to all of it, plus four unrelated 512-block chains, all on
the device tier (with `--host-tier`, every fourth worker holds the back half of its
prefix in host memory, as with KV offloading: lookups then count blocks per tier for
every matching worker, a cost of its own). The router's own RoutingPlanner, assembled
over that index as `kvplane router` assembles it (router/assembly.py, default settings),
then decides for the eight prompts in turn, called as the proxy calls it (anonymous
tenant, shared scope, no-op tracer), and each winner is recorded as a predicted
location, as the proxy does after sending. The figures are the wall time
of `decide()` (block keys, index lookup, predictions, scoring) after a warm-up, with
the keys and the lookup also timed alone, and with Redis its own time a lookup call
through the decisions (`INFO commandstats`: less shaken by a busy machine than the
wall time). The prompts are token ids: tokenisation is
a figure of its own, the proxy's tokenisation with the default tokenizer of English
text of the same length: a `/v1/completions` prompt not seen before, the same prompt
again, and a chat whose system message (15/16 of the text) was seen before and whose
user message was not. `route shared` times that chat as the proxy routes it, from the
body received to the engine's request ready (`route_prompt`: the decision on the
prompt's start when the new end cannot change it; the end is tokenised after the
answer, outside the time, as the proxy does).

Proxy. Three child processes: an engine simulator (time scale 0, KV events on), a
`kvplane router` (in-memory index) and a `kvplane agent` registering the simulator
with it; the load comes from this process over keep-alive HTTP/1.1 connections with
the h11 client of `kvplane bench engine-sim` (short prompts, max_tokens 1). The same
requests go first to the simulator directly, then through the router: one at a time
for latency (added latency = the proxied p50 minus the direct p50), then
`concurrency` at a time for throughput. The router's CPU time (user + system, from
/proc/PID/stat) over the concurrent proxied run, per request, is its cost per request.
On a small machine the four processes share the cores: the proxied throughput is the
whole system's, the simulator and the load generator included.

The floor. A fourth child, `benchmarks/bare_proxy.py`, passes the same requests through
to the same simulator on the router's own server and client stack with nothing else
(no routing, tokenising, accounting or metrics), measured the same way after the
router: what it adds is what the stack costs, and what the router adds beyond it is
kvplane's own work.

The peer. Where `make peers-env` built the peers' environment, sglang-router's
cache_aware policy (of the cache-aware peers, the least CPU a request in every
bake-off) is a fifth child in front of the same simulator, measured the same way after
the floor: the issue's ratios, kvplane's against the fastest peer's, come from one run
on the same requests.

Streamed chats. The requests above are short completions answered whole; the bake-off's
are chats with a 2,048-token system prompt, streamed a token a chunk. `--streamed N`
sends N such chats (streamed_chat_bodies) through each path in turn, to a simulator of
its own whose timing is scaled to STREAM_TIME_SCALE, so that its tokens still come
apart: the first chunk's latency one at a time, then throughput and CPU at
STREAM_CONCURRENCY in flight. A relay's cost is mostly per chunk, which the short
requests never show.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import json
import os
import platform
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx2
import msgspec
import numpy as np

from benchmarks.engine_sim import Answer, _load, _prompts, post_all
from benchmarks.live.processes import Child, Children, wait_ready
from benchmarks.live.routers import (
    peer_ready,
    peer_service_flags,
    peer_version,
    peers_python,
    peers_venv,
    sglang_router_argv,
)
from benchmarks.live.workloads import words
from kvplane.core.config import ControlPlaneSettings, Settings
from kvplane.core.keys import BlockKey
from kvplane.core.serving import free_port, freeze_startup_heap
from kvplane.core.tokenizer import load_tokenizer
from kvplane.core.types import BlocksStored, Tier, WorkerInfo
from router.assembly import RouterParts, assemble_router
from router.check import TOKEN_VARIABLE, require_wiring
from router.index.base import LocationIndex
from router.index.memory import MemoryLocationIndex
from router.lifecycle import route_prompt
from router.lifecycle.bodies import Endpoint, ParsedRequest, body_for_engine, parse_body
from router.lifecycle.tokens import CHECKED_FIRST_USES
from router.tenants import ANONYMOUS_TENANT
from simulations.engine_sim.process import spawn_engine_sim
from simulations.processes import spawn_kvplane
from simulations.reporting import percentile

MODEL = "bench"
_ADMIN_TOKEN = "bench-router-admin"  # loopback only: the wiring check before measuring
BLOCK_SIZE = 16
WORKER = "worker-0"
PROMPTS = 8  # distinct prompts per length, sharing their first eighth
UNRELATED_CHAINS = 4  # per worker
UNRELATED_BLOCKS = 512
EVENT_BLOCKS = 64  # blocks per BlocksStored, as an engine step announces them
VOCAB = 512  # the default tokenizer's
LEASE_S = 3600.0
WARM_UP = 20
SIM_MODEL = "kvplane-tiny"  # the simulator's default model name
# Of the cache-aware peers, the least CPU a request in every bake-off (docs/benchmarks.md).
PEER_FAMILY = "sglang-router"
PEER_POLICY = "cache_aware"
PEER = f"{PEER_FAMILY} {PEER_POLICY}"
# Streamed chats shaped as the bake-off's shared-prompt workloads send them
# (benchmarks/live/workloads.py), to a simulator whose timing is scaled down: its steps
# still come apart, each token a chunk of its own, at a rate that keeps the run short.
STREAM_TIME_SCALE = 0.25
STREAM_SYSTEM_PROMPTS = 4
STREAM_SYSTEM_TOKENS = 2_048
STREAM_QUESTION_TOKENS = 128
STREAM_MAX_TOKENS = 16
STREAM_CONCURRENCY = 8
_TEXT = (
    "The cache remembers what the model has already read, so a request that starts the "
    "same way as an earlier one can skip the work of reading that part again. A router "
    "that knows which replica holds which prefix sends each request where most of it is "
    "already cached. Summarise the following document for an engineer who has five "
    "minutes to read it, then list the three questions it leaves open. "
)


@dataclass(frozen=True)
class DecisionFigures:
    prompt_tokens: int
    workers: int
    index: str
    entries: int
    decisions: int
    decision_p50_us: float
    decision_p99_us: float
    keys_p50_us: float
    lookup_p50_us: float
    lookup_cpu_us: float  # this process's CPU a lookup (mean): with Redis, the router's share
    # Redis's own time a lookup call through the decisions (INFO commandstats); None for
    # the memory index
    lookup_server_us: float | None
    tokenize_p50_us: float
    tokenize_repeat_p50_us: float  # the same prompt again: the proxy's token cache
    tokenize_shared_p50_us: float  # a chat whose messages but the last were seen before
    route_shared_p50_us: float  # that chat from its body to its request to the engine
    tokenize_shared_text_p50_us: float  # a completions prompt whose start was seen before


@dataclass(frozen=True)
class ProxyFigures:
    requests: int
    concurrency: int
    direct_latency_p50_ms: float
    proxied_latency_p50_ms: float
    added_latency_p50_ms: float
    direct_requests_per_s: float
    requests_per_s: float
    router_cpu_ms_per_request: float
    engine_cpu_ms_per_request: float
    # The floor: a bare pass-through on the router's server and client stack
    # (benchmarks/bare_proxy.py), measured the same way.
    bare_added_latency_p50_ms: float
    bare_requests_per_s: float
    bare_cpu_ms_per_request: float
    errors: int
    oversized: OversizedFigures | None = None
    peer: PeerFigures | None = None  # the same requests through the fastest peer


@dataclass(frozen=True)
class PeerFigures:
    """The proxy's figures for a peer router in front of the same simulator, measured
    the same way in the same run (its CPU: its process and every descendant)."""

    name: str
    version: str
    added_latency_p50_ms: float
    requests_per_s: float
    cpu_ms_per_request: float


@dataclass(frozen=True)
class StreamedPath:
    """One way to the engine for the streamed chats: `direct`, `kvplane`, `bare` (the
    floor) or a peer's name."""

    name: str
    first_chunk_p50_ms: float  # one request at a time, from the request sent
    answer_p50_ms: float  # the same requests, to the answer's end
    requests_per_s: float  # `concurrency` at a time
    # None: direct (the engine's own is not the path's); kvplane's: its router and agent
    cpu_ms_per_request: float | None


@dataclass(frozen=True)
class StreamedFigures:
    """Streamed chats as the bake-off's shared-prompt workloads send them (see
    measure_streamed), through each path in turn."""

    requests: int
    concurrency: int
    sequential: int
    events_per_answer: float  # server-sent events in an answer: the chunks relayed
    paths: list[StreamedPath]
    errors: int


@dataclass(frozen=True)
class OversizedFigures:
    """Prompts far over the engine's max_model_len, each sent alone: what the router
    spends before it refuses one."""

    requests: int
    prompt_megabytes: float
    statuses: list[int]  # the router's answers (400: refused by the router's cap)
    router_cpu_ms_per_request: float
    seconds_per_request: float


# -- the decision path -------------------------------------------------------------


def bench_prompts(prompt_tokens: int, seed: int) -> list[array.array[int]]:
    """PROMPTS token-id prompts of `prompt_tokens`, sharing their first eighth; arrays
    of uint32, as the proxy's tokenisation leaves them."""
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(prompt_tokens // 8)]
    return [
        array.array(
            "I", shared + [rng.randrange(VOCAB) for _ in range(prompt_tokens - len(shared))]
        )
        for _ in range(PROMPTS)
    ]


def _runs(
    keys: Sequence[BlockKey], tier: Tier, first: int, parent: BlockKey | None
) -> list[BlocksStored]:
    """`keys` (a chain's blocks from position `first`) as engine-sized stored runs."""
    runs = []
    for start in range(0, len(keys), EVENT_BLOCKS):
        runs.append(
            BlocksStored(
                keys=list(keys[start : start + EVENT_BLOCKS]),
                tier=tier,
                first_position=first + start,
                parent_key=keys[start - 1] if start else parent,
            )
        )
    return runs


def worker_holdings(
    prompt_keys: list[list[BlockKey]], workers: int, seed: int, *, host_tier: bool = False
) -> Iterator[tuple[WorkerInfo, list[BlocksStored]]]:
    """Each worker's registration and what it stores (see the module docstring)."""
    rng = random.Random(seed + 1)
    blocks = len(prompt_keys[0])
    depths = [max(1, blocks * (i + 1) // workers) for i in range(workers)]
    rng.shuffle(depths)
    for worker in range(workers):
        info = WorkerInfo(f"worker-{worker}", 1, f"http://w{worker}:8000", MODEL, BLOCK_SIZE)
        held = prompt_keys[worker % PROMPTS][: depths[worker]]
        if host_tier and worker % 4 == 3 and len(held) > 1:  # the back half offloaded
            half = len(held) // 2
            events = _runs(held[:half], Tier.DEVICE, 0, None)
            events += _runs(held[half:], Tier.HOST, half, held[half - 1])
        else:
            events = _runs(held, Tier.DEVICE, 0, None)
        for _ in range(UNRELATED_CHAINS):
            chain = [BlockKey(rng.getrandbits(64)) for _ in range(UNRELATED_BLOCKS)]
            events += _runs(chain, Tier.DEVICE, 0, None)
        yield info, events


def _router(backend: LocationIndex) -> RouterParts:
    """The router's parts over `backend`, assembled as `kvplane router` assembles them
    (its index instrumented), with default settings and a seeded tie-break."""
    settings = Settings(control_plane=ControlPlaneSettings(block_size=BLOCK_SIZE))
    return assemble_router(settings, backend, rng=np.random.default_rng(0))


async def _timed_us(call: Callable[[], Awaitable[object]], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter_ns()
        await call()
        samples.append((time.perf_counter_ns() - started) / 1000)
    return samples


@dataclass(frozen=True)
class DecisionCase:
    prompt_tokens: int
    workers: int
    decisions: int
    tokenize: TokenizeFigures  # measured once per prompt length, reported in each row
    host_tier: bool = False
    seed: int = 1


ServerTime = Callable[[], Awaitable[tuple[int, int]]]  # (script calls, their µs) so far


async def measure_decisions(
    index: LocationIndex, index_name: str, case: DecisionCase, server_time: ServerTime | None = None
) -> DecisionFigures:
    """Fill `index` with the case's pool, then time the router's decisions over it
    (`server_time`: the Redis server's, for a Redis index)."""
    async with contextlib.aclosing(_router(index)) as router:
        planner, pool = router.planner, router.pool
        prompts = bench_prompts(case.prompt_tokens, case.seed)
        prompt_keys = [planner.keys(MODEL, "", tokens) for tokens in prompts]
        holdings = worker_holdings(prompt_keys, case.workers, case.seed, host_tier=case.host_tier)
        for info, events in holdings:
            await index.register(info, LEASE_S)
            await index.apply(info.worker_id, info.incarnation, events)
        await pool.refresh()
        entries = (await index.stats()).entries
        # As the router does once started: what set-up built stays out of the collector's
        # reach, so its full collections cost what a serving router's do.
        freeze_startup_heap()
        turn = 0

        async def decide() -> None:
            nonlocal turn
            decision = await planner.decide(
                model=MODEL, tenant=ANONYMOUS_TENANT, cache_scope="", tokens=prompts[turn % PROMPTS]
            )
            turn += 1
            if not decision.index_answered or len(decision.ranked) < case.workers:
                raise RuntimeError(f"a decision without the index or some workers: {decision}")
            planner.routed(decision, decision.ranked[0].worker_id)  # as the proxy does

        async def keys() -> None:
            planner.keys(MODEL, "", prompts[0])

        async def lookup() -> None:
            await index.lookup(prompt_keys[0])

        await _timed_us(decide, WARM_UP)
        calls_before, server_us_before = await server_time() if server_time else (0, 0)
        decide_us = await _timed_us(decide, case.decisions)
        lookup_server_us = None
        if server_time:
            calls, server_us = await server_time()
            lookup_server_us = round((server_us - server_us_before) / (calls - calls_before), 1)
        keys_us = await _timed_us(keys, max(10, case.decisions // 4))
        lookups = max(10, case.decisions // 4)
        cpu_before = time.process_time()
        lookup_us = await _timed_us(lookup, lookups)
        lookup_cpu_us = (time.process_time() - cpu_before) / lookups * 1e6
        return DecisionFigures(
            prompt_tokens=case.prompt_tokens,
            workers=case.workers,
            index=index_name,
            entries=entries,
            decisions=case.decisions,
            decision_p50_us=round(statistics.median(decide_us), 1),
            decision_p99_us=round(percentile(decide_us, 0.99), 1),
            keys_p50_us=round(statistics.median(keys_us), 1),
            lookup_p50_us=round(statistics.median(lookup_us), 1),
            lookup_cpu_us=round(lookup_cpu_us, 1),
            lookup_server_us=lookup_server_us,
            tokenize_p50_us=round(case.tokenize.fresh_us, 1),
            tokenize_repeat_p50_us=round(case.tokenize.repeated_us, 1),
            tokenize_shared_p50_us=round(case.tokenize.shared_prefix_us, 1),
            route_shared_p50_us=round(case.tokenize.shared_route_us, 1),
            tokenize_shared_text_p50_us=round(case.tokenize.shared_text_us, 1),
        )


def text_prompt(prompt_tokens: int) -> str:
    """English text that the default tokenizer encodes (BOS included) as about
    `prompt_tokens` tokens."""
    tokenizer = load_tokenizer()
    per_copy = len(tokenizer.completion_tokens(_TEXT)) - 1
    tokens = tokenizer.completion_tokens(_TEXT * (prompt_tokens // per_copy + 2))
    return tokenizer.decode(tokens[1:prompt_tokens])


@dataclass(frozen=True)
class TokenizeFigures:
    """p50s of tokenising a prompt as the proxy does, in µs."""

    fresh_us: float  # a completions prompt not seen before
    repeated_us: float  # the same prompt again: the cache of identical prompts
    shared_prefix_us: float  # a chat whose messages but the last (1/16) were seen before
    # That chat routed: body parsed, tokenised, keyed, looked up, scored, its prefix
    # predicted where it goes, its body for the engine made (the router's work from a
    # body received to a request sent).
    shared_route_us: float
    # A completions prompt of one text whose first 15/16 was seen before (a document, a
    # long instruction): its start is reused where the tokenizer allows cuts between
    # words (kvplane.core.tokenizer_pieces).
    shared_text_us: float


def marked(text: str, marker: str) -> str:
    """`text` with `marker` every 256 characters: none of it is a piece seen before, where
    the cuts between words (every 512 characters or more) would find the same text again
    behind a marker at its start only."""
    return "".join(f" {marker}{text[at : at + 256]}" for at in range(0, len(text), 256))


def measure_tokenize_us(prompt_tokens: int) -> TokenizeFigures:
    return asyncio.run(_measure_tokenize_us(text_prompt(prompt_tokens), prompt_tokens))


async def _measure_tokenize_us(text: str, prompt_tokens: int) -> TokenizeFigures:
    index = MemoryLocationIndex()
    async with contextlib.aclosing(_router(index)) as router:
        planner, pool = router.planner, router.pool
        prompt_tokens_of = router.flow.prompt_tokens
        repeats = max(10, 200_000 // prompt_tokens)
        history, question = text[: len(text) * 15 // 16], text[len(text) * 15 // 16 :]

        def request_for(prompt: str) -> ParsedRequest:
            raw = msgspec.json.encode({"model": MODEL, "prompt": prompt})
            return parse_body(raw, Endpoint.COMPLETIONS)

        def chat_body(marker: str) -> bytes:
            messages = [
                {"role": "system", "content": history},
                {"role": "user", "content": marked(question, marker)},
            ]
            return msgspec.json.encode({"model": MODEL, "messages": messages})

        def chat(marker: str) -> ParsedRequest:
            return parse_body(chat_body(marker), Endpoint.CHAT)

        whole_request = request_for(text)

        async def fresh() -> None:
            # A scope of its own each time: no piece of it was seen before, where the cuts
            # between words would otherwise find the earlier prompts' start.
            await prompt_tokens_of.of(whole_request, f"fresh {time.perf_counter_ns()}")

        async def repeated() -> None:
            await prompt_tokens_of.of(whole_request, "")

        async def shared_prefix() -> None:
            await prompt_tokens_of.of(chat(str(time.perf_counter_ns())), "")

        async def shared_text() -> None:
            prompt = history + marked(question, str(time.perf_counter_ns()))
            await prompt_tokens_of.of(request_for(prompt), "")

        async def shared_route() -> None:
            raw = chat_body(str(time.perf_counter_ns()))  # as received: the clock starts here
            started = time.perf_counter_ns()
            parsed = parse_body(raw, Endpoint.CHAT)
            start = await prompt_tokens_of.start(parsed, "", defer_rest=True)
            decision, start = await route_prompt(planner, parsed, ANONYMOUS_TENANT, "", start, True)
            worker = decision.ranked[0].worker_id
            planner.routed(decision, worker)  # before the send, as the proxy
            body_for_engine(raw, parsed, None)
            route_us.append((time.perf_counter_ns() - started) / 1000)
            if start is not None and start.rest is not None:  # after the answer, as the proxy
                planner.routed_rest(decision, worker, start.rest())
            if not decision.index_answered or decision.matched(WORKER).get(Tier.DEVICE, 0) < (
                len(decision.keys) * 7 // 8
            ):
                raise RuntimeError("the shared prefix was not found where it was stored")

        # One worker holds the conversation so far, as its engine would after the last turn.
        await index.register(
            WorkerInfo(WORKER, 1, "http://127.0.0.1:1", MODEL, BLOCK_SIZE), LEASE_S
        )
        held = planner.keys(MODEL, "", await prompt_tokens_of.of(chat(""), "") or [])
        await index.apply(WORKER, 1, _runs(held, Tier.DEVICE, 0, None))
        await pool.refresh()
        await _timed_us(fresh, 3)  # warm-up
        await _timed_us(repeated, 3)
        # Past the first uses, which are compared with whole tokenisation: the steady state.
        await _timed_us(shared_prefix, CHECKED_FIRST_USES)
        await _timed_us(shared_text, CHECKED_FIRST_USES)
        route_us: list[float] = []
        await _timed_us(shared_route, 3)
        route_us.clear()
        fresh_us = await _timed_us(fresh, repeats)
        repeated_us = await _timed_us(repeated, repeats)
        shared_us = await _timed_us(shared_prefix, repeats)
        shared_text_us = await _timed_us(shared_text, repeats)
        await _timed_us(shared_route, repeats)  # timed inside, from the body received
        figures = TokenizeFigures(
            statistics.median(fresh_us),
            statistics.median(repeated_us),
            statistics.median(shared_us),
            statistics.median(route_us),
            statistics.median(shared_text_us),
        )
        await index.close()
        return figures


def _decisions_for(prompt_tokens: int, workers: int, decisions: int) -> int:
    """Fewer decisions where each costs more (the 32k-token, 256-worker case)."""
    weight = prompt_tokens * workers / (8192 * 64)
    return max(20, int(decisions / max(1.0, weight**0.5)))


async def _measure_memory(case: DecisionCase) -> DecisionFigures:
    index = MemoryLocationIndex()
    try:
        return await measure_decisions(index, "memory", case)
    finally:
        await index.close()


async def _measure_redis(
    url: str, case: DecisionCase, backend: str, groups: int
) -> DecisionFigures:
    """`backend`: "redis", or "redis-directory" (the layout whose groups keep one), in
    `groups` groups."""
    import redis.asyncio as aioredis

    from router.index.redis import RedisLocationIndex

    prefix = f"kvpbench-{uuid.uuid4().hex[:8]}"
    index = RedisLocationIndex.from_url(
        url,
        cluster=False,
        prefix=prefix,
        groups=groups,
        directory=backend == "redis-directory",
        max_entries=None,
    )
    admin = aioredis.Redis.from_url(url)

    async def server_time() -> tuple[int, int]:
        # Only the decisions' lookups run scripts meanwhile.
        stats = (await admin.info("commandstats")).get("cmdstat_evalsha", {})
        return int(stats.get("calls", 0)), int(stats.get("usec", 0))

    try:
        return await measure_decisions(index, backend, case, server_time)
    finally:
        for worker in range(case.workers):
            await index.drop_worker(f"worker-{worker}")
        async for key in admin.scan_iter(match=f"{prefix}:*", count=1000):
            await admin.delete(key)
        await index.close()
        await admin.aclose()


def measure_all_decisions(
    *,
    backends: Sequence[str],
    redis_url: str,
    prompt_lengths: Sequence[int],
    fleet_sizes: Sequence[int],
    decisions: int,
    host_tier: bool,
    groups: int,
    seed: int,
) -> list[DecisionFigures]:
    rows = []
    for prompt_tokens in prompt_lengths:
        tokenize = measure_tokenize_us(prompt_tokens)
        for workers in fleet_sizes:
            count = _decisions_for(prompt_tokens, workers, decisions)
            case = DecisionCase(prompt_tokens, workers, count, tokenize, host_tier, seed)
            for backend in backends:
                if backend == "memory":
                    rows.append(asyncio.run(_measure_memory(case)))
                else:
                    rows.append(asyncio.run(_measure_redis(redis_url, case, backend, groups)))
    return rows


# -- the proxy ---------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after the command name
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_routable(router_url: str, timeout_s: float = 60.0) -> None:
    """Until the router answers a completion (the agent registered the simulator)."""
    deadline = time.monotonic() + timeout_s
    body = {"model": SIM_MODEL, "prompt": "hello", "max_tokens": 1}
    with httpx2.Client(timeout=5.0) as client:
        while True:
            try:
                if client.post(router_url + "/v1/completions", json=body).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the router never routed a request to the simulator")
            time.sleep(0.1)


def measure_oversized(router_url: str, router_pid: int, count: int) -> OversizedFigures:
    """`count` completions of a 10 MB prompt, one at a time, through the router."""
    prompt = ("Blocks of sixteen tokens are keyed by every token before them. " * 160_000)[
        : 10 * 1024 * 1024
    ]
    body = json.dumps({"model": SIM_MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    statuses = []
    cpu_before, started = _cpu_seconds(router_pid), time.perf_counter()
    with httpx2.Client(timeout=600.0) as client:
        for _ in range(count):
            answer = client.post(
                router_url + "/v1/completions",
                content=body,
                headers={"content-type": "application/json"},
            )
            statuses.append(answer.status_code)
    seconds = time.perf_counter() - started
    cpu = _cpu_seconds(router_pid) - cpu_before
    return OversizedFigures(
        requests=count,
        prompt_megabytes=round(len(body) / 1e6, 1),
        statuses=statuses,
        router_cpu_ms_per_request=round(cpu / count * 1000, 1),
        seconds_per_request=round(seconds / count, 3),
    )


@dataclass(frozen=True)
class _Peer:
    name: str
    version: str
    url: str
    child: Child


@dataclass(frozen=True)
class _ProxyPaths:
    """The processes of a proxy measurement: the simulator, and the ways to it."""

    engine_url: str
    engine_pid: int
    router_url: str
    router_pid: int
    agent_pid: int
    bare_url: str
    bare_pid: int
    peer: _Peer | None


@contextmanager
def _proxy_paths(sim_flags: Sequence[str], with_peer: bool) -> Iterator[_ProxyPaths]:
    """An engine simulator started with `sim_flags`, a kvplane router and its agent, the
    bare pass-through and (`with_peer`) the peer, all in front of it; gone on exit."""
    events, replay = free_port(), free_port()
    grpc_port, http_port = free_port(), free_port()
    router_url = f"http://127.0.0.1:{http_port}"
    # The engine binds (`*`); the agent connects. Given 127.0.0.1 the engine would connect
    # too, and the router would be measured blind (docs/troubleshooting.md).
    kv_config = (
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{events}", '
        f'"replay_endpoint": "tcp://*:{replay}"}}'
    )
    quiet = ("--log-level", "WARNING")
    with ExitStack() as stack:
        sim = stack.enter_context(
            spawn_engine_sim(*sim_flags, "--kv-events-config", kv_config, *quiet)
        )
        router = stack.enter_context(
            spawn_kvplane(
                ["router", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                 "--index", "memory", *quiet],
                router_url + "/readyz",
                env={TOKEN_VARIABLE: _ADMIN_TOKEN},
            )
        )  # fmt: skip
        agent = stack.enter_context(
            spawn_kvplane(
                ["agent", "--worker-id", "bench-worker", "--engine-url", sim.base_url,
                 "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                 "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
                 "--control-plane-address", f"127.0.0.1:{grpc_port}", *quiet],
                None,
            )
        )  # fmt: skip
        bare_url = f"http://127.0.0.1:{free_port()}"
        bare = stack.enter_context(
            spawn_kvplane(
                ["--engine-url", sim.base_url, "--port", bare_url.rsplit(":", 1)[1]],
                bare_url + "/healthz",
                module="benchmarks.bare_proxy",
            )
        )
        peer = stack.enter_context(_spawn_peer(sim.base_url)) if with_peer else None
        _wait_routable(router_url)
        require_wiring(router_url, _ADMIN_TOKEN)  # BlindFleet: no figures from a blind router
        yield _ProxyPaths(
            sim.base_url,
            sim.process.pid,
            router_url,
            router.pid,
            agent.pid,
            bare_url,
            bare.pid,
            peer,
        )


@contextmanager
def _spawn_peer(engine_url: str) -> Iterator[_Peer]:
    """The peer router in front of the simulator, ready once it counts it healthy."""
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-peer-") as logs:
        children = Children(Path(logs))
        try:
            port = free_port()
            argv = [
                *sglang_router_argv(PEER_POLICY, port, [engine_url]),
                *peer_service_flags(free_port()),
            ]
            child = children.launch(PEER_FAMILY, argv)
            url = f"http://127.0.0.1:{port}"
            wait_ready([(child, url + "/readiness")], ready=peer_ready(1))
            yield _Peer(PEER, peer_version(PEER_FAMILY), url, child)
        finally:
            children.stop_all()


def measure_proxy(
    requests: int,
    concurrency: int,
    sequential: int,
    seed: int,
    oversized: int = 0,
    with_peer: bool = False,
) -> ProxyFigures:
    with _proxy_paths(("--time-scale", "0"), with_peer) as paths:
        figures = asyncio.run(
            _proxy_runs(
                paths,
                requests=requests,
                concurrency=concurrency,
                sequential=sequential,
                seed=seed,
            )
        )
        if oversized > 0:
            figures = replace(
                figures, oversized=measure_oversized(paths.router_url, paths.router_pid, oversized)
            )
        return figures
    raise AssertionError("unreachable")  # for mypy: ExitStack may swallow exceptions


async def _proxy_runs(
    paths: _ProxyPaths,
    *,
    requests: int,
    concurrency: int,
    sequential: int,
    seed: int,
) -> ProxyFigures:
    prompts = _prompts(requests, seed)
    errors = 0

    async def run(url: str, count: int, in_flight: int) -> tuple[float, list[float]]:
        nonlocal errors
        seconds, latencies, failed = await _load(
            url, prompts[:count], in_flight, 1, model=SIM_MODEL
        )
        errors += failed
        return seconds, latencies

    peer_url = None if paths.peer is None else paths.peer.url
    urls = (paths.engine_url, paths.router_url, paths.bare_url, peer_url)
    for url in urls:  # warm connections, caches, code paths
        if url is not None:
            await run(url, min(requests, 200), concurrency)
    _, direct_latencies = await run(paths.engine_url, sequential, 1)
    _, proxied_latencies = await run(paths.router_url, sequential, 1)
    _, bare_latencies = await run(paths.bare_url, sequential, 1)
    direct_s, _ = await run(paths.engine_url, requests, concurrency)
    router_cpu, engine_cpu = _cpu_seconds(paths.router_pid), _cpu_seconds(paths.engine_pid)
    proxied_s, _ = await run(paths.router_url, requests, concurrency)
    router_cpu = _cpu_seconds(paths.router_pid) - router_cpu
    engine_cpu = _cpu_seconds(paths.engine_pid) - engine_cpu
    bare_cpu = _cpu_seconds(paths.bare_pid)
    bare_s, _ = await run(paths.bare_url, requests, concurrency)
    bare_cpu = _cpu_seconds(paths.bare_pid) - bare_cpu
    direct_ms = statistics.median(direct_latencies) * 1000
    proxied_ms = statistics.median(proxied_latencies) * 1000
    bare_ms = statistics.median(bare_latencies) * 1000
    peer = None
    if paths.peer is not None:
        _, peer_latencies = await run(paths.peer.url, sequential, 1)
        peer_cpu = paths.peer.child.cpu_seconds()
        peer_s, _ = await run(paths.peer.url, requests, concurrency)
        peer_cpu = paths.peer.child.cpu_seconds() - peer_cpu
        peer = PeerFigures(
            name=paths.peer.name,
            version=paths.peer.version,
            added_latency_p50_ms=round(statistics.median(peer_latencies) * 1000 - direct_ms, 3),
            requests_per_s=round(requests / peer_s, 1),
            cpu_ms_per_request=round(peer_cpu / requests * 1000, 3),
        )
    return ProxyFigures(
        requests=requests,
        concurrency=concurrency,
        direct_latency_p50_ms=round(direct_ms, 3),
        proxied_latency_p50_ms=round(proxied_ms, 3),
        added_latency_p50_ms=round(proxied_ms - direct_ms, 3),
        direct_requests_per_s=round(requests / direct_s, 1),
        requests_per_s=round(requests / proxied_s, 1),
        router_cpu_ms_per_request=round(router_cpu / requests * 1000, 3),
        engine_cpu_ms_per_request=round(engine_cpu / requests * 1000, 3),
        bare_added_latency_p50_ms=round(bare_ms - direct_ms, 3),
        bare_requests_per_s=round(requests / bare_s, 1),
        bare_cpu_ms_per_request=round(bare_cpu / requests * 1000, 3),
        errors=errors,
        peer=peer,
    )


# -- streamed chats ------------------------------------------------------------------


def streamed_chat_bodies(path: str, count: int) -> list[bytes]:
    """`count` streamed chats as the bake-off's shared-prompt workloads send them: one of
    STREAM_SYSTEM_PROMPTS system prompts, then a question of their own (its text keyed on
    `path`, so that no path is sent a prompt another path made the engine cache, nor one
    the router tokenised before)."""
    systems = [
        words(f"bench-router-system-{number}", STREAM_SYSTEM_TOKENS)
        for number in range(STREAM_SYSTEM_PROMPTS)
    ]
    return [
        msgspec.json.encode(
            {
                "model": SIM_MODEL,
                "messages": [
                    {"role": "system", "content": systems[number % STREAM_SYSTEM_PROMPTS]},
                    {
                        "role": "user",
                        "content": words(f"bench-router-{path}-{number}", STREAM_QUESTION_TOKENS),
                    },
                ],
                "max_tokens": STREAM_MAX_TOKENS,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        for number in range(count)
    ]


def measure_streamed(
    requests: int, concurrency: int, sequential: int, with_peer: bool = False
) -> StreamedFigures:
    """Streamed chats through each path to a simulator that paces its answers
    (STREAM_TIME_SCALE of its default timing: each token a chunk of its own, as an
    engine sends them): the first chunk's latency one request at a time, then
    `concurrency` at a time for throughput and CPU. Each path is sent its own questions
    after the same system prompts (streamed_chat_bodies), each warmed first."""
    with _proxy_paths(("--time-scale", str(STREAM_TIME_SCALE)), with_peer) as paths:
        return asyncio.run(_streamed_runs(paths, requests, concurrency, sequential))
    raise AssertionError("unreachable")  # for mypy: ExitStack may swallow exceptions


async def _streamed_runs(
    paths: _ProxyPaths, requests: int, concurrency: int, sequential: int
) -> StreamedFigures:
    def kvplane_cpu() -> float:  # the router and its agent, as the bake-off charges them
        return _cpu_seconds(paths.router_pid) + _cpu_seconds(paths.agent_pid)

    ways: list[tuple[str, str, Callable[[], float] | None]] = [
        ("direct", paths.engine_url, None),
        ("kvplane", paths.router_url, kvplane_cpu),
        ("bare", paths.bare_url, functools.partial(_cpu_seconds, paths.bare_pid)),
    ]
    if paths.peer is not None:
        ways.append((paths.peer.name, paths.peer.url, paths.peer.child.cpu_seconds))
    measured = []
    errors = events = answers = 0
    for name, url, cpu_seconds in ways:
        warm = streamed_chat_bodies(f"{name}-warm", min(requests, 50))
        await _stream_load(url, warm, concurrency)
        one_at_a_time = await _stream_load(url, streamed_chat_bodies(f"{name}-one", sequential), 1)
        cpu_before = cpu_seconds() if cpu_seconds else 0.0
        loaded = await _stream_load(url, streamed_chat_bodies(name, requests), concurrency)
        cpu = cpu_seconds() - cpu_before if cpu_seconds else None
        errors += one_at_a_time.errors + loaded.errors
        events += loaded.events
        answers += requests
        measured.append(
            StreamedPath(
                name=name,
                first_chunk_p50_ms=round(statistics.median(one_at_a_time.first_chunks) * 1000, 3),
                answer_p50_ms=round(statistics.median(one_at_a_time.answers) * 1000, 3),
                requests_per_s=round(requests / loaded.seconds, 1),
                cpu_ms_per_request=None if cpu is None else round(cpu / requests * 1000, 3),
            )
        )
    return StreamedFigures(
        requests=requests,
        concurrency=concurrency,
        sequential=sequential,
        events_per_answer=round(events / max(1, answers), 1),
        paths=measured,
        errors=errors,
    )


@dataclass(slots=True)
class _StreamLoad:
    seconds: float = 0.0
    first_chunks: list[float] = field(default_factory=list)
    answers: list[float] = field(default_factory=list)
    events: int = 0  # server-sent events over every answer
    errors: int = 0


async def _stream_load(base_url: str, bodies: Sequence[bytes], concurrency: int) -> _StreamLoad:
    """POST each body to /v1/chat/completions over `concurrency` keep-alive connections
    (h11, as _load does) and time each answer's first chunk and its end."""
    load = _StreamLoad()

    def answered(sent_at: float, answer: Answer) -> None:
        load.answers.append(time.perf_counter() - sent_at)
        load.first_chunks.append(answer.first_body_at - sent_at)
        load.events += answer.events
        load.errors += answer.status != 200

    load.seconds = await post_all(base_url, "/v1/chat/completions", bodies, concurrency, answered)
    return load


# -- the report --------------------------------------------------------------------


def _print_table(decisions: list[DecisionFigures], proxy: ProxyFigures | None) -> None:
    if decisions:
        print(
            f"{'prompt':>7} {'workers':>7} {'index':<6} {'entries':>9} {'decide p50':>11} "
            f"{'decide p99':>11} {'keys p50':>10} {'lookup p50':>11} {'lookup CPU':>11} "
            f"{'Redis/lookup':>13} "
            f"{'tokenize p50':>13} "
            f"{'repeated':>9} {'shared':>9} {'route shared':>13} {'text shared':>12}"
        )
        for row in decisions:
            print(
                f"{row.prompt_tokens:>7,} {row.workers:>7} {row.index:<6} {row.entries:>9,} "
                f"{row.decision_p50_us:>9.0f}µs {row.decision_p99_us:>9.0f}µs "
                f"{row.keys_p50_us:>8.0f}µs {row.lookup_p50_us:>9.0f}µs "
                f"{row.lookup_cpu_us:>9.0f}µs "
                f"{_microseconds(row.lookup_server_us):>13} "
                f"{row.tokenize_p50_us:>11.0f}µs {row.tokenize_repeat_p50_us:>7.0f}µs "
                f"{row.tokenize_shared_p50_us:>7.0f}µs {row.route_shared_p50_us:>11.0f}µs "
                f"{row.tokenize_shared_text_p50_us:>10.0f}µs"
            )
    if proxy is not None:
        print(
            f"proxy: p50 {proxy.proxied_latency_p50_ms:.2f} ms through the router, "
            f"{proxy.direct_latency_p50_ms:.2f} ms direct: "
            f"{proxy.added_latency_p50_ms:.2f} ms added (one at a time)"
        )
        print(
            f"proxy: {proxy.requests:,} requests, {proxy.concurrency} in flight: "
            f"{proxy.requests_per_s:,.0f} requests/s through the router, "
            f"{proxy.direct_requests_per_s:,.0f} direct; router CPU "
            f"{proxy.router_cpu_ms_per_request:.2f} ms/request (engine "
            f"{proxy.engine_cpu_ms_per_request:.2f}); {proxy.errors} errors"
        )
        print(
            f"proxy floor: a bare pass-through on the same server and client stack adds "
            f"{proxy.bare_added_latency_p50_ms:.2f} ms and serves "
            f"{proxy.bare_requests_per_s:,.0f} requests/s "
            f"({proxy.bare_requests_per_s / proxy.direct_requests_per_s:.2f} of direct) "
            f"with {proxy.bare_cpu_ms_per_request:.2f} ms of CPU a request; the router "
            f"{proxy.requests_per_s / proxy.direct_requests_per_s:.2f} of direct"
        )
        if proxy.peer is not None:
            peer = proxy.peer
            print(
                f"proxy peer: {peer.name} {peer.version} adds {peer.added_latency_p50_ms:.2f} ms "
                f"and serves {peer.requests_per_s:,.0f} requests/s "
                f"({peer.requests_per_s / proxy.direct_requests_per_s:.2f} of direct) with "
                f"{peer.cpu_ms_per_request:.2f} ms of CPU a request; kvplane / peer: added "
                f"latency {_ratio(proxy.added_latency_p50_ms, peer.added_latency_p50_ms)}, "
                f"CPU {_ratio(proxy.router_cpu_ms_per_request, peer.cpu_ms_per_request)}"
            )
        if proxy.oversized is not None:
            big = proxy.oversized
            print(
                f"oversized: {big.requests} prompts of {big.prompt_megabytes} MB, answered "
                f"{sorted(set(big.statuses))}: router CPU {big.router_cpu_ms_per_request:,.1f} "
                f"ms and {big.seconds_per_request:.3f} s each"
            )


def _print_streamed(streamed: StreamedFigures) -> None:
    print(
        f"streamed chats: {streamed.requests:,} a path, {streamed.concurrency} in flight "
        f"({streamed.sequential} one at a time), {streamed.events_per_answer:.1f} events an "
        f"answer, {streamed.errors} errors"
    )
    print(
        f"{'path':<28} {'first chunk p50':>15} {'added':>8} {'answer p50':>11} "
        f"{'requests/s':>11} {'CPU a request':>14}"
    )
    direct = streamed.paths[0]
    for path in streamed.paths:
        added = path.first_chunk_p50_ms - direct.first_chunk_p50_ms
        cpu = "" if path.cpu_ms_per_request is None else f"{path.cpu_ms_per_request:.2f} ms"
        print(
            f"{path.name:<28} {path.first_chunk_p50_ms:>12.2f} ms {added:>5.2f} ms "
            f"{path.answer_p50_ms:>8.2f} ms {path.requests_per_s:>11,.1f} {cpu:>14}"
        )


def _microseconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}µs"


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}x" if theirs > 0 else "n/a"


def run_router_benchmark(
    *,
    json_path: Path | None,
    backends: Sequence[str],
    redis_url: str,
    prompt_lengths: Sequence[int],
    fleet_sizes: Sequence[int],
    decisions: int,
    requests: int,
    concurrency: int,
    sequential: int,
    oversized: int = 0,
    groups: int,
    host_tier: bool = False,
    streamed: int = 0,
    peer: bool = True,
    seed: int = 1,
) -> int:
    unknown = set(backends) - {"memory", "redis", "redis-directory"}
    if unknown:
        raise ValueError(f"unknown index backends: {', '.join(sorted(unknown))}")
    rows = measure_all_decisions(
        backends=backends,
        redis_url=redis_url,
        prompt_lengths=prompt_lengths,
        fleet_sizes=fleet_sizes,
        decisions=decisions,
        host_tier=host_tier,
        groups=groups,
        seed=seed,
    )
    with_peer = peer and (requests > 0 or streamed > 0) and peers_python().exists()
    if peer and not with_peer and (requests > 0 or streamed > 0):
        print(f"no peer measured: its environment {peers_venv()}/ is missing (make peers-env)")
    proxy = (
        measure_proxy(requests, concurrency, sequential, seed, oversized, with_peer)
        if requests > 0
        else None
    )
    stream_figures = (
        measure_streamed(streamed, STREAM_CONCURRENCY, max(1, streamed // 4), with_peer)
        if streamed > 0
        else None
    )
    _print_table(rows, proxy)
    if stream_figures is not None:
        _print_streamed(stream_figures)
    if json_path is not None:
        report = {
            "machine": {
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
            },
            "host_tier": host_tier,
            "redis_groups": groups,
            "decisions": [asdict(row) for row in rows],
            "proxy": None if proxy is None else asdict(proxy),
            "streamed": None if stream_figures is None else asdict(stream_figures),
        }
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
    failed = (proxy is not None and proxy.errors > 0) or (
        stream_figures is not None and stream_figures.errors > 0
    )
    return 1 if failed else 0
