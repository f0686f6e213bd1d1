"""Steady load from the official OpenAI client, with every request's outcome accounted.

Each client sends chat requests from one of the tenants, streamed or not, over prompts
that share prefixes within a tenant and, word for word, across tenants (so a leak
between tenants' caches would show as a hit). A client that cannot reach a router tries
the other, as a load balancer in front of the replicas would.

Outcomes:
- `ok`: answered in full by the first worker the first router chose;
- `retried`: answered in full after the router failed over to another worker
  (`x-kvplane-attempts` > 1) or the client moved to the other router;
- `failed`: a clear error the client can act on: an HTTP error with an OpenAI error
  body, an error event in the stream, or the connection breaking mid-answer (a router
  killed while it streamed);
- `lost`: anything else: no answer within the client's timeout, an answer cut short with
  no error, an error without a message. The promise is that this stays 0.
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import httpx2
import openai
from openai.types.chat import ChatCompletionMessageParam

from chaos.stack import MODEL, TENANT_KEYS

CLIENT_TIMEOUT_S = 20.0

# Shared word for word by every tenant: a hit across tenants would be a leak.
_COMMON = (
    "You are a careful assistant for an operations team. Answer briefly, cite the runbook "
    "section you relied on, and never invent a command that is not in the runbook. "
)
_TOPICS = ["disk pressure", "a failed deploy", "certificate expiry", "queue backlog"]


class Outcome(enum.StrEnum):
    OK = "ok"
    RETRIED = "retried"
    FAILED = "failed"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    tenant: str
    streamed: bool
    outcome: Outcome
    detail: str  # why it failed or was lost; never the request's or answer's text
    worker: str | None
    predicted_cached_tokens: int
    reported_cached_tokens: int | None
    started: float
    ended: float


def prompt(tenant: str, rng: random.Random) -> list[ChatCompletionMessageParam]:
    topic = rng.choice(_TOPICS)
    runbook = f"Runbook of {tenant} for {topic}: " + " ".join(
        f"step {n}: check {topic} on host group {n} and record what you saw." for n in range(6)
    )
    question = f"Ticket {rng.randrange(10_000)}: what do I do first?"
    return [
        {"role": "system", "content": _COMMON + runbook},
        {"role": "user", "content": question},
    ]


class LoadGenerator:
    """`concurrency` clients in a loop until stopped; `records` grows as requests end."""

    def __init__(
        self, router_urls: Sequence[str], concurrency: int = 4, seed: int = 0, max_tokens: int = 8
    ) -> None:
        self.router_urls = list(router_urls)
        self.concurrency = concurrency
        self.max_tokens = max_tokens
        self.records: list[RequestRecord] = []
        self._rng = random.Random(seed)
        self._clients = {
            (url, tenant): openai.AsyncOpenAI(
                base_url=url + "/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S
            )
            for url in self.router_urls
            for tenant, key in TENANT_KEYS.items()
        }
        self._tasks: list[asyncio.Task[None]] = []
        self._next_router = 0
        self._stopping = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client_loop()) for _ in range(self.concurrency)]

    async def stop(self) -> None:
        """Let the requests in flight finish (each has a deadline), then stop."""
        self._stopping = True
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._stopping = False

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    async def _client_loop(self) -> None:
        while not self._stopping:
            tenant = self._rng.choice(sorted(TENANT_KEYS))
            self.records.append(await self.send(tenant, streamed=self._rng.random() < 0.5))
            await asyncio.sleep(0.01)

    async def send(
        self,
        tenant: str,
        *,
        streamed: bool,
        max_tokens: int | None = None,
        router_index: int | None = None,
    ) -> RequestRecord:
        """One request, to the next router in turn (or the one given), moving to the other
        one only if the first could not be reached at all."""
        first = self._next_router if router_index is None else router_index
        self._next_router = (first + 1) % len(self.router_urls)
        messages = prompt(tenant, self._rng)
        started = time.monotonic()
        detail = ""
        for moved in range(len(self.router_urls)):
            url = self.router_urls[(first + moved) % len(self.router_urls)]
            client = self._clients[(url, tenant)]
            try:
                return await self._exchange(
                    client, tenant, messages, streamed, max_tokens or self.max_tokens, moved > 0
                )
            except openai.APITimeoutError:
                return self._record(tenant, streamed, Outcome.LOST, "no answer in time", started)
            except openai.APIConnectionError as error:
                detail = f"router unreachable ({type(error.__cause__).__name__})"
                continue  # nothing was answered: the other router may take it
        return self._record(tenant, streamed, Outcome.FAILED, detail, started)

    async def _exchange(
        self,
        client: openai.AsyncOpenAI,
        tenant: str,
        messages: list[ChatCompletionMessageParam],
        streamed: bool,
        max_tokens: int,
        moved: bool,
    ) -> RequestRecord:
        started = time.monotonic()
        create = client.chat.completions.with_raw_response.create
        finish: str | None = None
        reported: int | None = None
        headers: httpx2.Headers | None = None
        try:
            if streamed:
                raw_stream = await create(
                    model=MODEL,
                    messages=messages,
                    max_tokens=max_tokens,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                headers = raw_stream.headers
                async for chunk in raw_stream.parse():
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                    if chunk.usage is not None:
                        reported = _cached(chunk.usage)
            else:
                raw = await create(model=MODEL, messages=messages, max_tokens=max_tokens)
                headers = raw.headers
                completion = raw.parse()
                finish = completion.choices[0].finish_reason
                reported = _cached(completion.usage)
        except openai.APIStatusError as error:
            return self._status_error(tenant, streamed, error, started)
        except openai.APIConnectionError:
            if headers is None:
                raise  # nothing answered: the caller may try the other router
            detail = "connection broke mid-answer"
            return self._record(tenant, streamed, Outcome.FAILED, detail, started, headers)
        except openai.APIError as error:  # an error event in the stream: clear, not retried
            detail = f"error event mid-stream ({_kind(error)})"
            return self._record(tenant, streamed, Outcome.FAILED, detail, started, headers)
        except httpx2.HTTPError as error:  # the connection broke mid-answer: the client knows
            detail = f"connection broke mid-answer ({type(error).__name__})"
            return self._record(tenant, streamed, Outcome.FAILED, detail, started, headers)
        if finish is None:
            detail = "answer ended without a finish reason or an error"
            return self._record(tenant, streamed, Outcome.LOST, detail, started, headers)
        retried = moved or int(headers.get("x-kvplane-attempts", "1")) > 1
        outcome = Outcome.RETRIED if retried else Outcome.OK
        return self._record(tenant, streamed, outcome, "", started, headers, reported)

    def _status_error(
        self, tenant: str, streamed: bool, error: openai.APIStatusError, started: float
    ) -> RequestRecord:
        body = error.body  # openai hands over the body's "error" object when there is one
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            body = body["error"]
        if not isinstance(body, dict) or not body.get("message"):
            detail = f"HTTP {error.status_code} without an error message"
            return self._record(tenant, streamed, Outcome.LOST, detail, started)
        detail = f"HTTP {error.status_code} {body.get('type', '')}".rstrip()
        return self._record(tenant, streamed, Outcome.FAILED, detail, started)

    def _record(
        self,
        tenant: str,
        streamed: bool,
        outcome: Outcome,
        detail: str,
        started: float,
        headers: httpx2.Headers | None = None,
        reported: int | None = None,
    ) -> RequestRecord:
        headers = headers or httpx2.Headers()
        return RequestRecord(
            tenant=tenant,
            streamed=streamed,
            outcome=outcome,
            detail=detail,
            worker=headers.get("x-kvplane-worker"),
            predicted_cached_tokens=int(headers.get("x-kvplane-cached-tokens", "0")),
            reported_cached_tokens=reported,
            started=started,
            ended=time.monotonic(),
        )


def _cached(usage: object) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None)
    return cached if isinstance(cached, int) else None


def _kind(error: openai.APIError) -> str:
    body = error.body if isinstance(error.body, dict) else {}
    return str(body.get("type") or type(error).__name__)


def tally(records: Sequence[RequestRecord]) -> Counter[Outcome]:
    return Counter(record.outcome for record in records)
