"""`kvplane demo`: kvplane against round-robin on the same fleet and the same traffic.

Three engine simulators with small caches and their agents, and a router with the
embedded index, all in this process on free loopback ports. The official OpenAI
client sends a multi-tenant workload (each tenant has a few long system prompts that
its requests share) through the router, once with kvplane's scoring and once with
round-robin on a fresh fleet, and the demo prints both side by side. Everything it
started is stopped before it returns.

`--route envoy` sends the same traffic through a real Envoy instead (`make envoy-env`),
configured as `kvplane envoy-config` writes it, whose ext_proc filter asks the router's
endpoint picker for each request's replica (docs/picker.md). Round-robin then runs
through the same Envoy and picker, the router on `--policy round-robin`: both columns
pay the same hop. Envoy's config and log live in a temporary directory; Envoy is
stopped before the demo returns.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import openai
from pydantic import SecretStr

from kvplane.core.config import (
    ControlPlaneSettings,
    HttpSettings,
    IndexSettings,
    PickerSettings,
    ScoringSettings,
    Settings,
    TenantSettings,
    TenantSpec,
)
from kvplane.core.flags import add_common_flags, settings_from_args
from kvplane.core.logsetup import configure_logging
from router.app import RunningRouter, running_router
from router.check import BlindFleet, require_wiring
from router.picker.protocol import endpoint_of
from router.tenants import api_key_digest
from simulations.local_envoy import EnvoyMissing, find_envoy, local_envoy
from simulations.local_workers import LocalWorker, local_workers
from simulations.reporting import format_table, percentile

MODEL = "kvplane-tiny"
WORKERS = 3
TENANTS = ("acme", "globex", "initech")
PREFIXES_PER_TENANT = 2
REQUESTS = 180
CONCURRENCY = 6
ADMIN_TOKEN = "kvplane-demo-admin"  # the router listens on loopback only
MAX_TOKENS = 8
# Each worker caches about two prefix groups: kvplane can keep every group on one
# worker; round-robin makes every worker hold all six, and they evict each other.
SIM_OPTIONS = {"num_gpu_blocks_override": 160, "time_scale": 1.0, "max_num_seqs": 8}
_TOPICS = ("billing", "shipping", "returns", "warranty", "accounts", "security")
ROUTES = ("proxy", "envoy")
POLICIES = ("kvplane", "round-robin")
ENVOY_CAPTION = (
    "Both columns through the same Envoy (`kvplane envoy-config`'s bootstrap) and the\n"
    "router's endpoint picker; round-robin: the router on --policy round-robin."
)


@dataclass(frozen=True, slots=True)
class DemoRequest:
    tenant: str
    system: str
    question: str


@dataclass(slots=True)
class RunResult:
    policy: str
    seconds: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    per_worker: Counter[str] = field(default_factory=Counter)
    failed: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def workload(seed: int = 7) -> list[DemoRequest]:
    """Each tenant's few long system prompts, each request one of them and a question;
    the order is shuffled, so the groups interleave."""
    rng = random.Random(seed)
    systems = {
        tenant: [
            f"You are {tenant}'s assistant for {topic}. "
            + " ".join(
                f"Rule {n}: answer {topic} questions for {tenant} politely." for n in range(40)
            )
            for topic in rng.sample(_TOPICS, PREFIXES_PER_TENANT)
        ]
        for tenant in TENANTS
    }
    requests = []
    for number in range(REQUESTS):
        tenant = rng.choice(TENANTS)
        requests.append(
            DemoRequest(tenant, rng.choice(systems[tenant]), f"Question {number}: what now?")
        )
    return requests


def _settings(policy: str, *, picker: bool = False) -> Settings:
    return Settings(
        index=IndexSettings(backend="memory"),
        control_plane=ControlPlaneSettings(grpc_port=0),
        http=HttpSettings(port=0, admin_token=SecretStr(ADMIN_TOKEN)),
        scoring=ScoringSettings(policy=policy),  # type: ignore[arg-type]
        tenants=TenantSettings(
            tenants=[
                TenantSpec(name=tenant, api_key_sha256=[api_key_digest(_key(tenant))])
                for tenant in TENANTS
            ],
            cache_salt_secret=SecretStr("kvplane-demo"),
        ),
        picker=PickerSettings(port=0 if picker else None),
    )


def _key(tenant: str) -> str:
    return f"sk-demo-{tenant}"


@dataclass(frozen=True, slots=True)
class _Fleet:
    router: RunningRouter
    workers: list[LocalWorker]
    base_url: str  # the router's OpenAI API: http://127.0.0.1:PORT/v1


@contextlib.asynccontextmanager
async def _fleet(policy: str, *, picker: bool = False) -> AsyncIterator[_Fleet]:
    """A router (with its endpoint picker, if asked) and its workers, once all are
    routable and proven wired."""
    async with (
        running_router(_settings(policy, picker=picker)) as router,
        local_workers(WORKERS, grpc_port=router.grpc_port, sim_options=SIM_OPTIONS) as workers,
    ):
        deadline = time.monotonic() + 10
        while len(router.pool.candidates(MODEL)) < len(workers):
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not register with the router")
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{router.http_port}"
        # Figures from a blind fleet would not be kvplane's: refused (BlindFleet).
        verdict = await asyncio.to_thread(require_wiring, url, ADMIN_TOKEN)
        print(f"  wiring checked: {len(verdict.workers)} workers, no check failed", flush=True)
        yield _Fleet(router, workers, url + "/v1")


async def run_policy(
    policy: str,
    requests: Sequence[DemoRequest],
    *,
    envoy: Path | None = None,
    work_dir: Path | None = None,
) -> RunResult:
    """The requests through a fresh fleet routed by `policy`: through the router's
    proxy, or with `envoy` (its binary) through Envoy asking the router's picker, its
    config and log in `work_dir`."""
    if envoy is None:
        result = RunResult(policy)
        async with _fleet(policy) as fleet:
            await _drive(fleet.base_url, requests, result)
        return result
    if work_dir is None:
        raise ValueError("an Envoy run needs a work_dir for its config and log")
    result = RunResult(f"{policy} via Envoy")
    async with _fleet(policy, picker=True) as fleet:
        assert fleet.router.picker_port is not None
        workers = {endpoint_of(worker.base_url): worker.worker_id for worker in fleet.workers}
        async with local_envoy(
            envoy,
            work_dir,
            endpoints=list(workers),
            pickers=[f"127.0.0.1:{fleet.router.picker_port}"],
        ) as front:
            print("  Envoy ready, its picker healthy", flush=True)
            await _drive(front.url + "/v1", requests, result)
            # An answer through Envoy comes from the engine itself: Envoy says who served.
            for endpoint, count in (await front.upstream_requests()).items():
                result.per_worker[workers.get(endpoint, endpoint)] += count
    return result


async def _drive(base_url: str, requests: Sequence[DemoRequest], result: RunResult) -> None:
    """The requests, CONCURRENCY at a time, each tenant's with its own key."""
    clients = {
        tenant: openai.AsyncOpenAI(base_url=base_url, api_key=_key(tenant), max_retries=0)
        for tenant in TENANTS
    }
    queue: asyncio.Queue[DemoRequest] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)

    async def client_loop() -> None:
        while not queue.empty():
            request = queue.get_nowait()
            try:
                await _send(clients[request.tenant], request, result)
            except openai.APIError:
                result.failed += 1

    started = time.monotonic()
    try:
        await asyncio.gather(*(client_loop() for _ in range(CONCURRENCY)))
    finally:
        result.seconds = time.monotonic() - started
        for client in clients.values():
            await client.close()


