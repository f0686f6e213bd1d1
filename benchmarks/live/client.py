"""The bake-off's client: the official `openai` client, streaming, sending a workload's
conversations through a router (or straight to an engine, for the traffic that goes
around it) and timing each request.

Conversations start on the workload's schedule whatever the router does (open loop);
a conversation's next step waits for its parent's response and carries it, as a chat
client does. Time to first token is the time to the first chunk with content; the
inter-token latencies are the gaps between successive chunks with content after it
(`inter_token_gaps`: the engines stream a token a chunk); the end-to-end latency runs
from sending the request to the stream's end.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

from benchmarks.live.workloads import Conversation, Step, Workload

REQUEST_TIMEOUT_S = 60.0
Message = ChatCompletionMessageParam
SHED_REASON_HEADER = "x-kvplane-shed-reason"
SHED_UNLABELLED = "unlabelled"  # a 429 that gives no reason (a peer's, a rate limit's)


@dataclass(slots=True)
class Outcome:
    ok: bool
    ttft_s: float | None = None
    latency_s: float | None = None  # end to end: sent to the stream's end
    # The gaps between successive chunks with content (`inter_token_gaps`), in order.
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    direct: bool = False  # sent to an engine, around the router
    error: str | None = None
    turn: int = 0  # 0: a conversation's first request; then its turn, or its depth in a tree
    sent_at: float = 0.0  # the wall clock's (time.time()), as the processes' logs stamp lines
    tenant: str | None = None
    # Why the router shed it (a 429: kvplane's `x-kvplane-shed-reason`, or
    # SHED_UNLABELLED); None: not shed. A shed request is not a failure.
    shed_reason: str | None = None

    @property
    def shed(self) -> bool:
        return self.shed_reason is not None


class Traffic:
    """Where the client sends requests: the router's replicas in turn, and a share of
    conversations straight to the engines."""

    def __init__(
        self,
        router_urls: Sequence[str],
        engine_urls: Sequence[str] = (),
        direct_share: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.router_urls = list(router_urls)
        self.engine_urls = list(engine_urls)
        self.direct_share = direct_share
        self._sent = 0
        self._rng = random.Random(seed)

    def route_conversation(self) -> str | None:
        """An engine URL if this conversation goes around the router, else None."""
        if self.engine_urls and self._rng.random() < self.direct_share:
            return self._rng.choice(self.engine_urls) + "/v1"
        return None

    def next_router_url(self) -> str:
        url = self.router_urls[self._sent % len(self.router_urls)]
        self._sent += 1
        return url


class Clients:
    """One `AsyncOpenAI` per (base URL, API key), made on first use."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str], openai.AsyncOpenAI] = {}

    def get(self, base_url: str, key: str) -> openai.AsyncOpenAI:
        client = self._clients.get((base_url, key))
        if client is None:
            client = openai.AsyncOpenAI(
                base_url=base_url, api_key=key, max_retries=0, timeout=REQUEST_TIMEOUT_S
            )
            self._clients[(base_url, key)] = client
        return client

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self._clients.values()))


async def run_workload(
    workload: Workload,
    traffic: Traffic,
    *,
    model: str,
    api_key: Callable[[str | None], str],
    deadline_s: float,
    during: Sequence[tuple[float, Callable[[], Awaitable[None]]]] = (),
) -> list[Outcome]:
    """Send every conversation; requests still open `deadline_s` after the start are
    cancelled and count as failed. `during`: (seconds after the start, action) pairs,
    e.g. restarting an engine mid-run."""
    outcomes: list[Outcome] = []
    clients = Clients()
    started = time.perf_counter()

    async def conversation(item: Conversation) -> None:
        await asyncio.sleep(max(0.0, item.start_s - (time.perf_counter() - started)))
        direct = traffic.route_conversation()
        messages: list[Message] = []
        if item.system is not None:
            messages.append({"role": "system", "content": item.system})
        await step(item, item.root, messages, direct, 0)

    async def step(
        item: Conversation, current: Step, history: list[Message], direct: str | None, turn: int
    ) -> None:
        question: Message = {"role": "user", "content": current.text}
        messages = [*history, question]
        url = direct or traffic.next_router_url()
        client = clients.get(url, api_key(item.tenant))
        outcome, text = await _send(client, model, messages, current.max_tokens, item.tenant)
        outcome.direct = direct is not None
        outcome.turn = turn
        outcome.tenant = item.tenant
        outcomes.append(outcome)
        if not outcome.ok:
            return  # the conversation cannot go on without the response
        answer: Message = {"role": "assistant", "content": text}
        follow = [*messages, answer]
        await asyncio.gather(
            *(
                _after(child.after_s, step(item, child, follow, direct, turn + 1))
                for child in current.children
            )
        )

    async def actions() -> None:
        for at_s, action in sorted(during, key=lambda pair: pair[0]):
            await asyncio.sleep(max(0.0, at_s - (time.perf_counter() - started)))
            await action()

    tasks = [asyncio.ensure_future(conversation(item)) for item in workload.conversations]
    side = asyncio.ensure_future(actions())
    try:
        _done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # A turn after a failed one is never sent; a turn still open at the deadline is
        # cancelled: both count as failed.
        outcomes += unfinished(workload, outcomes)
        if side.done() and not side.cancelled() and side.exception() is not None:
            # A situation that did not happen (an engine that did not restart) would
            # leave figures labelled with it: the cell fails instead.
            raise RuntimeError(f"the cell's fault action failed: {side.exception()}")
    finally:
        side.cancel()
        await asyncio.gather(side, return_exceptions=True)
        await clients.close()
    return outcomes


