"""`kvplane bench engine-sim`: how many short completions one simulator process serves
per second with time scale 0 (no modelled waiting: the figure is the simulator's own
overhead: HTTP, tokenisation, scheduling, block hashing, KV events).

The simulator runs as its own process with KV events on, as a fleet would run it; the
load comes from this process over HTTP keep-alive connections, `concurrency` requests in
flight at a time. Prompts are short texts; a quarter of them repeat an earlier prompt so
the prefix cache is exercised too.
"""

from __future__ import annotations

import asyncio
import json
import platform
import random
import socket
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import h11
import httpx2

from simulations.engine_sim.process import spawn_engine_sim

_WORDS = [
    "cache",
    "block",
    "token",
    "prefix",
    "router",
    "engine",
    "replica",
    "request",
    "model",
    "prompt",
    "answer",
    "question",
    "system",
    "user",
    "assistant",
    "memory",
    "fleet",
    "queue",
    "batch",
    "step",
]


@dataclass(frozen=True)
class EngineSimFigures:
    requests: int
    concurrency: int
    max_tokens: int
    seconds: float
    requests_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    errors: int


def _prompts(count: int, seed: int) -> list[str]:
    generator = random.Random(seed)
    distinct = [
        " ".join(generator.choice(_WORDS) for _ in range(16)) for _ in range(max(count // 4, 1))
    ]
    return [distinct[i] if i < len(distinct) else generator.choice(distinct) for i in range(count)]


async def _load(
    base_url: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    *,
    model: str | None = None,
) -> tuple[float, list[float], int]:
    """Send every prompt over `concurrency` keep-alive connections; returns the elapsed
    seconds, each request's latency and the number of non-200 answers. With `model` the
    bodies name it (a router requires one; the simulator defaults to its own).

    The client speaks HTTP/1.1 with h11 over asyncio streams rather than through httpx:
    httpx spends 2 to 6 ms of CPU per request here, more than the simulator itself, and
    on a 2-core machine the benchmark would measure its own client.
    """
    named = {} if model is None else {"model": model}
    bodies = [
        json.dumps({**named, "prompt": prompt, "max_tokens": max_tokens}).encode()
        for prompt in prompts
    ]
    latencies: list[float] = []
    errors = 0

    def answered(sent_at: float, answer: Answer) -> None:
        nonlocal errors
        latencies.append(time.perf_counter() - sent_at)
        errors += answer.status != 200

    seconds = await post_all(base_url, "/v1/completions", bodies, concurrency, answered)
    return seconds, latencies, errors


async def post_all(
    base_url: str,
    target: str,
    bodies: Iterable[bytes],
    concurrency: int,
    answered: Callable[[float, Answer], None],
) -> float:
    """POST each body to `target` over `concurrency` keep-alive connections, calling
    `answered(sent_at, answer)` as each answer ends; the seconds it all took."""
    url = httpx2.URL(base_url)
    host, port = url.host, url.port or 80
    pending = iter(bodies)

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        http = h11.Connection(h11.CLIENT)
        try:
            for body in pending:
                sent_at = time.perf_counter()
                _post(writer, http, host, target, body)
                answered(sent_at, await _read_answer(http, reader))
                http.start_next_cycle()
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return time.perf_counter() - start


def _post(
    writer: asyncio.StreamWriter, http: h11.Connection, host: str, target: str, body: bytes
) -> None:
    """Write one JSON POST on a kept-alive connection, in a single write."""
    headers = [
        ("Host", host),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(body))),
    ]
    request = h11.Request(method="POST", target=target, headers=headers)
    writer.write(
        (http.send(request) or b"")
        + (http.send(h11.Data(data=body)) or b"")
        + (http.send(h11.EndOfMessage()) or b"")
    )


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    first_body_at: float  # time.perf_counter() when its first body bytes came; 0: none
    events: int  # the server-sent events in it


async def _read_answer(http: h11.Connection, reader: asyncio.StreamReader) -> Answer:
    """Read one answer to its end."""
    status, first, events = 0, 0.0, 0
    while True:
        event = http.next_event()
        if event is h11.NEED_DATA:
            http.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            first = first or time.perf_counter()
            events += bytes(event.data).count(b"data: ")
        elif isinstance(event, h11.EndOfMessage):
            return Answer(status, first, events)
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionError("the server closed the connection")


def measure(requests: int, concurrency: int, max_tokens: int, seed: int) -> EngineSimFigures:
    flags = [
        *("--time-scale", "0", "--log-level", "WARNING"),
        *(
            "--kv-events-config",
            '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*"}',
        ),
    ]
    with spawn_engine_sim(*flags) as sim:
        seconds, latencies, errors = asyncio.run(
            _load(sim.base_url, _prompts(requests, seed), concurrency, max_tokens)
        )
    quantiles = statistics.quantiles(latencies, n=100)
    return EngineSimFigures(
        requests=requests,
        concurrency=concurrency,
        max_tokens=max_tokens,
        seconds=round(seconds, 3),
        requests_per_s=round(requests / seconds, 1),
        latency_p50_ms=round(quantiles[49] * 1000, 2),
        latency_p99_ms=round(quantiles[98] * 1000, 2),
        errors=errors,
    )


def run_engine_sim_benchmark(
    *, json_path: Path | None, requests: int, concurrency: int, max_tokens: int, seed: int = 1
) -> int:
    figures = measure(requests, concurrency, max_tokens, seed)
    print(
        f"engine-sim: {figures.requests:,} completions of {figures.max_tokens} tokens, "
        f"{figures.concurrency} in flight: {figures.requests_per_s:,.0f} requests/s "
        f"(p50 {figures.latency_p50_ms:.1f} ms, p99 {figures.latency_p99_ms:.1f} ms, "
        f"{figures.errors} errors)"
    )
    if json_path is not None:
        report = {
            "machine": {"python": platform.python_version(), "platform": platform.platform()},
            **asdict(figures),
        }
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {json_path}")
    return 0 if figures.errors == 0 else 1