async def _send(client: openai.AsyncOpenAI, request: DemoRequest, result: RunResult) -> None:
    sent = time.perf_counter()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": request.system},
            {"role": "user", "content": request.question},
        ],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    first_token_at = None
    usage = None
    async for chunk in raw.parse():
        if first_token_at is None and chunk.choices and chunk.choices[0].delta.content:
            first_token_at = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
    worker = raw.headers.get("x-kvplane-worker")  # the proxy's; Envoy's counted apart
    if worker is not None:
        result.per_worker[worker] += 1
    if first_token_at is not None:
        result.ttft_s.append(first_token_at - sent)
    if usage is not None:
        result.prompt_tokens += usage.prompt_tokens
        details = usage.prompt_tokens_details
        result.cached_tokens += details.cached_tokens or 0 if details is not None else 0


def render_table(results: Sequence[RunResult]) -> str:
    workers = sorted({worker for result in results for worker in result.per_worker})
    rows = [
        ("", *(result.policy for result in results)),
        ("cache hit rate", *(f"{result.hit_rate:.1%}" for result in results)),
        ("prefill tokens saved", *(f"{result.cached_tokens:,}" for result in results)),
        ("TTFT p50", *(f"{percentile(r.ttft_s, 0.5) * 1000:.0f} ms" for r in results)),
        ("TTFT p99", *(f"{percentile(r.ttft_s, 0.99) * 1000:.0f} ms" for r in results)),
        *(
            (f"requests on {worker}", *(str(r.per_worker[worker]) for r in results))
            for worker in workers
        ),
        ("failed requests", *(str(result.failed) for result in results)),
        ("wall time", *(f"{result.seconds:.1f} s" for result in results)),
    ]
    return format_table(rows)