def unfinished(workload: Workload, outcomes: Sequence[Outcome]) -> list[Outcome]:
    """A failed outcome for each request of `workload` that has none (never sent, or
    still open at the deadline), each with its conversation's tenant: an overloaded
    router's unanswered requests are its tenants'."""
    expected = Counter[str | None]()
    for conversation in workload.conversations:
        expected[conversation.tenant] += conversation.root.count()
    recorded = Counter(outcome.tenant for outcome in outcomes)
    return [
        Outcome(ok=False, error="not sent or not finished", tenant=tenant)
        for tenant, count in expected.items()
        for _ in range(count - recorded[tenant])
    ]


async def run_closed_loop(
    requests: Sequence[Conversation],
    traffic: Traffic,
    *,
    model: str,
    api_key: Callable[[str | None], str],
    concurrency: int,
    duration_s: float,
) -> list[Outcome]:
    """`concurrency` clients, each sending its next request as soon as its last one is
    answered, taking single-step conversations from `requests` in turn (round and round)
    until `duration_s` has passed; the requests still open then are cancelled and left
    out."""
    outcomes: list[Outcome] = []
    clients = Clients()
    taken = itertools.cycle(requests)
    ends = time.perf_counter() + duration_s

    async def sender() -> None:
        while time.perf_counter() < ends:
            item = next(taken)
            messages: list[Message] = [{"role": "user", "content": item.root.text}]
            if item.system is not None:
                messages.insert(0, {"role": "system", "content": item.system})
            client = clients.get(traffic.next_router_url(), api_key(item.tenant))
            outcome, _ = await _send(client, model, messages, item.root.max_tokens, item.tenant)
            outcome.tenant = item.tenant
            outcomes.append(outcome)

    senders = [asyncio.ensure_future(sender()) for _ in range(concurrency)]
    try:
        await asyncio.wait(senders, timeout=duration_s)
    finally:
        for task in senders:
            task.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
        await clients.close()
    return outcomes


async def _after(delay_s: float, work: Awaitable[None]) -> None:
    await asyncio.sleep(delay_s)
    await work


def inter_token_gaps(arrivals: Sequence[float]) -> list[float]:
    """The inter-token latencies of one streamed answer: the gaps between successive
    chunks with content, from the times they arrived (the first's is the TTFT's end);
    none for an answer of fewer than two such chunks."""
    return [later - earlier for earlier, later in itertools.pairwise(arrivals)]


async def _send(
    client: openai.AsyncOpenAI,
    model: str,
    messages: list[Message],
    max_tokens: int,
    tenant: str | None,
) -> tuple[Outcome, str]:
    extra: dict[str, Any] = {}
    if tenant is not None:
        # What a careful client of vLLM does to keep tenants apart in the engine's cache;
        # kvplane replaces it with the tenant's own salt.
        extra["cache_salt"] = f"salt-{tenant}"
    sent_at = time.time()
    sent = time.perf_counter()
    arrivals: list[float] = []  # of each chunk with content
    pieces: list[str] = []
    usage = None
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra or None,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.perf_counter())
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.RateLimitError as error:
        # Shed by the router: counted as such, never retried (the client's max_retries
        # is 0), and the time it waited kept (a tenant waiting is a tenant backlogged).
        reason = error.response.headers.get(SHED_REASON_HEADER, SHED_UNLABELLED)
        waited = time.perf_counter() - sent
        return Outcome(False, latency_s=waited, sent_at=sent_at, shed_reason=reason), ""
    except (TimeoutError, openai.APIError) as error:
        return Outcome(ok=False, error=type(error).__name__, sent_at=sent_at), ""
    ended = time.perf_counter()
    outcome = Outcome(
        ok=bool(arrivals),
        ttft_s=arrivals[0] - sent if arrivals else None,
        latency_s=ended - sent,
        itl_s=inter_token_gaps(arrivals),
        error=None if arrivals else "no content streamed",
        sent_at=sent_at,
    )
    if usage is not None:
        outcome.prompt_tokens = usage.prompt_tokens
        outcome.output_tokens = usage.completion_tokens
        details = usage.prompt_tokens_details
        outcome.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
    return outcome, "".join(pieces)
