"""What every abuse test needs: a running fleet (router, simulated engines, their agents,
over loopback), a picture of the index to compare before and after, and one normal
request that must still be served afterwards, and reach the index."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.core.tokenizer import load_tokenizer
from router.app import RunningRouter
from router.index.base import PrefixMatch, WorkerState
from tests.router.proxy.conftest import ADMIN_TOKEN, MODEL, TENANT_KEYS, RoutedFleet
from tests.waiting import wait_until

SECRET = "zebra-canary-7731"
"""Prompt text that must never come back in an error body."""
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
# A short context (the longest generation is quick, and a prompt a little under the
# router's body limit is over it), and a cache no test's traffic evicts the probes from.
SIM_OPTIONS = {"max_model_len": 512, "num_gpu_blocks_override": 4096}
# Each tenant's prompt, cached before the abuse: its lookups must not change.
PROBE_PROMPTS = {
    tenant: f"{tenant} keeps its own system prompt, block after block, in its own scope. " * 4
    for tenant in TENANT_KEYS
}
_served = itertools.count(1)


def auth(tenant: str = "acme") -> dict[str, str]:
    return {"authorization": f"Bearer {TENANT_KEYS[tenant]}"}


def block_keys(router: RunningRouter, prompt: str, tenant: str) -> list[int]:
    """The index keys of `prompt`'s full blocks in `tenant`'s cache scope."""
    record = router.tenants.authenticate(auth(tenant)["authorization"])
    assert record is not None
    assert record.cache_salt is not None
    tokens = load_tokenizer().completion_tokens(prompt)
    return router.planner.keys(MODEL, record.cache_salt, tokens)


@dataclass(frozen=True)
class IndexPicture:
    """What must not change when bad input is refused: every count, every worker's
    registration, and the lookups of each tenant's cached prompt."""

    keys: int
    entries: int
    workers: list[tuple[str, int, WorkerState, int]]  # id, incarnation, state, entries
    lookups: dict[str, dict[str, PrefixMatch]]


async def index_picture(router: RunningRouter) -> IndexPicture:
    stats = await router.index.stats()
    return IndexPicture(
        keys=stats.keys,
        entries=stats.entries,
        workers=sorted(
            (w.info.worker_id, w.info.incarnation, w.state, w.entries)
            for w in await router.index.workers()
        ),
        lookups={
            tenant: await router.index.lookup(block_keys(router, prompt, tenant))
            for tenant, prompt in PROBE_PROMPTS.items()
        },
    )


async def cache_and_wait(fleet: RoutedFleet, prompt: str, tenant: str = "acme") -> str:
    """Send `prompt` through the official OpenAI client (it must succeed) and wait until
    the index holds all its blocks on the worker that answered, so that no event of it
    is still on its way when the test takes a picture. Returns that worker."""
    async with fleet.openai(tenant) as client:
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=1
        )
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].text
    worker = raw.headers["x-kvplane-worker"]
    await wait_indexed(fleet, prompt, tenant, worker)
    return worker


async def wait_indexed(fleet: RoutedFleet, prompt: str, tenant: str, worker: str) -> None:
    """Until the index holds all of `prompt`'s blocks on `worker`."""
    keys = block_keys(fleet.router, prompt, tenant)
    assert keys

    async def indexed() -> bool:
        match = (await fleet.router.index.lookup(keys)).get(worker)
        return match is not None and match.blocks == len(keys)

    await wait_until(f"{worker} has the prompt's {len(keys)} blocks in the index", indexed)


async def prime(fleet: RoutedFleet) -> None:
    """Cache each tenant's probe prompt, so that its lookups have something to lose."""
    for tenant, prompt in PROBE_PROMPTS.items():
        await cache_and_wait(fleet, prompt, tenant)


async def still_serves(fleet: RoutedFleet, tenants: Sequence[str] = ("acme",)) -> None:
    """A new prompt is answered and its blocks reach the index: the proxy, the engines,
    the agents' streams and the index all still work."""
    for tenant in tenants:
        await cache_and_wait(fleet, f"request {next(_served)} after the abuse. " * 6, tenant)