async def run_demo(
    settings: Settings | None = None, *, route: str = "proxy", envoy: Path | None = None
) -> int:
    """Run both policies and print the comparison; 0 on success, 1 on failure, 2 when
    `route` is "envoy" and there is no Envoy to run (`envoy`, or `find_envoy`'s).

    The demo builds its own settings (free ports, memory index, demo tenants); of the
    caller's it keeps the log level, raised to WARNING unless DEBUG was asked for: the
    components' routine INFO lines would bury the report."""
    if route not in ROUTES:
        raise ValueError(f"route {route!r}: one of {ROUTES}")
    envoy_binary = None
    if route == "envoy":
        try:
            envoy_binary = find_envoy(envoy)
        except EnvoyMissing as error:
            print(f"kvplane demo --route envoy: {error}", file=sys.stderr)
            return 2
    if settings is None or settings.logging.level != "DEBUG":
        logging.getLogger().setLevel(max(logging.WARNING, logging.getLogger().level))
    started = time.monotonic()
    requests = workload()
    print(
        f"kvplane demo: {WORKERS} simulated engines ({SIM_OPTIONS['num_gpu_blocks_override']} "
        f"KV blocks each), {len(TENANTS)} tenants x {PREFIXES_PER_TENANT} shared system "
        f"prompts, {len(requests)} streamed chat requests, {CONCURRENCY} at a time"
        + ("" if envoy_binary is None else f", through Envoy ({envoy_binary})")
    )
    try:
        results = []
        with contextlib.ExitStack() as stack:
            work_dir = None
            if envoy_binary is not None:  # Envoy's config and log; removed at the end
                temporary = tempfile.TemporaryDirectory(prefix="kvplane-demo-envoy-")
                work_dir = Path(stack.enter_context(temporary))
            for policy in POLICIES:
                print(f"running with {policy} routing ...", flush=True)
                results.append(
                    await run_policy(policy, requests, envoy=envoy_binary, work_dir=work_dir)
                )
    except BlindFleet as error:
        print(f"demo refused to measure: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # the demo's one job is to say clearly what failed
        print(f"demo failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print()
    if envoy_binary is not None:
        print(ENVOY_CAPTION + "\n")
    print(render_table(results))
    print(f"\ndemo finished in {time.monotonic() - started:.1f} s")
    return 1 if any(result.failed for result in results) else 0


def main(argv: Sequence[str], prog: str = "kvplane demo") -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Three simulated engines behind the router: kvplane's "
        "routing against round-robin, on the same fleet and the same traffic."
    )  # fmt: skip
    add_common_flags(parser)
    parser.add_argument(
        "--route",
        choices=ROUTES,
        default="proxy",
        help="proxy: through the router's OpenAI proxy (the default); envoy: through a real "
        "Envoy asking the router's endpoint picker (`make envoy-env`)",
    )
    parser.add_argument(
        "--envoy",
        type=Path,
        help="the Envoy binary for --route envoy (default: .envoy-venv's, then the PATH's)",
    )
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    configure_logging(settings.logging)
    return asyncio.run(run_demo(settings, route=args.route, envoy=args.envoy))
