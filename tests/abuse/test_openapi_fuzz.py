"""Schemathesis against the router's own OpenAPI description (GET /openapi.json), on a
running fleet: two simulated engines with their agents, the router on loopback ports.

Every operation gets generated requests: valid ones with valid credentials (they reach
the handlers and the engines), invalid ones with valid credentials (bodies, paths and
bytes that are wrong), and invalid ones with generated credentials. No answer may be a
5xx (the workers stay live, so not even the documented 503s), and every answer must
match the description: status, content type, headers, body. After each operation the
fleet still serves the official client, and nothing of the other tenant's in the index
changed.

Why a real port and a thread: the router runs in the test's event loop with its gRPC
server, agents and upstream connections (as in every proxy test). Schemathesis calls
synchronously (requests), so Hypothesis runs in a worker thread while the loop serves.
Schemathesis' ASGI transport would run the app in an event loop of its own (Starlette's
TestClient), away from the router's connections and background tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import APIOperation, Case, CheckContext, GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.specs.openapi.schemas import OpenApiSchema

from tests.abuse.conftest import (
    ADMIN,
    SIM_OPTIONS,
    IndexPicture,
    auth,
    index_picture,
    prime,
    still_serves,
)
from tests.router.proxy.conftest import MODEL, RoutedFleet, routed_fleet, router_settings

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

EXAMPLES = 25  # per operation, of valid and of invalid requests
WRONG_CREDENTIALS_EXAMPLES = 8
MAX_BODY_BYTES = 64 * 1024
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Every operation of the document the router serves (test_every_operation_is_fuzzed
# holds the two together); listed here because the document is generated from a running
# router's routes, and the tests are made before one runs.
OPERATIONS = [
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/openapi.json"),
    ("GET", "/metrics"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/fleet/workers"),
    ("GET", "/fleet/funnel"),
    ("GET", "/fleet/flow"),
    ("GET", "/fleet/prefixes"),
    ("POST", "/fleet/check"),
    ("POST", "/fleet/locality"),
    ("GET", "/fleet/index"),
    ("POST", "/fleet/workers/{worker_id}/drain"),
    ("POST", "/fleet/workers/{worker_id}/undrain"),
    ("POST", "/fleet/tenants/{name}/purge"),
    ("POST", "/fleet/tenant/locality"),
    ("GET", "/fleet/page"),
    ("GET", "/fleet/page.js"),
    ("GET", "/fleet/page.css"),
]


@dataclass
class FuzzedFleet:
    fleet: RoutedFleet
    schema: OpenApiSchema
    before: IndexPicture


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fuzzed() -> AsyncIterator[FuzzedFleet]:
    config = router_settings(proxy={"max_body_bytes": MAX_BODY_BYTES})
    async with routed_fleet(2, config, sim_options=SIM_OPTIONS) as fleet:
        await prime(fleet)
        # The document the router serves, not the module's: the route is under test too.
        schema = await asyncio.to_thread(schemathesis.openapi.from_url, fleet.url + "/openapi.json")
        schema.validate()  # against the OpenAPI 3.1 schema
        yield FuzzedFleet(fleet, schema, await index_picture(fleet.router))


def no_server_error(ctx: CheckContext, response: schemathesis.Response, case: Case[Any]) -> None:
    """Not even the documented 503s (no live worker, none answered): the workers stay
    live throughout, so a 503 here would mean that an input broke an engine."""
    assert response.status_code < 500, (
        f"{response.status_code} from {case.operation.label}: {response.text[:300]}"
    )


CHECKS: list[Callable[..., Any]] = [
    no_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def valid_credentials(path: str) -> dict[str, str]:
    if path == "/metrics" or (path.startswith("/fleet/") and path != "/fleet/tenant/locality"):
        return ADMIN
    return auth("acme") if path.startswith(("/v1/", "/fleet/")) else {}


def served_model(case: Case[Any]) -> Case[Any]:
    assert isinstance(case.body, dict)
    case.body = {**case.body, "model": MODEL}
    return case


def fuzz(schema: OpenApiSchema, base_url: str, method: str, path: str) -> None:
    """Runs in a worker thread: Hypothesis and requests block."""
    operation = schema[path][method]
    definition = operation.definition.raw
    credentials = valid_credentials(path)
    fuzz_cases(base_url, operation, GenerationMode.POSITIVE, credentials)
    if definition.get("parameters") or definition.get("requestBody"):
        fuzz_cases(base_url, operation, GenerationMode.NEGATIVE, credentials)
    if definition.get("security"):
        # Schemathesis generates the Authorization header too: missing, malformed, wrong.
        fuzz_cases(base_url, operation, GenerationMode.NEGATIVE, None, WRONG_CREDENTIALS_EXAMPLES)


def fuzz_cases(
    base_url: str,
    operation: APIOperation[Any, Any, Any, Any],
    mode: GenerationMode,
    headers: dict[str, str] | None,
    examples: int = EXAMPLES,
) -> None:
    session = requests.Session()
    checks = [*CHECKS, negative_data_rejection] if mode.is_negative else CHECKS
    cases = operation.as_strategy(mode, headers=headers)
    if mode.is_positive and operation.path in GENERATION_PATHS:
        # Any model name is valid, but only the served one reaches a generation.
        cases = cases.map(served_model)

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,  # the same cases on every run: CI is reproducible
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def call(case: Case[Any]) -> None:
        response = case.call(base_url=base_url, session=session, timeout=30)
        case.validate_response(response, checks=checks)

    call()


async def test_every_operation_is_fuzzed(fuzzed: FuzzedFleet) -> None:
    async with fuzzed.fleet.http() as http:
        paths = (await http.get("/openapi.json")).json()["paths"]
    documented = [(method.upper(), path) for path, methods in paths.items() for method in methods]
    assert sorted(documented) == sorted(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
async def test_generated_requests_get_documented_answers_and_change_nothing(
    fuzzed: FuzzedFleet, method: str, path: str
) -> None:
    fleet = fuzzed.fleet
    await asyncio.to_thread(fuzz, fuzzed.schema, fleet.url, method, path)

    after = await index_picture(fleet.router)
    # Only acme's key was used: globex's cached prompt is where it was, and no worker
    # was reset, dropped or drained.
    assert after.lookups["globex"] == fuzzed.before.lookups["globex"]
    assert [w[:3] for w in after.workers] == [w[:3] for w in fuzzed.before.workers]
    assert not fleet.router.pool.drained
    async with fleet.openai("globex") as client:
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Still there?"}], max_tokens=3
        )
    assert chat.choices[0].message.content
    await still_serves(fleet)
