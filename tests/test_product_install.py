"""A product-only install (no `kvplane[sim]` extra, no tool packages) runs the router and
the agent and serves a fleet's traffic; the tools say which extra they need."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.one_worker_stack import one_worker_stack
from tests.waiting import wait_until

PRODUCT_ONLY = "tests.product_only"
ADMIN_TOKEN = "product-only-admin"
PROMPT = "You are a careful assistant who answers in one short sentence. " * 8


@pytest.fixture
def product_fleet() -> Iterator[str]:
    """The router's URL: an engine simulator (a tool, run as usual) with a product-only
    router and agent in front of it."""
    with one_worker_stack(
        "product-only", router_env={"KVPLANE_HTTP__ADMIN_TOKEN": ADMIN_TOKEN}, module=PRODUCT_ONLY
    ) as fleet:
        yield fleet.router_url


@pytest.mark.slow
async def test_product_only_router_and_agent_route_a_fleets_traffic(product_fleet: str) -> None:
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    async with httpx.AsyncClient(base_url=product_fleet, timeout=10) as client:

        async def worker_live() -> bool:
            workers = (await client.get("/fleet/workers", headers=admin)).json()["workers"]
            return any(w["worker_id"] == "product-only" and w["state"] == "live" for w in workers)

        await wait_until("the agent registers", worker_live, 20)
        body = {"model": "kvplane-tiny", "messages": [{"role": "user", "content": PROMPT}]}
        response = await client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert response.headers["x-kvplane-worker"] == "product-only"
        assert response.json()["choices"][0]["message"]["content"]

        async def blocks_indexed() -> bool:
            workers = (await client.get("/fleet/workers", headers=admin)).json()["workers"]
            return sum(w["index_entries"] for w in workers) > 0

        # The engine's KV events went through the product-only agent into the index.
        await wait_until("the prompt's blocks reach the index", blocks_indexed, 20)
        # The fleet page's files are in the product's install.
        page = await client.get("/fleet/page.js")
        assert page.status_code == 200
        assert "fleet API" in page.text


def test_a_tool_without_its_extra_says_which_extra_to_install() -> None:
    result = subprocess.run(
        [sys.executable, "-m", PRODUCT_ONLY, "sim", "--workload", "shared-prefix"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "pip install 'kvplane[sim]'" in result.stderr
    assert "Traceback" not in result.stderr
